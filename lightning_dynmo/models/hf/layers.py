"""The single-tensor pipeline layers :class:`~lightning_dynmo.models.hf.HFCausalLM` wraps a
``transformers`` model's own modules in (see :mod:`lightning_dynmo.models.hf` for why each is
needed); re-exported by :mod:`lightning_dynmo.models.hf`.

**Mixtral's router loss under the pipeline.** ``MixtralForCausalLM.forward`` records every
layer's router logits and computes one Switch load-balancing loss from all of them at once
(``load_balancing_loss_func``: expert fractions and mean probabilities pooled over all layers and
all tokens of the batch), which no pipeline stage can compute. The adapter uses the per-layer
form of Megatron-Core and of :mod:`~lightning_dynmo.models.moe` instead: each decoder layer computes
the loss from its own router logits, per sequence, and attaches it to its output in backward
(:func:`~lightning_dynmo.models._aux_loss.attach_aux_loss`), so the gradients are those of::

    CE + router_aux_loss_coef * mean over layers l of mean over rows b of
         E * sum_i f_lbi * P_lbi        (f: share of the row's top-k slots routed to expert i,
                                         P: the row's mean router probability of expert i)

Each term is HF's loss of one layer and one row (``k`` for uniform routing, like HF's), so for a
single layer and a single sequence the two agree exactly; in general HF's pooled value is
``E * sum_i mean(f_i) * mean(P_i)`` over layers and rows, which differs from the mean of the
products by ``E * sum_i cov(f_i, P_i)``, and is not a sum of per-layer terms. Per row (not pooled
over the batch) the loss is the same whatever the micro-batching, so pipeline training equals
single-process training. It is on when ``router_aux_loss_coef > 0`` and ``router_aux_loss=True``,
or with ``router_aux_loss=None`` (default) when the config says ``output_router_logits=True``
(HF's own switch for adding the loss in training). ``pipeline_loss`` and the logged loss stay
plain cross-entropy. ``router_jitter_noise > 0`` draws random numbers per forward, so a pipeline
run then differs from a single-process one, as with dropout.
"""
from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from .._aux_loss import attach_aux_loss
from ..moe.router import load_balancing_loss

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["HFDecoderLayer", "HFEmbedding", "HFFinalNorm", "HFHead", "HFPaddedDecoderLayer", "HFPaddedEmbedding",
           "HFPaddedFinalNorm", "router_balance_loss"]


class HFEmbedding(nn.Module):
    """Layer 0: token ids ``[B, T]`` -> hidden states ``[B, T, C]`` (GPT-2: + learned positions;
    Granite: times its ``embedding_multiplier``, as the model's own forward does outside the module)."""

    def __init__(self, modules: Mapping[str, nn.Module], dropout: float = 0.0, max_positions: int | None = None,
                 multiplier: float | None = None):
        super().__init__()
        self.names = tuple(modules)
        for name, m in modules.items():
            setattr(self, name, m)
        self.drop = nn.Dropout(dropout)
        self.max_positions = max_positions
        self.multiplier = multiplier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.size(1)
        if self.max_positions is not None and t > self.max_positions:
            raise ValueError(f"sequence length {t} exceeds the model's {self.max_positions} positions")
        h = getattr(self, self.names[0])(ids)
        if len(self.names) > 1:  # learned absolute positions (GPT-2's wpe)
            h = h + getattr(self, self.names[1])(torch.arange(t, device=ids.device))
        if self.multiplier is not None:
            h = h * self.multiplier
        return self.drop(h)


def router_balance_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mixtral's Switch loss of one layer, per sequence, then the mean over rows: for each row of
    ``logits [B, T, E]``, ``load_balancing_loss_func`` of that layer and row alone (see the module
    docstring). Our MoE's sequence-wise loss is the same statistic normalised to 1 instead of
    ``top_k`` for uniform routing."""
    probs = logits.float().softmax(dim=-1)
    experts = probs.topk(top_k, dim=-1).indices
    return top_k * load_balancing_loss(probs, experts, logits.size(-1))


class HFDecoderLayer(nn.Module):
    """One decoder layer of the model as a single-tensor layer (see the module docstring).

    ``router``: path of the layer's MoE router (Mixtral); with ``aux_loss_coeff > 0`` a training
    forward attaches ``aux_loss_coeff * router_balance_loss`` of its logits to the output
    (``aux_loss_coeff`` is a plain attribute, so a callback may schedule it).

    ``sliding_window``: this layer attends within ``config.sliding_window``; ``layer_type``: its
    entry of ``config.layer_types`` (``None`` where the config has none), which also picks its
    rotary embedding where the model keeps one per layer type (Gemma 3, OLMo 3)."""

    def __init__(self, layer: nn.Module, config: PretrainedConfig, rotary: nn.Module | None, sliding_window: bool,
                 router: str | None = None, aux_loss_coeff: float = 0.0, layer_type: str | None = None):
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.config = config
        self.sliding_window = bool(sliding_window and getattr(config, "sliding_window", None))
        self.layer_type = layer_type
        self.router = router
        self.aux_loss_coeff = float(aux_loss_coeff)

    def _mask(self, h: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | None = None):
        """What the model's own forward passes its layers for ``attention_mask=keep`` (``[B, T]``,
        nonzero: a real token; ``None``: a full, unpadded sequence)."""
        fn, embeds_name, wants_cache_position, cache_name = _mask_function(self.sliding_window)
        kwargs = {"config": self.config, embeds_name: h, "attention_mask": None if keep is None else keep.bool(),
                  cache_name: None, "position_ids": position_ids}
        if wants_cache_position:
            kwargs["cache_position"] = position_ids[0]
        return fn(**kwargs)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self._run(h)

    def _run(self, h: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        position_ids = torch.arange(h.size(1), device=h.device).unsqueeze(0)
        kwargs: dict[str, Any] = {"attention_mask": self._mask(h, position_ids, keep), "position_ids": position_ids,
                                  "use_cache": False}
        if self.rotary is not None:
            per_type = self.layer_type is not None and _rotary_per_layer_type(type(self.rotary))
            kwargs["position_embeddings"] = (self.rotary(h, position_ids, self.layer_type) if per_type
                                             else self.rotary(h, position_ids))
        if not (self.router and self.aux_loss_coeff > 0 and self.training and torch.is_grad_enabled()):
            return _first(self.layer(h, **kwargs))
        # the router's logits, captured for this call only (a hook that outlives the call would
        # have to survive the deep copies and pickling of layer migration)
        logits: list[torch.Tensor] = []
        handle = self.layer.get_submodule(self.router).register_forward_hook(lambda m, i, o: logits.append(o[0]))
        try:
            out = _first(self.layer(h, **kwargs))
        finally:
            handle.remove()
        aux = router_balance_loss(logits[0].view(h.size(0), h.size(1), -1), self.config.num_experts_per_tok)
        return attach_aux_loss(out, aux, self.aux_loss_coeff)


def _first(out):
    """Decoder layers return a tensor or (depending on the ``transformers`` version) a tuple."""
    return out[0] if isinstance(out, tuple) else out


@functools.lru_cache(maxsize=None)
def _rotary_per_layer_type(rotary_cls: type) -> bool:
    """The rotary embedding keeps one frequency table per layer type (its forward takes ``layer_type``)."""
    return "layer_type" in inspect.signature(rotary_cls.forward).parameters


@functools.lru_cache(maxsize=None)
def _mask_function(sliding_window: bool):
    """``transformers.masking_utils``' mask builder and how it names its arguments (they changed
    between releases)."""
    from transformers import masking_utils

    fn = masking_utils.create_sliding_window_causal_mask if sliding_window else masking_utils.create_causal_mask
    params = inspect.signature(fn).parameters
    return (fn, "inputs_embeds" if "inputs_embeds" in params else "input_embeds", "cache_position" in params,
            "cache" if "cache" in params else "past_key_values")


class HFFinalNorm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


# ------------------------------------------------------------------ padding (HFCausalLM(pad_token_id=...))
class HFPaddedEmbedding(HFEmbedding):
    """``ids -> (h, keep)``: ``keep [B, T]`` is 1 where the token is not ``pad_token_id`` and 0 on
    padding, in ``h``'s dtype and without gradient. It rides beside the hidden state (a tuple
    activation) to every decoder layer, which masks padding keys as the model's own forward does
    for ``attention_mask=keep`` (a later stage never sees the token ids)."""

    def __init__(self, modules: Mapping[str, nn.Module], dropout: float, max_positions: int | None,
                 pad_token_id: int, multiplier: float | None = None):
        super().__init__(modules, dropout, max_positions, multiplier)
        self.pad_token_id = int(pad_token_id)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = super().forward(ids)
        return h, (ids != self.pad_token_id).to(h.dtype)


class HFPaddedDecoderLayer(HFDecoderLayer):
    """:class:`HFDecoderLayer` over ``(h, keep)``: padding keys masked, ``keep`` passed on."""

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._run(h, keep), keep


class HFPaddedFinalNorm(HFFinalNorm):
    """The final norm over ``(h, keep)``; the padding mask ends here."""

    def forward(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class HFHead(nn.Module):
    """The LM head, then the logit scales the model's own forward applies after it: ``/ divisor``
    (Granite's ``logits_scaling``), ``* multiplier`` (Cohere's ``logit_scale``), or
    ``tanh(logits / softcap) * softcap`` (Gemma 2/3's ``final_logit_softcapping``)."""

    def __init__(self, lm_head: nn.Module, divisor: float | None = None, multiplier: float | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.lm_head = lm_head
        self.divisor, self.multiplier, self.softcap = divisor, multiplier, softcap

    @property
    def scales_logits(self) -> bool:
        return (self.divisor, self.multiplier, self.softcap) != (None, None, None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(h)
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
