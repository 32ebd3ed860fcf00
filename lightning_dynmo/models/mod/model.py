"""Mixture-of-Depths GPT (Raposo et al. 2024): tokens that skip blocks.

Every ``every``-th block is a :class:`MoDBlock`. Its linear router scores each token; the block
computes only on the tokens it picks (packed, see :mod:`lightning_dynmo.models._packing`, the
packing ``EarlyExitGPT`` uses) and the others ride the residual stream unchanged::

    y_i = x_i + g(r_i) * f(x_i)   if token i is picked,        y_i = x_i   otherwise

where ``f`` is the block's residual update (attention, then MLP on the attention-updated stream)
and ``r_i`` the router logit. Picking is not differentiable; the gate ``g`` puts the router on the
LM loss's gradient path. ``gate="sigmoid"``: ``g = 2 sigmoid(r)``, which is exactly 1 at ``r = 0``,
so a block with a zero router is the plain GPT block; ``gate="raw"``: ``g = r``, the paper's.
Skipped tokens are no keys/values for picked ones (as in the paper), so a block's work follows its
token count.

Routing (decided per sequence, so splitting a batch into micro-batches along dim 0, as the
pipeline does, changes nothing):

* ``expert_choice``: each row's top-``k`` router logits, ``k = round(capacity * T)`` (the paper's
  training rule). Constant cost, but not causal: a token's pick depends on later tokens.
* ``predictor``: a small MLP on the stop-gradient block input (normalised per token) is trained
  with BCE against the stop-gradient top-``k`` decisions, at a learning rate of its own
  (``predictor_lr``); its own decisions (logit > threshold) pick the tokens. Causal, and the
  count varies per row, block and step. Why the normalised input and the own rate: Adam moves
  each weight by about the rate per step, so at the model's rate on the raw residual stream
  (about 0.02 per coordinate) the predictor's logits differed across tokens by ~0.001 for
  hundreds of steps, less than the threshold moves per step: a block took all or none of its
  tokens each step. Now the logits spread by about one unit within the anneal and each step's
  picks follow the capacity token by token.
* ``threshold``: router logit > ``threshold``. Causal; the count varies.

The predictor's threshold (``predictor_threshold``): the paper's rule is logit > 0 (p > 0.5).
At a capacity of 0.125 only 12.5 % of the targets are positive, so a predictor that has not yet
learned to separate them outputs about logit(0.125) < 0 everywhere and a block at threshold 0
picks no token: it silently becomes the identity (measured on byte text and random tokens: 3-4
of 4 blocks at 0 tokens after 20-60 steps). ``"calibrated"`` (default) keeps a logit threshold
per block (buffer ``predictor_threshold``: starts at 0, saved in checkpoints, moves with the
layer) and after each training batch (:meth:`MoDBlock.end_batch`, called by
``MoDGPT.on_train_batch_end``; plain-PyTorch loops call it themselves) adds
``rate * (f - c) / c``, ``f`` the fraction of the batch's tokens the block picked, ``c`` the
capacity. An integral controller: the sum of ``f - c`` over steps is ``c / rate`` times the
threshold's net move, so the mean fraction follows the capacity (the compute budget), also while
it anneals, whatever the predictor does; rows, blocks and steps still vary around it (the cost
signal). Why not ``logit(f) - logit(c)``: while the predictor's outputs spread less than they
drift between steps (measured early in training: spread 0.001-0.1 logits, drift 0.1-0.3 per
step), any threshold set from past batches alternates between picking no token and all of them;
the linear error then spends the capacity on average, a clamped logit error (symmetric steps)
about 29 % at ``c = 12.5 %``. Per-batch counts, not per forward: the pipeline runs a batch as
several micro-batch forwards, single-process training as one; both count the same tokens and
reach the same threshold (data-parallel replicas sum their counts, as one process would).

The predictor's BCE (mean over rows, so micro-batches average it exactly) reaches the optimizer
through :func:`~lightning_dynmo.models._aux_loss.attach_aux_loss` on the block output:
``pipeline_loss`` stays plain cross-entropy. ``capacity`` is a plain attribute of each block,
changed between steps by :class:`~lightning_dynmo.callbacks.mod.MixtureOfDepths` to anneal it.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ...protocol.services import is_recomputing
from .._aux_loss import attach_aux_loss, configure_aux_loss, reset_aux_loss
from .._packing import pack, packed_attention, unpack
from ..gpt import GPT, Block, GPTConfig
from ..gpt.granularity import check_block_granularity
from ..moe import MoEConfig, RoutingCounts, has_moe_mlp, install_moe, moe_block_ids
from .config import MoDConfig, check_capacity

__all__ = ["MoDBlock", "MoDGPT"]


class MoDBlock(Block):
    """A GPT block that computes only on the tokens its router picks (see the module docstring).

    Implements :class:`~lightning_dynmo.protocol.ReportsLoad`. Counters (plain ints, so they
    travel when the layer migrates) count training forwards that build a graph only: validation
    and the pipeline's no-grad shape probe do not change the load profile.

    Attributes:
        capacity: see :class:`MoDConfig`; may be changed between steps.
        tokens_seen / tokens_routed / tokens_computed: tokens entering, tokens picked, and token
            slots computed (picked plus the padding of shorter rows) since ``reset_counters``.
        predictor_agree: tokens where the predictor agreed with the top-k target (predictor mode).
        predictor_threshold: (predictor mode) 0-dim buffer, the logit a token's predictor output
            must exceed to be picked; calibrated by :meth:`end_batch` unless fixed by the config.
    """

    def __init__(self, config: GPTConfig, mod: MoDConfig, mlp_ratio: float | None = None):
        super().__init__(config, mlp_ratio)
        self.routing = mod.routing
        self.gate = mod.gate
        self.capacity = mod.capacity
        self.threshold = float(mod.threshold)
        self.predictor_loss_coeff = float(mod.predictor_loss_coeff)
        self.router = nn.Linear(config.n_embd, 1, bias=False)
        self.predictor = None
        self.calibrated = mod.routing == "predictor" and mod.predictor_threshold == "calibrated"
        self.threshold_rate = float(mod.predictor_threshold_rate)
        fixed = mod.predictor_threshold
        self._threshold_start = 0.0 if isinstance(fixed, str) else float(fixed)  # "calibrated" starts at 0
        if mod.routing == "predictor":
            h = mod.predictor_hidden
            self.predictor = nn.Sequential(nn.Linear(config.n_embd, h), nn.SiLU(), nn.Linear(h, 1))
            # a buffer: it moves with the layer (migration, .to) and is saved in checkpoints
            self.register_buffer("predictor_threshold", torch.tensor(self._threshold_start))
        self.reset_counters()
        self.reset_load()
        self._batch_seen = 0
        self._batch_picked = 0

    # ------------------------------------------------------------------ counters
    def reset_counters(self) -> None:
        self.tokens_seen = 0
        self.tokens_routed = 0
        self.tokens_computed = 0
        self.predictor_agree = 0

    def reset_load(self) -> None:
        self._load_seen = 0
        self._load_computed = 0
        if has_moe_mlp(self):
            self.mlp.load_window = RoutingCounts()  # unread (load_factor is the token fraction): keep it short

    @property
    def may_skip_expert_exchange(self) -> bool:
        """Whether a forward may skip this block's MoE layer altogether (predictor or threshold
        routing can pick no token of a micro-batch): under expert parallelism the layer's token
        exchange is a collective of the replicas, which must not be skipped on one of them."""
        return has_moe_mlp(self) and self.routing != "expert_choice"

    def load_factor(self) -> float | None:
        """Computed token slots / tokens seen since :meth:`reset_load` (padding counts: it is
        computed); ``None`` when no counted forward ran."""
        return self._load_computed / self._load_seen if self._load_seen else None

    # ------------------------------------------------------------------ threshold
    @torch.no_grad()
    def reset_threshold(self) -> None:
        """The predictor threshold's start (0.0, or the fixed value); e.g. after meta-device init."""
        if self.predictor is not None:
            self.predictor_threshold.fill_(self._threshold_start)

    def batch_counts(self) -> tuple[int, int]:
        """``(tokens seen, tokens picked)`` by counted training forwards since the last :meth:`end_batch`."""
        return self._batch_seen, self._batch_picked

    @torch.no_grad()
    def end_batch(self, seen: int | None = None, picked: int | None = None) -> None:
        """Close a training batch: with a calibrated predictor threshold, move it by
        ``rate * (picked / seen - capacity) / capacity`` (see the module docstring); then
        reset the batch counts. Call once per batch, after all its forwards (``MoDGPT`` does, in
        ``on_train_batch_end``). ``seen``/``picked``: counts summed over data-parallel replicas
        (default: this block's own, :meth:`batch_counts`). No counted forward: no change."""
        own_seen, own_picked = self.batch_counts()
        seen = own_seen if seen is None else int(seen)
        picked = own_picked if picked is None else int(picked)
        self._batch_seen = self._batch_picked = 0
        if not self.calibrated or seen <= 0:
            return
        capacity = check_capacity(self.capacity)
        step = self.threshold_rate * (picked / seen - capacity) / capacity
        # computed in Python floats so that a low-precision buffer rounds only the stored value
        self.predictor_threshold.fill_(float(self.predictor_threshold) + step)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "predictor_threshold"
        if self.predictor is not None and (key not in state_dict or not self.calibrated):
            # a checkpoint from before the threshold existed starts at 0.0 (the old rule); a
            # fixed threshold is configuration, not state
            state_dict[key] = torch.tensor(self._threshold_start)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ routing
    def top_k(self, t: int) -> int:
        return min(t, max(1, round(check_capacity(self.capacity) * t)))

    def _top_k_mask(self, logits: Tensor) -> Tensor:
        idx = logits.topk(self.top_k(logits.size(1)), dim=1).indices
        return torch.zeros_like(logits, dtype=torch.bool).scatter_(1, idx, True)

    def predict(self, x: Tensor) -> Tensor:
        """The predictor's logits ``[B, T]``: its MLP on the stop-gradient block input, normalised
        per token (no affine), so that its logits move at its own learning rate whatever the
        residual stream's scale (about 0.02 per coordinate at GPT's init)."""
        x = x.detach()
        return self.predictor(F.layer_norm(x, (x.size(-1),))).squeeze(-1)

    def _route(self, x: Tensor, logits: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(picked [B,T] bool, predictor BCE or None, predictor agreement [B,T] or None)``."""
        if self.routing == "expert_choice":
            return self._top_k_mask(logits), None, None
        if self.routing == "threshold":
            return logits > self.threshold, None, None
        guess = self.predict(x)
        target = self._top_k_mask(logits.detach())
        aux = None
        if torch.is_grad_enabled():
            # every row has T tokens, so the token mean is the mean over rows of per-row means
            aux = F.binary_cross_entropy_with_logits(guess, target.to(guess.dtype))
        picked = guess.detach() > self.predictor_threshold
        return picked, aux, picked == target

    # ------------------------------------------------------------------ forward
    def _update(self, x: Tensor, g: Tensor, attention: Tensor, valid: Tensor | None = None) -> Tensor:
        """``x + g * (a + m)`` written so that ``g == 1`` gives ``Block.forward`` bitwise.
        ``valid``: the packed rows' real slots, for an MoE ``mlp`` (it routes only those)."""
        h = x + attention
        m = self.mlp(self.ln_2(h)) if valid is None else self.mlp(self.ln_2(h), valid)
        return (x + g * attention) + g * m

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        logits = self.router(x).squeeze(-1)
        picked, aux, agree = self._route(x, logits)
        gate = 2.0 * torch.sigmoid(logits) if self.gate == "sigmoid" else logits
        per_row = picked.sum(dim=1)
        stats = [per_row.sum(), per_row.max()] + ([agree.sum()] if agree is not None else [])
        n, width, *n_agree = torch.stack(stats).tolist()  # one host sync sizes the work
        if n == b * t:
            y = self._update(x, gate[..., None], self.attn(self.ln_1(x)))
        elif n == 0:
            y = x
        else:
            xp, packing = pack(x, picked, per_row, width)
            a = packed_attention(self.attn, self.ln_1(xp), packing.valid, self.training)
            gp = gate.gather(1, packing.order)[..., None]
            valid = packing.valid if has_moe_mlp(self) else None
            y = unpack(x, xp, self._update(xp, gp, a, valid), packing)
        if self.training and torch.is_grad_enabled():
            computed = b * (t if n == b * t else width)
            self.tokens_seen += b * t
            self.tokens_routed += n
            self.tokens_computed += computed
            self.predictor_agree += int(n_agree[0]) if n_agree else 0
            self._load_seen += b * t
            self._load_computed += computed
            if not is_recomputing():  # activation checkpointing's recompute is the same tokens again
                self._batch_seen += b * t
                self._batch_picked += n
        if aux is not None:
            y = attach_aux_loss(y, aux, self.predictor_loss_coeff)
        return y

    def extra_repr(self) -> str:
        extra = f", predictor_threshold={'calibrated' if self.calibrated else self._threshold_start}" \
            if self.predictor is not None else ""
        return f"routing={self.routing}, capacity={self.capacity}, gate={self.gate}{extra}"


class MoDGPT(GPT):
    """GPT whose every ``mod.every``-th block is a :class:`MoDBlock` (see the module docstring).

    The non-MoD parameters equal those of ``GPT(config, seed=seed)`` (names, shapes, values); the
    routers and predictors are extra (``load_state_dict(gpt.state_dict(), strict=False)`` works).
    Routers start at zero-mean noise (std 0.02), so with ``gate="sigmoid"`` each MoD block starts
    close to the plain block on the tokens it takes.

    With ``moe``, blocks ``(i + 1) % moe.moe_every == 0`` also get MoE MLPs, drawn as
    :class:`~lightning_dynmo.models.MoEGPT` draws them (:func:`~lightning_dynmo.models.moe.install_moe`):
    a block that is not MoD becomes an :class:`~lightning_dynmo.models.MoEBlock`, a MoD block
    keeps routing tokens and gets an :class:`~lightning_dynmo.models.MoELayer` as its ``mlp``,
    which routes only the real slots of its packed rows (``MoELayer.forward(x, valid)``). MoE
    inside MoD blocks is dropless only. Its ``load_factor`` stays the MoD token fraction.
    Under expert parallelism only ``expert_choice`` routing may hold MoE MLPs (it always picks
    tokens): a predictor/threshold block that picks none on one replica would skip the replicas'
    token exchange, so ``DynMoStrategy(expert_parallel>1)`` refuses such a model at setup.

    Args:
        mod: a :class:`MoDConfig` or a dict of its fields (saved as a dict in ``hparams``).
        moe: ``None`` (no MoE), or a :class:`~lightning_dynmo.models.MoEConfig` or a dict of its
            fields (saved as a dict in ``hparams``).
        other args: as :class:`~lightning_dynmo.models.GPT`.
    """

    def __init__(self, config=None, mod: MoDConfig | Mapping | None = None,
                 moe: MoEConfig | Mapping | None = None, **kwargs):
        mod = MoDConfig.from_any(mod).to_dict()  # save_hyperparameters reads this local (a dict)
        moe_config = None if moe is None else MoEConfig.from_any(moe)
        moe = None if moe_config is None else moe_config.to_dict()  # read by save_hyperparameters, as mod
        mod_config = MoDConfig(**mod)
        check_block_granularity(
            GPTConfig.from_any(config), "MoDGPT",
            "a MoD block routes each token around its attention and MLP together (one router decision and one "
            "gate for both halves), so the halves cannot be separate pipeline layers")
        n_layer = GPTConfig.from_any(config).n_layer
        ids = [i for i in range(n_layer) if mod_config.is_mod_block(i)]
        if not ids:
            raise ValueError(
                f"MoD every={mod_config.every} exceeds n_layer={n_layer}, so no block would be a MoD "
                f"block; use every <= {n_layer}"
            )
        if moe_config is not None:
            both = sorted(set(ids) & set(moe_block_ids(n_layer, moe_config)))
            if both and moe_config.capacity_factor is not None:
                raise ValueError(
                    f"MoD blocks {both} are also MoE blocks (MoD every={mod_config.every}, "
                    f"moe_every={moe_config.moe_every}), which supports dropless MoE only, but "
                    f"capacity_factor={moe_config.capacity_factor}: per-sequence expert capacity is not defined "
                    "for the packed rows a MoD block computes (their lengths vary with the routing). Use "
                    "capacity_factor=None, or MoD every / moe_every whose blocks do not overlap"
                )
        super().__init__(config, **kwargs)
        self.mod_config = mod_config
        self.moe_config = moe_config
        cfg = self.config
        seed = self.hparams.seed
        # a stream of its own, so that the GPT weights stay those of GPT(config, seed=seed)
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed + 1)
            for i in ids:
                block = MoDBlock(cfg, self.mod_config, cfg.block_mlp_ratio(i))
                block.load_state_dict(self.layers[1 + i].state_dict(), strict=False)
                self._init_router(block)
                self.layers[1 + i] = block
        if moe_config is not None:
            install_moe(self, moe_config, keep=(MoDBlock,))

    @staticmethod
    @torch.no_grad()
    def _init_router(block: MoDBlock) -> None:
        for m in [block.router, *(block.predictor or ())]:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def predictor_parameters(self) -> list[nn.Parameter]:
        """The predictors' parameters (predictor routing; empty otherwise). A hand-written
        ``configure_optimizers`` should give them a rate of their own, as this model's does
        (``MoDConfig.predictor_lr``)."""
        return [p for m in self.layers if isinstance(m, MoDBlock) and m.predictor is not None
                for p in m.predictor.parameters()]

    def _optimizer_groups(self, params: list) -> list[dict]:
        lr = self.mod_config.predictor_lr
        own = {id(p) for p in self.predictor_parameters()}
        if lr is None or not own:
            return super()._optimizer_groups(params)
        rest = super()._optimizer_groups([p for p in params if id(p) not in own])
        mine = super()._optimizer_groups([p for p in params if id(p) in own])
        return rest + [dict(g, lr=lr) for g in mine if g["params"]]

    def mod_blocks(self) -> list[tuple[int, MoDBlock]]:
        """``(global layer index, block)`` of the MoD blocks this rank holds."""
        return [(i, l) for i, l in enumerate(self.layers) if isinstance(l, MoDBlock)]

    def moe_blocks(self) -> list[tuple[int, Block]]:
        """``(global layer index, block)`` of the blocks with an MoE MLP this rank holds:
        :class:`~lightning_dynmo.models.MoEBlock` and MoD blocks whose ``mlp`` is an MoELayer."""
        return [(i, l) for i, l in enumerate(self.layers) if has_moe_mlp(l)]

    @torch.no_grad()
    def init_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        super().init_pipeline_layer(index, layer)
        if isinstance(layer, MoDBlock):
            layer.reset_threshold()  # a buffer built on the meta device holds no value yet

    def set_capacity(self, capacity: float) -> None:
        capacity = check_capacity(capacity)
        for _, block in self.mod_blocks():
            block.capacity = capacity

    def on_train_start(self) -> None:
        # Lightning divides the loss by accumulate_grad_batches and multiplies it by the fp16 grad
        # scaler's scale before backward; scale the predictor's gradient the same way (the
        # pipeline strategy does the same in its schedule; see models/_aux_loss.py)
        configure_aux_loss(self.trainer)

    def on_train_end(self) -> None:
        reset_aux_loss()  # the aux-loss scaling is process-wide: leave none behind after fit

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """Close the batch on every MoD block this rank holds (:meth:`MoDBlock.end_batch`).
        Lightning calls this on every rank, pipeline ranks included, once per batch however many
        micro-batches the batch ran as. Data-parallel replicas sum their counts first (one
        all-reduce per step, with calibrated predictor routing only), so that every replica
        moves its thresholds as one process seeing the whole batch would."""
        blocks = self.mod_blocks()
        calibrated = self.mod_config.routing == "predictor" and self.mod_config.predictor_threshold == "calibrated"
        group, replicated = _data_parallel_group(self.trainer) if calibrated else (None, False)
        if not replicated:
            for _, block in blocks:
                block.end_batch()
            return
        # indexed by global layer so that the vector has one shape on every rank of the group
        counts = torch.zeros(2, len(self.layers), dtype=torch.float64, device=self.trainer.strategy.root_device)
        for i, block in blocks:
            counts[:, i] = torch.tensor(block.batch_counts(), dtype=torch.float64)
        dist.all_reduce(counts, group=group)
        seen, picked = counts.cpu().tolist()
        for i, block in blocks:
            block.end_batch(int(seen[i]), int(picked[i]))


def _data_parallel_group(trainer) -> tuple[object, bool]:
    """``(group, replicated)``: the group of data-parallel replicas of this rank's layers
    (``None``: the world) and whether there is more than one. A pipeline strategy names it
    (``data_parallel_group``, ``None`` without replicas); otherwise every rank of an initialised
    process group is a replica of the whole model (DDP, FSDP)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, False
    holder = getattr(trainer.strategy, "pipeline", None) or trainer.strategy  # DynMoStrategy's, or the strategy
    if hasattr(holder, "pipeline_group") and callable(getattr(holder, "local_layer_indices", None)):
        group = getattr(holder, "data_parallel_group", None)
        return group, group is not None and dist.get_world_size(group) > 1
    return None, dist.get_world_size() > 1
