"""Mixture-of-Experts GPT: Mixtral-style blocks whose MLP is a token-choice top-k MoE layer.

Same pipeline layout and protocol as :class:`~lightning_dynmo.models.GPT`; every ``moe_every``-th
block (``(i + 1) % moe_every == 0``, torchtitan's ``interleave_moe_layer_step``) is an
:class:`MoEBlock` whose MLP is an :class:`MoELayer`: a router, ``num_experts`` SwiGLU experts and
an optional always-on shared expert (DeepSeek-MoE).

Per-sequence statistics
-----------------------
The pipeline splits a batch into micro-batches along dim 0 and averages their losses and
gradients, and training must equal full-batch training. So nothing here depends on which rows
share a forward pass: capacity is per sequence (``ceil(capacity_factor * T * top_k / E)`` slots
per expert and row), the load-balancing loss is the sequence-wise form of DeepSeek-V2 (per row
``E / (T k) * sum_i count_i * mean_t p_i``, then the mean over rows), and the z-loss is a mean over
each row's tokens, then over rows. A micro-batch's auxiliary loss is the mean over its rows, like
its cross-entropy, so the micro-batch average is the full-batch value.

Auxiliary losses without travelling through the pipeline
--------------------------------------------------------
Pipeline layers pass exactly one tensor, so an MoE layer cannot hand its loss to the last stage.
As in Megatron-Core (``MoEAuxLossAutoScaler``), :func:`~lightning_dynmo.models._aux_loss.attach_aux_loss`
ties the loss to the layer's output: forward is the identity, backward also seeds the loss with
gradient 1, so its gradient reaches the router in the backward pass that already runs through the
layer. ``pipeline_loss`` and the loss ``training_step`` returns stay plain cross-entropy (logged
losses compare equal with and without the pipeline); the gradients are those of ``CE + aux``.

Load signal
-----------
Each :class:`MoEBlock` is a :class:`~lightning_dynmo.protocol.ReportsLoad`: it counts the tokens
each expert actually processed (after capacity dropping) in its training forwards and, under
expert parallelism, the slots its group's busiest expert shard received (what the layer's time
follows), as device tensors, and converts them only when read: ``load_factor()`` for the strategy's cost model,
``routing_stats()`` for :class:`~lightning_dynmo.callbacks.moe.MoELoadMonitor`.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .._aux_loss import attach_aux_loss, configure_aux_loss, reset_aux_loss
from ..gpt import GPT, Block, GPTConfig
from ..gpt.granularity import AttentionHalf, MLPHalf
from .config import MoEConfig
from .experts import GroupedExperts, SwiGLU
from .load import MoELoad, RoutingCounts, RoutingStats, _records_routing, routed_tokens
from .router import TopKRouter, load_balancing_loss, router_z_loss

__all__ = ["MoEBlock", "MoEGPT", "MoEHalf", "MoELayer", "has_moe_mlp", "install_moe", "moe_block_ids"]


class MoELayer(nn.Module):
    """Router + routed experts (+ shared expert): ``[B, T, C] -> [B, T, C]``.

    Each token's output is ``sum_{kept slots} weight * expert(x) (+ shared(x))``; a dropped slot
    contributes nothing (the token still passes through the block's residual). While recording
    (training with grad) the layer attaches ``aux_loss_coeff * load_balancing_loss +
    z_loss_coeff * router_z_loss`` to its output with ``attach_aux_loss`` and adds to two
    :class:`RoutingCounts` windows, one per reader so neither resets the other's: ``load_window``
    (the strategy's per-step load signal) and ``stats_window`` (monitoring callbacks).

    ``aux_loss_coeff`` and ``z_loss_coeff`` are plain attributes, so a callback may schedule them.

    ``forward(x, valid)``: ``valid [B, T]`` bool marks the real tokens of packed rows (a
    :class:`~lightning_dynmo.models.MoDBlock`'s padding slots are ``False``). Only valid tokens
    are routed to the experts (and the shared expert); padding slots get output 0 and count in
    no statistic; the aux losses are per-row means over each row's valid tokens (a row without
    one contributes 0 but still counts in the mean over rows, so micro-batching stays exact).
    Dropless routing only: per-sequence capacity is not defined for packed rows.
    """

    def __init__(self, dim: int, expert_hidden: int, config: MoEConfig):
        super().__init__()
        self.num_experts = int(config.num_experts)
        self.top_k = int(config.top_k)
        self.aux_loss_coeff = float(config.aux_loss_coeff)
        self.z_loss_coeff = float(config.z_loss_coeff)
        self.router = TopKRouter(dim, config)
        self.experts = GroupedExperts(dim, expert_hidden, self.num_experts, config.grouped_mm)
        shared = config.shared_expert
        shared_hidden = expert_hidden if shared is True else int(shared)
        self.shared_expert = SwiGLU(dim, shared_hidden) if shared else None
        self.load_window = RoutingCounts()
        self.stats_window = RoutingCounts()
        # whether the layer's relative work counts its block's attention (False once the block is
        # split into sublayers: the attention is then a pipeline layer of its own)
        self.with_attention = True

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float) -> None:
        """GPT-2 init: ``std`` for input projections and the router, ``residual_std`` for the
        projections back into the residual stream."""
        nn.init.normal_(self.router.gate.weight, 0.0, std)
        nn.init.normal_(self.experts.w1, 0.0, std)
        nn.init.normal_(self.experts.w3, 0.0, std)
        nn.init.normal_(self.experts.w2, 0.0, residual_std)
        if self.shared_expert is not None:
            nn.init.normal_(self.shared_expert.w1.weight, 0.0, std)
            nn.init.normal_(self.shared_expert.w3.weight, 0.0, std)
            nn.init.normal_(self.shared_expert.w2.weight, 0.0, residual_std)

    @property
    def macs_per_slot(self) -> int:
        """Multiply-accumulates of one token through one routed expert."""
        return 3 * self.experts.dim * self.experts.hidden

    @property
    def fixed_macs_per_token(self) -> int:
        """Routing-independent MACs per token: the router and the shared expert."""
        shared = 0 if self.shared_expert is None else 3 * self.experts.dim * self.shared_expert.w1.out_features
        return self.experts.dim * self.num_experts + shared

    # ------------------------------------------------------------------ statistics
    def relative_work(self, tokens: int, causal_pairs: int, busiest: int) -> float:
        """The work of this layer's block (of the MoE half alone, ``with_attention=False``)
        relative to dropless, balanced routing (see :class:`MoEBlock`)."""
        c = self.experts.dim
        fixed = tokens * self.fixed_macs_per_token
        if self.with_attention:
            fixed += tokens * 4 * c * c + 2 * c * causal_pairs
        full = fixed + tokens * self.top_k * self.macs_per_slot
        return (fixed + busiest * self.macs_per_slot) / full

    def window_work(self, window: RoutingCounts) -> float:
        if window.tokens == 0:
            return 1.0
        return self.relative_work(window.tokens, window.causal_pairs, int(window.busiest_slots))

    def routing_stats(self) -> RoutingStats | None:
        """The monitoring window since :meth:`reset_routing_stats` (``None``: no forward)."""
        window = self.stats_window
        if window.forwards == 0:
            return None
        counts = window.expert_tokens.cpu()
        kept = int(counts.sum())
        return RoutingStats(
            relative_work=self.window_work(window),
            expert_counts=counts,
            dropped_fraction=1.0 - kept / (window.tokens * self.top_k) if window.tokens else 0.0,
            balance_loss=float(window.balance_loss_sum) / window.forwards,
        )

    def reset_routing_stats(self) -> None:
        self.stats_window = RoutingCounts()

    # ------------------------------------------------------------------ forward
    def forward(self, x: Tensor, valid: Tensor | None = None) -> Tensor:
        b, t, c = x.shape
        k = self.top_k
        if valid is not None:
            if self.router.capacity_factor is not None:
                raise ValueError(
                    f"MoELayer(valid=...) supports dropless routing only (capacity_factor=None), got "
                    f"capacity_factor={self.router.capacity_factor}: per-sequence capacity is not defined "
                    "for packed rows with padding"
                )
            if valid.shape != (b, t) or valid.dtype != torch.bool:
                raise ValueError(f"valid must be a [B, T] = {[b, t]} bool mask, got {list(valid.shape)} {valid.dtype}")
        routing = self.router(x)
        slots = torch.arange(b * t * k, device=x.device)
        if routing.keep is not None:
            # Host sync: the number of kept slots sizes the expert GEMMs (dropping saves work).
            slots = slots[routing.keep.reshape(-1)]
        elif valid is not None:
            # Host sync: only valid tokens' slots reach the experts
            slots = slots[valid[..., None].expand(b, t, k).reshape(-1)]
        slot_expert = routing.experts.reshape(-1)[slots]
        order = torch.argsort(slot_expert, stable=True)  # group slots by expert, token order kept
        slots = slots[order]
        counts = torch.bincount(slot_expert, minlength=self.num_experts)
        tokens = slots // k
        flat = x.reshape(b * t, c)
        y, shard_slots = self.experts(flat[tokens], counts)
        y = y * routing.weights.reshape(-1)[slots, None].to(y.dtype)
        out = torch.zeros(b * t, c, dtype=y.dtype, device=x.device).index_add_(0, tokens, y)
        if self.shared_expert is not None:
            if valid is None:
                out = out + self.shared_expert(flat)
            else:
                real = valid.reshape(-1).nonzero().squeeze(1)
                out = out.index_add(0, real, self.shared_expert(flat[real]).to(out.dtype))
        out = out.view(b, t, c)

        if not _records_routing(self):
            return out
        wants_balance_grad = self.aux_loss_coeff > 0
        with torch.set_grad_enabled(wants_balance_grad):
            balance = load_balancing_loss(routing.probs, routing.experts, self.num_experts, valid)
        tokens, pairs = routed_tokens(b, t, valid)
        for window in (self.load_window, self.stats_window):
            window.add(tokens, pairs, counts, shard_slots.max(), balance)
        aux_loss = balance * self.aux_loss_coeff if wants_balance_grad else None
        if self.z_loss_coeff > 0:
            z = router_z_loss(routing.logits, valid) * self.z_loss_coeff
            aux_loss = z if aux_loss is None else aux_loss + z
        return out if aux_loss is None else attach_aux_loss(out, aux_loss, 1.0)


class MoEBlock(MoELoad, Block):
    """Pre-LN block whose MLP is an :class:`MoELayer`; a :class:`~lightning_dynmo.protocol.ReportsLoad`.

    ``load_factor()`` is the block's time relative to dropless, balanced routing, counted in
    multiply-accumulates (:meth:`relative_work`)::

        (F + busiest * S) / (F + tokens * top_k * S)

    ``F``: routing-independent work of the recorded forwards, ``tokens * (4 C^2 + C E + 3 C H_shared)
    + 2 C * causal_pairs`` (attention projections, router, shared expert, causal attention scores
    and values); ``S = 3 C H``: one token through one routed expert; ``tokens``: this replica's
    tokens; ``busiest``: per forward, the expert slots the busiest expert shard received, summed
    over forwards.

    * Without expert parallelism the one shard is all experts on this rank's own tokens:
      ``busiest`` is the slots kept after capacity dropping, so dropless routing gives 1.0 however
      tokens spread over experts, and dropped tokens lower it.
    * With ``expert_parallel = ep`` shard ``j`` receives the slots the ``ep`` replicas of its group
      route to its experts. The token ``all_to_all`` synchronises the group, so every replica
      waits for the shard that received most: the max, not the mean, sets the layer's time. At
      balance each shard receives ``tokens * top_k`` (the group's slots over ``ep``), so balanced
      dropless routing gives 1.0 and all slots on one shard ``(F + ep D S) / (F + D S)`` with
      ``D = tokens * top_k``. The counts come from the exchange that sizes the dispatch (no
      extra collective), so every replica of the group reports the same value.

    ``load_factor``/``reset_load`` read and restart the strategy's window; ``routing_stats``/
    ``reset_routing_stats`` a separate one for monitoring, so the two readers never reset each
    other's counts.

    At sublayer granularity it splits into its attention half and an :class:`MoEHalf`, whose
    load counts the MoE layer's work alone (``F`` without the attention's terms).
    """

    def __init__(self, config: GPTConfig, moe: MoEConfig, expert_hidden: int):
        super().__init__(config)
        self.mlp = MoELayer(config.n_embd, expert_hidden, moe)

    def relative_work(self, tokens: int, causal_pairs: int, busiest: int) -> float:
        """``(F + busiest * S) / (F + tokens * top_k * S)`` (see the class docstring) for forwards
        over ``tokens`` tokens with ``causal_pairs`` causal (query, key) pairs, whose busiest expert
        shard received ``busiest`` slots (summed over the forwards)."""
        return self.mlp.relative_work(tokens, causal_pairs, busiest)

    def split_sublayers(self) -> tuple[nn.Module, nn.Module]:
        self.mlp.with_attention = False
        return AttentionHalf(self), MoEHalf(self)


class MoEHalf(MoELoad, MLPHalf):
    """The MoE half of an :class:`MoEBlock` (``x + moe(ln_2(x))``, sublayer granularity): the
    routing counters and the load of the block's MoE layer."""


def has_moe_mlp(layer: nn.Module) -> bool:
    """Whether ``layer``'s MLP is an :class:`MoELayer`: an :class:`MoEBlock`, or another block
    (e.g. a :class:`~lightning_dynmo.models.MoDBlock`) given one."""
    return isinstance(getattr(layer, "mlp", None), MoELayer)


def moe_block_ids(n_layer: int, moe: MoEConfig) -> list[int]:
    """The blocks (0-based) that get an MoE MLP: ``(i + 1) % moe_every == 0``."""
    blocks = [i for i in range(n_layer) if (i + 1) % moe.moe_every == 0]
    if not blocks:
        raise ValueError(
            f"moe_every={moe.moe_every} leaves no MoE block among n_layer={n_layer} blocks; "
            f"use moe_every <= {n_layer}"
        )
    return blocks


def install_moe(model: GPT, moe: MoEConfig, keep: tuple[type, ...] = ()) -> None:
    """Give every ``moe.moe_every``-th block of ``model`` an MoE MLP, from a stream seeded by
    ``model.hparams.seed`` (what :class:`MoEGPT` has always drawn). A block becomes an
    :class:`MoEBlock` with the dense block's norms and attention; one whose type is in ``keep``
    (e.g. a :class:`~lightning_dynmo.models.MoDBlock`) stays what it is and only its ``mlp``
    becomes an :class:`MoELayer`. Both get :meth:`MoELayer.init_weights`."""
    cfg = model.config
    blocks = moe_block_ids(cfg.n_layer, moe)
    seed = model.hparams.seed
    std, residual_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layer)  # as GPT._init_weights
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        for i in blocks:
            ratio = cfg.block_mlp_ratio(i) if moe.expert_ratio is None else moe.expert_ratio
            hidden = max(1, round(ratio * cfg.n_embd))
            dense = model.layers[1 + i]
            if isinstance(dense, keep):
                block = dense
                block.mlp = MoELayer(cfg.n_embd, hidden, moe)
            else:
                block = MoEBlock(cfg, moe, expert_hidden=hidden)
                for name in ("ln_1", "attn", "ln_2"):
                    getattr(block, name).load_state_dict(getattr(dense, name).state_dict())
            block.mlp.init_weights(std, residual_std)
            model.layers[1 + i] = block


class MoEGPT(GPT):
    """GPT whose every ``moe.moe_every``-th block is an :class:`MoEBlock` (see the module docstring).

    Args:
        config: the dense model, as for :class:`~lightning_dynmo.models.GPT`.
        moe: a :class:`MoEConfig` or a mapping of its fields (``None``: defaults).
        other args: as :class:`~lightning_dynmo.models.GPT`; ``seed`` also fixes the MoE weights.
    """

    def __init__(self, config=None, moe: MoEConfig | Mapping | None = None, **kwargs):
        # save_hyperparameters (in GPT.__init__) reads these locals: keep them plain dicts
        config = GPTConfig.from_any(config).to_dict()
        moe_config = MoEConfig.from_any(moe)
        moe = moe_config.to_dict()  # noqa: F841
        super().__init__(config, **kwargs)
        self.moe_config = moe_config
        install_moe(self, moe_config)
        self._layers_built(MoEGPT)

    def moe_blocks(self) -> list[tuple[int, MoELoad]]:
        """``(global layer index, layer)`` of the MoE layers this rank holds (blocks, or their MoE
        halves at sublayer granularity)."""
        return [(i, layer) for i, layer in enumerate(self.layers) if isinstance(layer, MoELoad)]

    def on_train_start(self) -> None:
        # Lightning divides the training loss by accumulate_grad_batches and multiplies it by the
        # fp16 grad scaler's scale before backward; the auxiliary losses enter in backward, so
        # scale them the same way (the pipeline strategy divides its micro-batch losses by the
        # same N and applies the same grad scaler; see models/_aux_loss.py)
        configure_aux_loss(self.trainer)

    def on_train_end(self) -> None:
        reset_aux_loss()  # the aux-loss scaling is process-wide: leave none behind after fit
