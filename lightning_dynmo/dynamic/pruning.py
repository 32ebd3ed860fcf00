"""Global magnitude pruning across pipeline stages: the distributed threshold, the Zhu & Gupta
cubic schedule and ``PrunableLinear`` (an ``nn.Linear`` that carries its mask as a buffer).

The threshold and schedule live in :mod:`lightning_dynmo.dynamic.pruning_threshold` (re-exported
here): the k-th smallest ``|w|`` over all ranks, found without gathering weights.

Cost and memory of pruned layers
--------------------------------
Compute: a masked dense layer is *not* cheaper than the dense one. Where the sparse-kernel
extension of :mod:`lightning_dynmo.sparse` is built and its measured crossover density says the
CSR kernel wins at a layer's density, :meth:`PrunableLinear.set_sparse_kernel` switches the
forward/backward to the CSR SpMM/SDDMM kernel, so compute follows density.

Memory: :meth:`PrunableLinear.compress` makes the CSR values the master weight (the parameter
keeps its name ``weight``; the pattern moves to int32 buffers and the dense mask is dropped), so
gradients, optimizer moments and the data-parallel gradient all-reduce hold only kept weights.
The optimizer is re-mapped in place (:class:`ParamSwap` + ``runtime.optimizer_layout.replace_param``;
same groups, same slots, LR schedule untouched). State dicts are always dense, so checkpoints load
into a dense single-process module; ``GradualPruning`` also densifies the optimizer state it saves.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from .pruning_threshold import _dist_ready, cubic_sparsity, global_magnitude_threshold  # noqa: F401

__all__ = [
    "global_magnitude_threshold",
    "cubic_sparsity",
    "PrunableLinear",
    "ParamSwap",
    "make_prunable",
    "prunable_modules",
    "sparse_kernels_available",
]


def _local(t: Tensor) -> Tensor:
    """This rank's piece of ``t`` (a DTensor shard under ``dp_sharding="fsdp"``; it shares storage)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(t: Tensor) -> Tensor:
    """``t`` whole (a DTensor is all-gathered over its mesh, a bool one as bytes: collective)."""
    if not isinstance(t, DTensor):
        return t
    return t.to(torch.uint8).full_tensor().bool() if t.dtype == torch.bool else t.full_tensor()


def sparse_kernels_available() -> bool:
    try:
        from ..sparse import extension_available
    except Exception:  # pragma: no cover - the package may be mid-rewrite
        return False
    try:
        return bool(extension_available())
    except Exception:  # pragma: no cover
        return False


@dataclass
class ParamSwap:
    """One parameter replaced by another of a different shape (a storage or pattern change).

    ``state_map`` turns a tensor shaped like ``old`` (its gradient, an optimizer moment) into the
    matching tensor shaped like ``new``: a gather of the kept entries when a layer is compressed or
    pruned further, a scatter into zeros when it is decompressed. The caller re-maps the optimizer
    (:func:`lightning_dynmo.runtime.optimizer_layout.replace_param`); the module has already moved
    the gradient.
    """

    name: str  # attribute name inside the module ("weight")
    old: nn.Parameter
    new: nn.Parameter
    state_map: Callable[[Tensor], Tensor]


class PrunableLinear(nn.Linear):
    """``nn.Linear`` whose pruned weights are gone, in one of two storages.

    * ``storage == "dense"``: ``weight`` is the dense ``[out, in]`` master weight and the
      ``weight_mask`` buffer (bool, 1 = kept) is applied in every forward, so pruned weights never
      contribute and get zero gradient. With ``sparse_kernel`` on, the forward gathers the kept
      values and runs the CSR kernel; memory does not shrink.
    * ``storage == "csr"`` (after :meth:`compress`): ``weight`` **is the CSR values vector**
      ``[nnz]``, in row-major order of the kept positions, and the pattern lives in int32 buffers
      (``csr_crow``, ``csr_col``; with the kernel on also the cached transpose ``csr_crow_t``,
      ``csr_col_t``, ``csr_perm_t`` for the input gradient). Gradients and optimizer state are
      nnz-sized, and a data-parallel all-reduce of the gradient sends only kept values. There is
      no dense mask: :meth:`dense_mask` derives it. The forward runs the CSR kernel, or (kernel
      off: dense is faster at this density) scatters the values into a dense weight.

    The parameter keeps its name in both storages, so its fully-qualified name, its optimizer
    slot and the checkpoint keys never change. The state dict is always the dense format
    (``weight`` ``[out, in]`` with zeros at pruned positions, ``weight_mask``, ``bias``): a CSR-stored
    layer densifies on save, so a checkpoint loads into a dense single-process module whatever
    storage wrote it. Storage changes return a :class:`ParamSwap` for the optimizer re-map.
    Everything the layer owns is a parameter or a buffer, so migration moves it generically. With
    an all-ones mask the output equals ``nn.Linear`` bitwise (``w * 1.0 == w``).

    Sharded (``dp_sharding="fsdp"``), either storage is an FSDP unit's:

    * dense (:attr:`sharded`): the weight is a ``Shard(0)`` DTensor and the mask is cut the same
      way (:meth:`buffers_sharded_like`), so each rank holds the mask rows of its weight rows. The
      forward runs dense on the all-gathered weight *without* the mask, which is the masked
      product: pruned weights are zero at rest (:meth:`apply_mask` after every optimizer step;
      Adam and weight decay keep a zero weight with a zero gradient and zeroed moments at zero).
      The weight's gradient is masked on the shard instead, after the reduce-scatter
      (:meth:`mask_grad`; masking commutes with the replicas' sum), which is the single-process
      gradient exactly.
    * CSR (:attr:`values_sharded`): the values vector is the ``Shard(0)`` DTensor (each replica
      holds ``1/dp`` of the kept weights, their gradient and their moments) and the pattern
      buffers are whole on every replica. The forward runs on the all-gathered values as above
      (the CSR kernel or the scatter), so the math is ``replicate``'s CSR layer. Storage and
      pattern changes swap the values parameter, which an FSDP unit cannot adopt: the caller
      gathers the layer whole first and shards it again after (``callbacks/pruning.py``).

    Counts (:meth:`local_counts`) and kept values are this rank's piece (a CSR layer's counts are
    whole); the callers sum them over the replicas. The state dict is the dense format laid out
    as a dense-stored sharded layer's (``Shard(0)`` rows of the weight and its mask): a
    CSR-stored sharded layer's :meth:`state_dict` all-gathers its values (collective over the
    replicas). A layer pruned to nothing keeps its empty values out of the unit, plain.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.register_buffer("weight_mask", torch.ones_like(self.weight, dtype=torch.bool))
        self.sparse_kernel = False
        self.semi_structured = False
        self._semi_cache = None
        self._semi_check: tuple = (None, None)
        self.storage = "dense"
        self._empty_csr()

    def __getstate__(self):
        state = dict(self.__dict__, _semi_cache=None, _semi_check=(None, None))  # derived GPU state: rebuilt on use
        return state

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
        new.semi_structured = False
        new.storage = "dense"
        new._empty_csr()
        new.train(linear.training)
        return new

    @torch.no_grad()
    def init_own_buffers(self) -> None:
        """The mask a fresh layer holds (every weight kept), for a layer made prunable on the
        meta device and materialised later (``protocol.layer_init.initialise_layer``; the CSR
        buffers are empty). Its shard, where the mask is one."""
        if not self.compressed:
            _local(self.weight_mask).fill_(True)

    # ------------------------------------------------------------------ views (either storage)
    @property
    def compressed(self) -> bool:
        return self.storage == "csr"

    @property
    def sharded(self) -> bool:
        """Dense-stored and the mask is a shard (the layer is an FSDP unit's, ``dp_sharding="fsdp"``)."""
        return not self.compressed and isinstance(self.weight_mask, DTensor)

    @property
    def values_sharded(self) -> bool:
        """CSR-stored and the values are an FSDP shard (at rest: a forward holds them gathered)."""
        return self.compressed and isinstance(self.weight, DTensor)

    def buffers_sharded_like(self) -> dict[str, str]:
        """Buffers laid out like a parameter, which FSDP sharding cuts like it (runtime/fsdp.py)."""
        return {} if self.compressed else {"weight_mask": "weight"}

    @property
    def nnz(self) -> int:
        if self.sharded:
            raise RuntimeError("this layer's mask is sharded over the data-parallel replicas: count its piece with "
                               "local_counts() and sum over the replicas")
        return self.weight.numel() if self.compressed else int(self.weight_mask.sum())

    def local_counts(self) -> tuple[int, int]:
        """``(kept, total)`` weights of the piece this rank holds: the mask's shard when
        :attr:`sharded`, else the whole layer (a CSR layer's pattern is whole on every replica, so
        under fsdp its counts are the same on each: callers count them once)."""
        if not self.sharded:
            return self.nnz, self.in_features * self.out_features
        mask = _local(self.weight_mask)
        return int(mask.sum()), mask.numel()

    @property
    def density(self) -> float:
        return self.nnz / max(1, self.in_features * self.out_features)

    def _rows(self) -> Tensor:
        from ..sparse._ops import _rows_of

        return _rows_of(self.csr_crow)

    @torch.no_grad()
    def dense_mask(self) -> Tensor:
        """``[out, in]`` bool, True where a weight is kept."""
        if not self.compressed:
            return self.weight_mask.clone()
        mask = torch.zeros(self.out_features, self.in_features, dtype=torch.bool, device=self.weight.device)
        mask[self._rows(), self.csr_col.long()] = True
        return mask

    @torch.no_grad()
    def dense_weight(self) -> Tensor:
        """``[out, in]`` weight with zeros at pruned positions (a detached copy)."""
        if not self.compressed:
            return self.weight.detach() * self.weight_mask
        w = self.weight.new_zeros(self.out_features, self.in_features)
        w[self._rows(), self.csr_col.long()] = self.weight.detach()
        return w

    @torch.no_grad()
    def kept_values(self) -> Tensor:
        """The kept weights, row-major (what a global magnitude threshold ranks); of this rank's
        piece when sharded."""
        if self.compressed:
            return _local(self.weight.detach())
        return _local(self.weight.detach())[_local(self.weight_mask)]

    # ------------------------------------------------------------------ masks (dense storage)
    @torch.no_grad()
    def apply_mask(self) -> None:
        """Zero pruned weights (an optimizer's momentum or weight decay must not revive them).
        A CSR-stored layer holds no pruned weights: nothing to do."""
        if not self.compressed:
            _local(self.weight).mul_(_local(self.weight_mask))

    @torch.no_grad()
    def mask_grad(self) -> None:
        """Sharded: zero the pruned entries of the weight's (reduce-scattered) gradient shard; the
        forward did not mask (see the class docstring). Otherwise the forward already did."""
        if self.sharded and self.weight.grad is not None:
            _local(self.weight.grad).mul_(_local(self.weight_mask))

    @torch.no_grad()
    def set_mask(self, mask: Tensor) -> None:
        """Dense storage: replace the mask (and zero the newly pruned weights). Sharded: ``mask``
        is this rank's piece (or a DTensor laid out as the mask)."""
        if self.compressed:
            raise RuntimeError("set_mask changes a dense mask; a CSR-stored layer prunes with prune_to()")
        local = _local(self.weight_mask)
        local.copy_(_local(mask).to(device=local.device, dtype=local.dtype))
        self.apply_mask()
        if self.sparse_kernel:
            self._build_csr()

    @torch.no_grad()
    def prune_magnitude(self, threshold: float) -> ParamSwap | None:
        """Prune every kept weight with ``|w| <= threshold`` (masks only shrink). Dense storage
        changes the mask in place and returns None; CSR storage drops the values and returns the
        :class:`ParamSwap` (None when nothing was pruned)."""
        if not self.compressed:
            self.set_mask(_local(self.weight_mask) & (_local(self.weight.detach()).abs() > threshold))
            return None
        return self._keep(self.weight.detach().abs() > threshold)

    @torch.no_grad()
    def prune_to(self, mask: Tensor) -> ParamSwap | None:
        """Keep only weights that ``mask`` (``[out, in]`` bool) keeps; see :meth:`prune_magnitude`."""
        mask = mask.to(device=self.weight.device, dtype=torch.bool)
        if not self.compressed:
            self.set_mask(self.weight_mask & mask)
            return None
        return self._keep(mask[self._rows(), self.csr_col.long()])

    def _keep(self, keep: Tensor) -> ParamSwap | None:
        """CSR storage: keep the values where ``keep`` ([nnz] bool) is true."""
        if bool(keep.all()):
            return None
        mask = torch.zeros(self.out_features, self.in_features, dtype=torch.bool, device=keep.device)
        mask[self._rows()[keep], self.csr_col.long()[keep]] = True
        old = self.weight
        new = nn.Parameter(old.detach()[keep].clone(), requires_grad=old.requires_grad)
        if old.grad is not None:
            new.grad = old.grad[keep].clone()
        self.weight = new
        self._set_pattern(mask)
        return ParamSwap("weight", old, new, lambda t, keep=keep: t[keep])

    # ------------------------------------------------------------------ storage
    @torch.no_grad()
    def compress(self) -> ParamSwap:
        """Dense -> CSR storage: the master weight becomes the kept values (gradients and optimizer
        state follow through the returned swap's gather)."""
        if self.compressed:
            raise RuntimeError("layer is already CSR-stored")
        if self.sharded:
            raise RuntimeError("a layer sharded over data-parallel replicas (dp_sharding='fsdp') stays dense-stored")
        mask = self.weight_mask.bool()
        flat = mask.reshape(-1).nonzero(as_tuple=True)[0]  # row-major kept positions
        old = self.weight
        new = nn.Parameter(old.detach().reshape(-1)[flat].clone(), requires_grad=old.requires_grad)
        if old.grad is not None:
            new.grad = old.grad.reshape(-1)[flat].clone()
        del self.weight_mask  # the pattern is the CSR buffers from now on
        self.weight = new
        self.storage = "csr"
        self.csr_index = torch.zeros(0, dtype=torch.int64, device=mask.device)
        self._set_pattern(mask)
        return ParamSwap("weight", old, new, lambda t, flat=flat: t.reshape(-1)[flat])

    @torch.no_grad()
    def decompress(self) -> ParamSwap:
        """CSR -> dense storage (the inverse of :meth:`compress`)."""
        if not self.compressed:
            raise RuntimeError("layer is already dense-stored")
        mask = self.dense_mask()
        shape = (self.out_features, self.in_features)

        def scatter(t: Tensor, mask=mask) -> Tensor:
            out = t.new_zeros(shape)
            out[mask] = t
            return out

        old = self.weight
        new = nn.Parameter(scatter(old.detach()), requires_grad=old.requires_grad)
        if old.grad is not None:
            new.grad = scatter(old.grad)
        self.weight = new
        self.storage = "dense"
        self.register_buffer("weight_mask", mask)
        for name in ("csr_crow", "csr_col", "csr_crow_t", "csr_col_t", "csr_perm_t"):
            setattr(self, name, torch.zeros(0, dtype=torch.int32, device=mask.device))
        if self.sparse_kernel:
            self._build_csr()
        return ParamSwap("weight", old, new, scatter)

    def _set_pattern(self, mask: Tensor) -> None:
        """CSR storage: pattern buffers for ``mask`` (and the kernel's transpose when it is on)."""
        from ..sparse.linear import csr_pattern

        self.csr_crow, self.csr_col = csr_pattern(mask)
        self._refresh_transpose()

    def _refresh_transpose(self) -> None:
        empty = torch.zeros(0, dtype=torch.int32, device=self.csr_crow.device)
        if self.compressed and self.sparse_kernel:
            from ..sparse import _ops

            self.csr_crow_t, self.csr_col_t, self.csr_perm_t = _ops.csr_transpose(
                self.csr_crow, self.csr_col, self.in_features)
        else:
            self.csr_crow_t, self.csr_col_t, self.csr_perm_t = empty, empty.clone(), empty.clone()

    # ------------------------------------------------------------------ sparse kernel
    @torch.no_grad()
    def set_sparse_kernel(self, enabled: bool) -> None:
        """Compute with the CSR kernel of :mod:`lightning_dynmo.sparse` (needs its extension)."""
        if enabled and not sparse_kernels_available():
            raise RuntimeError("the sparse-kernel extension is not available; keep masked dense layers")
        self.sparse_kernel = bool(enabled)
        if self.compressed:
            self._refresh_transpose()
        elif enabled:
            self._build_csr()
        else:
            self._empty_csr()

    @torch.no_grad()
    def _build_csr(self) -> None:
        """Dense storage with the kernel on: the CSR of the mask plus the gather index."""
        from ..sparse import _ops
        from ..sparse.linear import csr_pattern

        mask = self.weight_mask.bool()
        self.csr_crow, self.csr_col = csr_pattern(mask)
        self.csr_index = mask.reshape(-1).nonzero(as_tuple=True)[0]
        self.csr_crow_t, self.csr_col_t, self.csr_perm_t = _ops.csr_transpose(self.csr_crow, self.csr_col,
                                                                               self.in_features)

    # ------------------------------------------------------------------ 2:4 semi-structured
    def set_semi_structured(self, enabled: bool) -> None:
        """Compute with torch's 2:4 semi-structured kernels where they can run (CUDA, bf16/fp16,
        a 2:4 mask, dense storage); elsewhere the forward stays masked dense, the same math
        (:meth:`semi_structured_unavailable` says why)."""
        if enabled and self.compressed:
            raise RuntimeError("2:4 semi-structured kernels compress the dense weight; this layer is CSR-stored")
        self.semi_structured = bool(enabled)
        self._semi_cache = None

    def compute_dtype(self, x: Tensor) -> torch.dtype:
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return self.weight.dtype

    def semi_structured_unavailable(self, device, dtype: torch.dtype) -> str | None:
        """None when the 2:4 route runs this layer on ``device`` in ``dtype``; else why not."""
        from ..sparse.semi_structured import is_2to4, semi_structured_unavailable

        if self.compressed:
            return "the layer is CSR-stored"
        key = (self.weight_mask._version, self.weight_mask.data_ptr(), str(device), dtype)
        if self._semi_check[0] != key:
            why = semi_structured_unavailable(device, dtype, self.out_features, self.in_features)
            if why is None and not is_2to4(self.weight_mask):
                why = "the mask is not 2:4 (more than 2 kept in some group of 4 input weights)"
            self._semi_check = (key, why)
        return self._semi_check[1]

    def _forward_semi_structured(self, x: Tensor) -> Tensor | None:
        dtype = self.compute_dtype(x)
        if self.semi_structured_unavailable(x.device, dtype) is not None:
            return None
        from ..sparse.semi_structured import SemiStructuredCache, semi_structured_linear

        if self._semi_cache is None:
            self._semi_cache = SemiStructuredCache()
        return semi_structured_linear(x, self.weight, self.weight_mask, self.bias, self._semi_cache, dtype)

    def forward(self, x: Tensor) -> Tensor:
        if self.compressed:
            return self._forward_csr(x)
        if self.sharded:  # the all-gathered weight, zero where pruned; its gradient is masked on the shard
            return F.linear(x, self.weight, self.bias)
        if self.semi_structured:
            y = self._forward_semi_structured(x)
            if y is not None:
                return y
        if self.sparse_kernel and self.csr_crow.numel() and x.dtype in (torch.float32, torch.float64) \
                and x.dtype == self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
            from ..sparse import _ops

            values = self.weight.reshape(-1).index_select(0, self.csr_index)
            lead = x.shape[:-1]
            y = _ops.sparse_linear(x.reshape(-1, self.in_features), values, self.bias, self.csr_crow,
                                   self.csr_col, self.csr_crow_t, self.csr_col_t, self.csr_perm_t)
            return y.reshape(*lead, self.out_features)
        return F.linear(x, self.weight * self.weight_mask, self.bias)

    def _forward_csr(self, x: Tensor) -> Tensor:
        values, bias = self.weight, self.bias
        if not self.sparse_kernel:  # dense is faster at this density: scatter the values
            w = values.new_zeros(self.out_features, self.in_features).index_put(
                (self._rows(), self.csr_col.long()), values)
            return F.linear(x, w, bias)
        from ..sparse import _ops

        if torch.is_autocast_enabled(x.device.type):  # match nn.Linear under autocast
            dtype = torch.get_autocast_dtype(x.device.type)
            x, values = x.to(dtype), values.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        lead = x.shape[:-1]
        y = _ops.sparse_linear(x.reshape(-1, self.in_features), values, bias, self.csr_crow, self.csr_col,
                               self.csr_crow_t, self.csr_col_t, self.csr_perm_t)
        return y.reshape(*lead, self.out_features)

    # ------------------------------------------------------------------ state dict: always dense
    @torch.no_grad()
    def dense_like(self, values: Tensor) -> Tensor:
        """``[out, in]`` with ``values`` (shaped like the CSR values: the weight, its gradient or a
        moment) at the kept positions and zeros elsewhere. A DTensor shard of them gives the dense
        tensor's ``Shard(0)`` rows on the same mesh, as a dense-stored sharded layer holds it
        (collective: the values are all-gathered)."""
        if not self.compressed:
            raise RuntimeError("dense_like maps CSR values; this layer is dense-stored")
        mesh = values.device_mesh if isinstance(values, DTensor) else None
        flat = values.full_tensor() if mesh is not None else values.detach()
        dense = flat.new_zeros(self.out_features, self.in_features)
        dense[self._rows(), self.csr_col.long()] = flat
        return dense if mesh is None else distribute_tensor(dense, mesh, [Shard(0)], src_data_rank=None)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        if not self.compressed:
            return super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.dense_like(self.weight.detach())
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()
        mask = self.dense_mask()
        if self.values_sharded:  # rows, as the weight (a bool shard needs no collective)
            mask = distribute_tensor(mask, self.weight.device_mesh, [Shard(0)], src_data_rank=None)
        destination[prefix + "weight_mask"] = mask

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        if not self.compressed:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        wkey, mkey = prefix + "weight", prefix + "weight_mask"
        if wkey in state_dict:
            w = _whole(state_dict[wkey])  # (fsdp: the dense weight's rows; collective)
            shape = (self.out_features, self.in_features)
            if tuple(w.shape) != shape:
                error_msgs.append(f"size mismatch for {wkey}: copying a param with shape {tuple(w.shape)}, "
                                  f"the dense shape of this CSR-stored layer is {shape}")
            else:
                mask = _whole(state_dict[mkey]) if mkey in state_dict else w != 0
                mask = mask.to(device=w.device, dtype=torch.bool)
                if not torch.equal(mask, self.dense_mask()):
                    error_msgs.append(f"{mkey}: the checkpoint's sparsity pattern differs from this CSR-stored "
                                      "layer's; load it into a freshly built (dense) model, whose pruning "
                                      "callback compresses it again")
                else:
                    values = w.to(device=w.device, dtype=self.weight.dtype)[mask]
                    if self.values_sharded:  # this replica's piece of the values
                        values = distribute_tensor(values, self.weight.device_mesh, self.weight.placements,
                                                   src_data_rank=None).to_local()
                    with torch.no_grad():
                        _local(self.weight).copy_(values)
        rest = {k: v for k, v in state_dict.items() if k.startswith(prefix) and k not in (wkey, mkey)}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if wkey in state_dict and wkey in missing_keys:
            missing_keys.remove(wkey)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", storage={self.storage}, sparse_kernel={self.sparse_kernel}, "
                                       f"semi_structured={self.semi_structured}")


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
    """Layers that are (or contain) a GPT ``Block``, or half of one (sublayer granularity): not the
    embedding, final norm or head. (The callback falls back to every layer but the first and the
    last when no layer matches.)"""
    from ..models.gpt import Block
    from ..models.gpt.granularity import AttentionHalf, MLPHalf

    if isinstance(layer, (Block, AttentionHalf, MLPHalf)):
        return True
    if any(isinstance(m, Block) for m in layer.modules()):
        return True
    return False
