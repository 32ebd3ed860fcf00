"""Mixture-of-Experts settings: :class:`MoEConfig` (re-exported by :mod:`lightning_dynmo.models.moe`).

Apart from the layers so that configurations can be built and checked without model code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._config import ModelConfig

__all__ = ["MoEConfig"]

_SCORE_FUNCS = ("softmax", "sigmoid")
_DROP_POLICIES = ("probs", "position")


@dataclass
class MoEConfig(ModelConfig):
    """Mixture-of-Experts settings (the dense settings stay in :class:`GPTConfig`).

    Args:
        num_experts: routed experts per MoE layer.
        top_k: experts each token is sent to.
        score_func: ``"softmax"`` (Mixtral) or ``"sigmoid"`` (DeepSeek-V3) router scores.
        renormalize: rescale each token's top-k weights to sum to 1. With ``top_k=1`` and
            softmax this makes every weight 1 and the router learns only from the aux loss.
        shared_expert: ``True`` adds an always-on expert as wide as a routed one; an int gives
            its hidden size; ``False`` none.
        moe_every: block ``i`` is MoE when ``(i + 1) % moe_every == 0``; others stay dense.
        aux_loss_coeff: weight of the sequence-wise Switch/GShard load-balancing loss (0: off).
        z_loss_coeff: weight of the ST-MoE router z-loss (0: off).
        capacity_factor: ``None`` is dropless; a number caps each expert at
            ``ceil(capacity_factor * T * top_k / num_experts)`` tokens per sequence.
        drop_policy: which over-capacity tokens are dropped: ``"probs"`` keeps the highest
            routing weights, ``"position"`` the earliest tokens.
        expert_ratio: expert hidden size as a multiple of ``n_embd``; ``None`` uses the block's
            dense ``mlp_ratio``.
        grouped_mm: ``None`` runs the experts as one ``torch._grouped_mm`` where this torch
            build, dtype and sizes allow it and as a loop otherwise; ``True`` requires the grouped
            GEMM; ``False`` always loops.
    """

    argument: ClassVar[str] = "moe"

    num_experts: int = 8
    top_k: int = 2
    score_func: str = "softmax"
    renormalize: bool = True
    shared_expert: bool | int = False
    moe_every: int = 1
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    expert_ratio: float | None = None
    grouped_mm: bool | None = None

    def __post_init__(self) -> None:
        if int(self.num_experts) < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= int(self.top_k) <= int(self.num_experts):
            raise ValueError(
                f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts}: "
                "lower top_k or raise num_experts"
            )
        if self.score_func not in _SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {_SCORE_FUNCS}, got {self.score_func!r}")
        if int(self.moe_every) < 1:
            raise ValueError(
                f"moe_every must be >= 1 (1: every block is MoE, 2: every other block), got {self.moe_every}"
            )
        for name in ("aux_loss_coeff", "z_loss_coeff"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables it), got {getattr(self, name)}")
        if self.capacity_factor is not None and not float(self.capacity_factor) > 0:
            raise ValueError(
                f"capacity_factor must be > 0, got {self.capacity_factor}; use None for dropless routing"
            )
        if self.drop_policy not in _DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {_DROP_POLICIES}, got {self.drop_policy!r}")
        if not isinstance(self.shared_expert, bool) and int(self.shared_expert) < 1:
            raise ValueError(
                f"shared_expert must be True, False or a positive hidden size, got {self.shared_expert}"
            )
        if self.expert_ratio is not None and not float(self.expert_ratio) > 0:
            raise ValueError(f"expert_ratio must be > 0 (or None for the block's mlp_ratio), got {self.expert_ratio}")
