"""Pruned linear layers: SparseLinear (CSR, compressed memory) and MaskedLinear (dense + mask).

SparseLinear keeps only the pattern's weights: the CSR values are the single trainable
1-D Parameter (optimizer state is nnz-sized) and every index structure -- including the
cached transpose used by the backward -- is a registered buffer, so code that migrates a
layer generically through ``named_parameters()``/``named_buffers()`` moves it whole.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import _ops

_BUFFERS = ("crow_indices", "col_indices", "crow_indices_t", "col_indices_t", "perm_t")


def csr_pattern(mask: Tensor) -> tuple[Tensor, Tensor]:
    """CSR row pointers and column indices (int32) of the true entries of a 2-D ``mask``, in
    row-major order: ``values = weight[mask]`` lists the kept weights in the same order."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D, got shape {tuple(mask.shape)}")
    if int(mask.sum()) >= 2**31:
        raise ValueError("CSR patterns use int32 indices: at most 2^31-1 non-zeros")
    rows, cols = mask.nonzero(as_tuple=True)  # row-major order = CSR order
    crow = torch.zeros(mask.shape[0] + 1, dtype=torch.int64, device=mask.device)
    crow[1:] = torch.cumsum(torch.bincount(rows, minlength=mask.shape[0]), 0)
    return crow.to(torch.int32), cols.to(torch.int32)


def _as_mask(linear: nn.Linear, mask: Optional[Tensor]) -> Tensor:
    w = linear.weight.detach()
    mask = w != 0 if mask is None else mask.to(device=w.device).bool()
    if mask.shape != w.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != weight shape {tuple(w.shape)}")
    return mask


class SparseLinear(nn.Module):
    """``nn.Linear`` with a fixed CSR sparsity pattern: y = x W^T + b, x of shape [..., in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        fk = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        ik = {"device": device, "dtype": torch.int32}
        self.values = nn.Parameter(torch.empty(0, **fk))
        self.bias = nn.Parameter(torch.zeros(out_features, **fk)) if bias else None
        self.register_buffer("crow_indices", torch.zeros(out_features + 1, **ik))
        self.register_buffer("col_indices", torch.zeros(0, **ik))
        self.register_buffer("crow_indices_t", torch.zeros(in_features + 1, **ik))
        self.register_buffer("col_indices_t", torch.zeros(0, **ik))
        self.register_buffer("perm_t", torch.zeros(0, **ik))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dense(cls, linear: nn.Linear, mask: Optional[Tensor] = None) -> "SparseLinear":
        """Keep ``linear``'s weights where ``mask`` is true (default: where weight != 0)."""
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    device=w.device, dtype=w.dtype)
        layer.set_pattern(_as_mask(linear, mask), w)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    @torch.no_grad()
    def set_pattern(self, mask: Tensor, weight: Optional[Tensor] = None) -> None:
        """(Re)build CSR + cached transpose for ``mask``; values come from ``weight``
        (default: the current weights).  Replaces the values Parameter, so optimizer state
        for it must be rebuilt by the caller."""
        mask = mask.to(self.values.device).bool()
        weight = self.dense_weight() if weight is None else weight.to(self.values)
        if mask.shape != (self.out_features, self.in_features):
            raise ValueError(f"mask shape {tuple(mask.shape)} does not match the layer")
        self.crow_indices, self.col_indices = csr_pattern(mask)
        self.values = nn.Parameter(weight[mask].contiguous(), requires_grad=self.values.requires_grad)
        self._refresh_transpose()

    def _refresh_transpose(self) -> None:
        """The backward's W^T pattern, cached in buffers until the pattern changes."""
        self.crow_indices_t, self.col_indices_t, self.perm_t = _ops.csr_transpose(
            self.crow_indices, self.col_indices, self.in_features)

    # ------------------------------------------------------------------ use
    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        values, bias = self.values, self.bias
        if torch.is_autocast_enabled(x.device.type):  # match nn.Linear under autocast
            dtype = torch.get_autocast_dtype(x.device.type)
            x, values = x.to(dtype), values.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if x.device.type == "cuda" and not _ops.cuda_kernels_available():
            _ops.warn_reference_on_cuda(f"SparseLinear(in_features={self.in_features}, "
                                        f"out_features={self.out_features}, nnz={self.nnz})")
        y = _ops.sparse_linear(x.reshape(-1, self.in_features), values, bias,
                               self.crow_indices, self.col_indices, self.crow_indices_t,
                               self.col_indices_t, self.perm_t)
        return y.reshape(*lead, self.out_features)

    @torch.no_grad()
    def dense_weight(self) -> Tensor:
        return _ops._dense(self.crow_indices, self.col_indices, self.values.detach(), self.in_features)

    @torch.no_grad()
    def mask(self) -> Tensor:
        return _ops._dense(self.crow_indices, self.col_indices,
                           torch.ones_like(self.values, dtype=torch.bool), self.in_features)

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        """An ``nn.Linear`` with the same function (pruned weights are zero)."""
        p = self.values
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                        device=p.device, dtype=p.dtype)
        lin.weight.copy_(self.dense_weight())
        if self.bias is not None:
            lin.bias.copy_(self.bias)
        return lin

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.in_features * self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, nnz={self.nnz}, density={self.density:.3f}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint may carry a different pattern (nnz): adopt its sizes before loading.
        for name in ("values",) + _BUFFERS:
            src = state_dict.get(prefix + name)
            cur = getattr(self, name)
            if src is not None and src.shape != cur.shape:
                new = torch.empty(src.shape, dtype=cur.dtype, device=cur.device)
                setattr(self, name, nn.Parameter(new, cur.requires_grad) if name == "values" else new)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class MaskedLinear(nn.Linear):
    """Dense ``nn.Linear`` whose pruned weights stay zero (mask applied in forward, so their
    gradient is zero too): the right choice where dense kernels beat sparse ones."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.register_buffer("mask", torch.ones(out_features, in_features, dtype=torch.bool,
                                                device=device))

    @classmethod
    def from_dense(cls, linear: nn.Linear, mask: Optional[Tensor] = None) -> "MaskedLinear":
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    device=w.device, dtype=w.dtype)
        mask = _as_mask(linear, mask)
        with torch.no_grad():
            layer.mask.copy_(mask)
            layer.weight.copy_(w * mask)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        lin.weight.copy_(self.weight * self.mask)
        if self.bias is not None:
            lin.bias.copy_(self.bias)
        return lin

    @property
    def density(self) -> float:
        return float(self.mask.float().mean())
