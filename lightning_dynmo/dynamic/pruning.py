"""Global magnitude pruning across pipeline stages: the distributed threshold, the Zhu & Gupta
cubic schedule and ``PrunableLinear`` (an ``nn.Linear`` that carries its mask as a buffer).

Threshold without gathering weights
-----------------------------------
For non-negative IEEE floats the order of the values equals the order of their bit patterns read
as integers. :func:`global_magnitude_threshold` therefore bisects over the *integer* bit pattern
of ``|w|`` with one all-reduced count per iteration (31 iterations for float32, 63 for float64),
using a local sort + ``searchsorted`` so each count is ``O(log n)``. The search ends at the
smallest value ``t`` with ``count(|w| <= t) >= k``, which is exactly the k-th smallest ``|w|`` over
all ranks -- bitwise equal to ``torch.kthvalue`` on the concatenation -- and no rank ever holds
another rank's weights. Data-parallel replicas hold identical weights, so each replica's pipeline
group computes the same threshold.

Cost of pruned layers
---------------------
``PrunableLinear`` computes ``F.linear(x, weight * weight_mask, bias)`` (dense): a masked dense
layer is *not* cheaper than the dense one. When the sparse-kernel package
(:mod:`lightning_dynmo.sparse`) is importable with its compiled extension
(``extension_available()``) and its measured crossover density says the CSR kernel wins at this
layer's density, :meth:`PrunableLinear.set_sparse_kernel` switches the forward/backward to the
CSR SpMM/SDDMM kernel. The dense ``weight`` Parameter stays the master copy (its FQN, the optimizer
state, the checkpoint format and the strategy's optimizer layout are unchanged): the forward
gathers the kept values (``O(nnz)``) and the backward scatters their gradient back into the dense
gradient, so compute follows density while memory does not shrink.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "global_magnitude_threshold",
    "cubic_sparsity",
    "PrunableLinear",
    "make_prunable",
    "prunable_modules",
    "sparse_kernels_available",
]


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_magnitude_threshold(
    tensors: list[Tensor], sparsity: float, group=None, distributed: bool | None = None
) -> float:
    """The k-th smallest ``|w|`` over ``tensors`` on every rank of ``group`` (k = round(sparsity * N)).

    Pruning ``|w| <= threshold`` removes (at least, with ties exactly at the threshold) ``k`` weights.
    ``k == 0`` returns ``-inf`` (prune nothing). Works without ``torch.distributed`` (single process);
    ``distributed=None`` reduces over ``group`` whenever a process group is initialised, ``False``
    never reduces. Every rank of the group must call it (it is a collective); a rank may pass an
    empty list.
    """
    if not 0.0 <= float(sparsity) <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    reduce = _dist_ready() if distributed is None else bool(distributed)
    local = [t.detach().reshape(-1) for t in tensors if t.numel()]
    wide = any(t.dtype == torch.float64 for t in local)
    fdt, idt = (torch.float64, torch.int64) if wide else (torch.float32, torch.int32)
    device = local[0].device if local else torch.device("cpu")
    if reduce and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    if local:
        vals = torch.cat([t.to(device=device, dtype=fdt).abs() for t in local])
        vals = vals[~torch.isnan(vals)]
    else:
        vals = torch.empty(0, dtype=fdt, device=device)
    bits = vals.view(idt).to(torch.int64).sort().values  # order of |w| == order of its bit pattern

    stats = torch.tensor([bits.numel(), int(bits[-1]) if bits.numel() else 0], dtype=torch.int64, device=device)
    if reduce:
        n_total = stats[:1].clone()
        dist.all_reduce(n_total, group=group)
        hi = stats[1:].clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        n, hi_bits = int(n_total), int(hi)
    else:
        n, hi_bits = int(stats[0]), int(stats[1])
    k = int(round(float(sparsity) * n))
    if k <= 0 or n == 0:
        return -math.inf
    k = min(k, n)

    # smallest bit pattern t in [0, hi] with count(bits <= t) >= k
    lo, hi = 0, hi_bits
    probe = torch.zeros(1, dtype=torch.int64, device=device)
    while lo < hi:
        mid = (lo + hi) // 2
        probe[0] = mid
        count = torch.searchsorted(bits, probe, right=True)
        if reduce:
            dist.all_reduce(count, group=group)
        if int(count) >= k:
            hi = mid
        else:
            lo = mid + 1
    return float(torch.tensor([lo], dtype=torch.int64).to(idt).view(fdt))


def cubic_sparsity(step: int, initial: float, final: float, start: int, n_steps: int, frequency: int) -> float:
    """Zhu & Gupta: ``s_t = s_f + (s_i - s_f) (1 - (t - t0) / (n dt))^3`` clamped to the window."""
    if step < start:
        return 0.0  # nothing is pruned before the schedule starts
    span = max(1, n_steps * frequency)
    frac = min(1.0, (step - start) / span)
    return float(final + (initial - final) * (1.0 - frac) ** 3)


def sparse_kernels_available() -> bool:
    try:
        from ..sparse import extension_available
    except Exception:  # pragma: no cover - the package may be mid-rewrite
        return False
    try:
        return bool(extension_available())
    except Exception:  # pragma: no cover
        return False


class PrunableLinear(nn.Linear):
    """``nn.Linear`` with a ``weight_mask`` buffer (1 = kept) applied in every forward.

    The mask is a buffer, so it is saved in checkpoints and migrates with its layer. It holds no
    reference to any callback (the strategy deep-copies layers when it moves them). With an
    all-ones mask the output equals ``nn.Linear`` bitwise (``w * 1.0 == w``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.register_buffer("weight_mask", torch.ones_like(self.weight, dtype=torch.bool))
        self.sparse_kernel = False
        self._empty_csr()

    def _empty_csr(self) -> None:
        dev = self.weight.device
        for name in ("csr_crow", "csr_col", "csr_crow_t", "csr_col_t", "csr_perm_t"):
            self.register_buffer(name, torch.zeros(0, dtype=torch.int32, device=dev), persistent=False)
        self.register_buffer("csr_index", torch.zeros(0, dtype=torch.int64, device=dev), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PrunableLinear":
        """Wrap ``linear`` keeping its very Parameter objects (optimizers that already hold them stay valid)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        new.weight = linear.weight
        new.bias = linear.bias
        new.weight_mask = torch.ones_like(linear.weight, dtype=torch.bool)
        new.sparse_kernel = False
        new._empty_csr()
        new.train(linear.training)
        return new

    # ------------------------------------------------------------------ masks
    @property
    def density(self) -> float:
        return float(self.weight_mask.float().mean())

    @torch.no_grad()
    def apply_mask(self) -> None:
        self.weight.mul_(self.weight_mask)

    @torch.no_grad()
    def set_mask(self, mask: Tensor) -> None:
        self.weight_mask.copy_(mask.to(self.weight_mask))
        self.apply_mask()
        if self.sparse_kernel:
            self._build_csr()

    # ------------------------------------------------------------------ sparse kernel
    @torch.no_grad()
    def set_sparse_kernel(self, enabled: bool) -> None:
        """Compute with the CSR kernel of :mod:`lightning_dynmo.sparse` (needs its extension)."""
        if enabled and not sparse_kernels_available():
            raise RuntimeError("the sparse-kernel extension is not available; keep masked dense layers")
        self.sparse_kernel = bool(enabled)
        if enabled:
            self._build_csr()
        else:
            self._empty_csr()

    @torch.no_grad()
    def _build_csr(self) -> None:
        from ..sparse import _ops

        mask = self.weight_mask.bool()
        rows, cols = mask.nonzero(as_tuple=True)  # row-major == CSR order
        crow = torch.zeros(self.out_features + 1, dtype=torch.int64, device=mask.device)
        crow[1:] = torch.cumsum(torch.bincount(rows, minlength=self.out_features), 0)
        self.csr_crow = crow.to(torch.int32)
        self.csr_col = cols.to(torch.int32)
        self.csr_index = rows * self.in_features + cols
        self.csr_crow_t, self.csr_col_t, self.csr_perm_t = _ops.csr_transpose(self.csr_crow, self.csr_col, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        if self.sparse_kernel and self.csr_crow.numel() and x.dtype in (torch.float32, torch.float64) \
                and x.dtype == self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            from ..sparse import _ops

            values = self.weight.reshape(-1).index_select(0, self.csr_index)
            lead = x.shape[:-1]
            y = _ops.sparse_linear(x.reshape(-1, self.in_features), values, self.bias, self.csr_crow,
                                   self.csr_col, self.csr_crow_t, self.csr_col_t, self.csr_perm_t)
            return y.reshape(*lead, self.out_features)
        return F.linear(x, self.weight * self.weight_mask, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sparse_kernel={self.sparse_kernel}"


def make_prunable(module: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` inside ``module`` by a ``PrunableLinear`` (same Parameters).
    Returns how many were replaced; idempotent."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:
            setattr(module, name, PrunableLinear.from_linear(child))
            count += 1
        elif not isinstance(child, PrunableLinear):
            count += make_prunable(child)
    return count


def prunable_modules(layer: nn.Module) -> list[tuple[str, PrunableLinear]]:
    return [(n, m) for n, m in layer.named_modules() if isinstance(m, PrunableLinear)]


def default_prunable_layer(index: int, layer: nn.Module, num_layers: int) -> bool:
    """Layers that are (or contain) a GPT ``Block``: not the embedding, final norm or head. (The
    callback falls back to every layer but the first and the last when no layer matches.)"""
    from ..models.gpt import Block

    if isinstance(layer, Block):
        return True
    if any(isinstance(m, Block) for m in layer.modules()):
        return True
    return False
