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
* ``predictor``: a small MLP on the stop-gradient block input is trained with BCE against the
  stop-gradient top-``k`` decisions; its own decisions (logit > 0) pick the tokens. Causal, and
  the count varies per row, block and step.
* ``threshold``: router logit > ``threshold``. Causal; the count varies.

The predictor's BCE (mean over rows, so micro-batches average it exactly) reaches the optimizer
through :func:`~lightning_dynmo.models._aux_loss.attach_aux_loss` on the block output:
``pipeline_loss`` stays plain cross-entropy. ``capacity`` is a plain attribute of each block,
changed between steps by :class:`~lightning_dynmo.callbacks.mod.MixtureOfDepths` to anneal it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._aux_loss import attach_aux_loss, configure_aux_loss
from ._packing import pack, packed_attention, unpack
from .gpt import GPT, Block, GPTConfig

__all__ = ["MoDConfig", "MoDBlock", "MoDGPT", "ROUTING_MODES", "GATES"]

ROUTING_MODES = ("expert_choice", "predictor", "threshold")
GATES = ("sigmoid", "raw")


@dataclass
class MoDConfig:
    """Mixture-of-Depths settings (see the module docstring).

    Args:
        capacity: fraction of each row's tokens a block takes under ``expert_choice``, and the
            top-k target the predictor learns; in ``(0, 1]``.
        every: blocks ``every-1, 2*every-1, ...`` (0-based) are MoD blocks (2: every other block,
            starting with the second, as in the paper; 1: every block).
        routing: ``"expert_choice"`` | ``"predictor"`` | ``"threshold"``.
        threshold: router-logit threshold of ``routing="threshold"``.
        gate: ``"sigmoid"`` (``2 sigmoid(r)``) | ``"raw"`` (``r``, the paper's).
        predictor_hidden: hidden width of the predictor MLP.
        predictor_loss_coeff: weight of the predictor's BCE in the gradients.
    """

    capacity: float = 0.125
    every: int = 2
    routing: str = "expert_choice"
    threshold: float = 0.0
    gate: str = "sigmoid"
    predictor_hidden: int = 64
    predictor_loss_coeff: float = 0.01

    def __post_init__(self) -> None:
        check_capacity(self.capacity)
        if isinstance(self.every, bool) or int(self.every) != self.every or self.every < 1:
            raise ValueError(f"MoD every must be an integer >= 1 (1: every block is MoD), got {self.every!r}")
        self.every = int(self.every)
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"unknown MoD routing {self.routing!r}; use one of {', '.join(ROUTING_MODES)}")
        if self.gate not in GATES:
            raise ValueError(f"unknown MoD gate {self.gate!r}; use one of {', '.join(GATES)}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"MoD threshold must be a finite router logit, got {self.threshold!r}")
        if int(self.predictor_hidden) < 1:
            raise ValueError(f"MoD predictor_hidden must be >= 1, got {self.predictor_hidden!r}")
        self.predictor_hidden = int(self.predictor_hidden)
        if not (math.isfinite(self.predictor_loss_coeff) and self.predictor_loss_coeff >= 0):
            raise ValueError(f"MoD predictor_loss_coeff must be finite and >= 0, got {self.predictor_loss_coeff!r}")

    def is_mod_block(self, i: int) -> bool:
        return (i + 1) % self.every == 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_any(cls, config: "MoDConfig | Mapping | None") -> "MoDConfig":
        if config is None:
            return cls()
        if isinstance(config, MoDConfig):
            return dataclasses.replace(config)
        if isinstance(config, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(config) - fields
            if unknown:
                raise ValueError(f"unknown MoDConfig keys {sorted(unknown)}; valid: {sorted(fields)}")
            return cls(**{k: config[k] for k in config})
        raise TypeError(f"mod must be a MoDConfig, a dict or None, got {type(config).__name__}")


def check_capacity(capacity: float) -> float:
    if not (isinstance(capacity, (int, float)) and 0.0 < capacity <= 1.0):
        raise ValueError(f"MoD capacity is the fraction of tokens a block takes and must be in (0, 1], got {capacity!r}")
    return float(capacity)


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
        if mod.routing == "predictor":
            h = mod.predictor_hidden
            self.predictor = nn.Sequential(nn.Linear(config.n_embd, h), nn.SiLU(), nn.Linear(h, 1))
        self.reset_counters()
        self.reset_load()

    # ------------------------------------------------------------------ counters
    def reset_counters(self) -> None:
        self.tokens_seen = 0
        self.tokens_routed = 0
        self.tokens_computed = 0
        self.predictor_agree = 0

    def reset_load(self) -> None:
        self._load_seen = 0
        self._load_computed = 0

    def load_factor(self) -> float | None:
        """Computed token slots / tokens seen since :meth:`reset_load` (padding counts: it is
        computed); ``None`` when no counted forward ran."""
        return self._load_computed / self._load_seen if self._load_seen else None

    # ------------------------------------------------------------------ routing
    def top_k(self, t: int) -> int:
        return min(t, max(1, round(check_capacity(self.capacity) * t)))

    def _top_k_mask(self, logits: Tensor) -> Tensor:
        idx = logits.topk(self.top_k(logits.size(1)), dim=1).indices
        return torch.zeros_like(logits, dtype=torch.bool).scatter_(1, idx, True)

    def _route(self, x: Tensor, logits: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(picked [B,T] bool, predictor BCE or None, predictor agreement [B,T] or None)``."""
        if self.routing == "expert_choice":
            return self._top_k_mask(logits), None, None
        if self.routing == "threshold":
            return logits > self.threshold, None, None
        guess = self.predictor(x.detach()).squeeze(-1)
        target = self._top_k_mask(logits.detach())
        aux = None
        if torch.is_grad_enabled():
            # every row has T tokens, so the token mean is the mean over rows of per-row means
            aux = F.binary_cross_entropy_with_logits(guess, target.to(guess.dtype))
        picked = guess.detach() > 0
        return picked, aux, picked == target

    # ------------------------------------------------------------------ forward
    def _update(self, x: Tensor, g: Tensor, attention: Tensor) -> Tensor:
        """``x + g * (a + m)`` written so that ``g == 1`` gives ``Block.forward`` bitwise."""
        h = x + attention
        m = self.mlp(self.ln_2(h))
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
            y = unpack(x, xp, self._update(xp, gp, a), packing)
        if self.training and torch.is_grad_enabled():
            computed = b * (t if n == b * t else width)
            self.tokens_seen += b * t
            self.tokens_routed += n
            self.tokens_computed += computed
            self.predictor_agree += int(n_agree[0]) if n_agree else 0
            self._load_seen += b * t
            self._load_computed += computed
        if aux is not None:
            y = attach_aux_loss(y, aux, self.predictor_loss_coeff)
        return y

    def extra_repr(self) -> str:
        return f"routing={self.routing}, capacity={self.capacity}, gate={self.gate}"


class MoDGPT(GPT):
    """GPT whose every ``mod.every``-th block is a :class:`MoDBlock` (see the module docstring).

    The non-MoD parameters equal those of ``GPT(config, seed=seed)`` (names, shapes, values); the
    routers and predictors are extra (``load_state_dict(gpt.state_dict(), strict=False)`` works).
    Routers start at zero-mean noise (std 0.02), so with ``gate="sigmoid"`` each MoD block starts
    close to the plain block on the tokens it takes.

    Args:
        mod: a :class:`MoDConfig` or a dict of its fields (saved as a dict in ``hparams``).
        other args: as :class:`~lightning_dynmo.models.GPT`.
    """

    def __init__(self, config=None, mod: MoDConfig | Mapping | None = None, **kwargs):
        mod = MoDConfig.from_any(mod).to_dict()  # save_hyperparameters reads this local (a dict)
        super().__init__(config, **kwargs)
        self.mod_config = MoDConfig(**mod)
        cfg = self.config
        ids = [i for i in range(cfg.n_layer) if self.mod_config.is_mod_block(i)]
        if not ids:
            raise ValueError(
                f"MoD every={self.mod_config.every} exceeds n_layer={cfg.n_layer}, so no block would be a MoD "
                f"block; use every <= {cfg.n_layer}"
            )
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

    @staticmethod
    @torch.no_grad()
    def _init_router(block: MoDBlock) -> None:
        for m in [block.router, *(block.predictor or ())]:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def mod_blocks(self) -> list[tuple[int, MoDBlock]]:
        """``(global layer index, block)`` of the MoD blocks this rank holds."""
        return [(i, l) for i, l in enumerate(self.layers) if isinstance(l, MoDBlock)]

    def set_capacity(self, capacity: float) -> None:
        capacity = check_capacity(capacity)
        for _, block in self.mod_blocks():
            block.capacity = capacity

    def on_train_start(self) -> None:
        # Lightning divides the loss by accumulate_grad_batches and multiplies it by the fp16 grad
        # scaler's scale before backward; scale the predictor's gradient the same way (the
        # pipeline strategy scales gradients instead; see models/_aux_loss.py)
        configure_aux_loss(self.trainer)
