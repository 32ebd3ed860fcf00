"""``GradualPruning``: Zhu & Gupta gradual global magnitude pruning across pipeline stages."""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Literal

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import torch.distributed as dist

from ._pipeline_access import (all_reduce_over_model, all_reduce_over_pipeline, invalidate_pipeline, local_layers,
    model_reduce_groups, pipeline_layers, pipeline_of, reduce_device, replica_group, request_rebalance,
    shards_over_replicas, whole_layers)
from ..dynamic.nm_sparsity import nm_droppable, nm_max_sparsity, parse_nm, satisfies_nm, transposable_droppable
from ..dynamic.pruning import ParamSwap, PrunableLinear, _local, cubic_sparsity, default_prunable_layer, \
    global_magnitude_threshold, make_prunable, prunable_modules, sparse_kernels_available
from ..protocol import state_dict_key
from ..runtime.optimizer_layout import replace_param

log = logging.getLogger(__name__)


class GradualPruning(Callback):
    """Unstructured global magnitude pruning on the cubic schedule of Zhu & Gupta (2017):

    ``s_t = s_f + (s_i - s_f) (1 - (t - t0) / (n dt))^3`` at ``t = t0, t0 + dt, ..., t0 + n dt``

    (``t``: optimizer step, ``t0 = start_step``, ``dt = frequency``, ``n = n_steps``). Pruning runs
    at the start of a scheduled step, so that step already trains the new mask; at step
    ``t0 + n dt`` the global sparsity over all prunable weights is ``final_sparsity``. With
    ``initial_sparsity=0, final_sparsity=0.9, n_steps=4`` the steps after ``t0`` prune to 52 %,
    79 %, 89 % and 90 % (DynMo's schedule); a step that prunes nothing (``t0`` with ``s_i = 0``)
    requests no rebalance. Continual training: start from trained weights
    (``start_step`` after a dense phase, or a checkpoint) -- global magnitude pruning then keeps
    each layer at whatever density its weight magnitudes earn.

    * Prunable weights: every ``nn.Linear`` inside the GPT blocks (not embeddings, final norm or
      head); ``layer_filter(index, layer) -> bool`` overrides the choice of layers. At ``setup``
      their Linears become :class:`~lightning_dynmo.dynamic.PrunableLinear` (same Parameters).
    * Threshold: :func:`~lightning_dynmo.dynamic.global_magnitude_threshold` over the kept
      weights of the local prunable layers (pruned ones count as zeros), reduced over
      ``strategy.pipeline.pipeline_group`` (exact k-th |w|, no weight gathering; identical on
      data-parallel replicas). Masks only shrink.
    * Storage (``storage_density``): a layer whose density is at most this is **CSR-stored**
      (:meth:`PrunableLinear.compress`): its master weight becomes the kept values, so its
      gradient, its optimizer moments and its data-parallel gradient all-reduce shrink with its
      density. The optimizer is re-mapped in place (same groups and slots; the LR schedule is
      untouched): ``strategy.pipeline.optimizer_layout.replace_param`` under ``DynMoStrategy``,
      :func:`~lightning_dynmo.runtime.optimizer_layout.replace_param` under a single-device
      strategy. Other strategies (e.g. DDP, which registers parameters once) keep dense storage.
      ``None`` keeps every layer dense-stored (masked dense). Dense-stored layers zero the
      pruned weights and their optimizer state, and re-apply masks after every optimizer step.
    * Pattern (``pattern``): ``"unstructured"`` (default) prunes any weight. ``"N:M"`` (e.g.
      ``"2:4"``) keeps the ``N`` largest ``|w|`` of every group of ``M`` consecutive input weights
      (:mod:`lightning_dynmo.dynamic.nm_sparsity`): inside the same global magnitude schedule only
      weights outside their group's top ``N`` are pruned, so the N:M part caps sparsity at
      ``1 - N/M`` (50 % for 2:4; a schedule asking for more is an error) and that sparsity is
      exactly the N:M pattern. N:M layers stay dense-stored (``storage_density`` is not used):
      the 2:4 kernels compress the dense weight after every optimizer step. Prunable layers need
      ``in_features`` divisible by ``M`` (checked at ``on_train_start`` on every rank).
      ``"2:4T"``: transposable 2:4 -- per 4x4 tile the best pattern with 2 kept in every row *and*
      column (:func:`~lightning_dynmo.dynamic.nm_sparsity.transposable_2to4_keep`), so on CUDA
      the input gradient runs on the 2:4 kernels too; both dims divisible by 4.
    * Kernels (``sparse_kernels``): ``"auto"`` picks per layer the fastest of dense, 2:4
      semi-structured (torch's tensor-core kernels: CUDA, bf16/fp16, a 2:4 mask) and the CSR kernel
      of :mod:`lightning_dynmo.sparse` (extension built, fp32/fp64), by measurement per device
      type, compute dtype and token bucket (``kernel_tokens``;
      :func:`~lightning_dynmo.sparse.dispatch.choose_linear_kernel`). The data-parallel replicas
      of a stage then adopt their first replica's choice (one broadcast per pruning step), so
      rank-local timing noise can never make replicas compute differently. ``True`` forces 2:4
      where it can run, else CSR wherever the extension exists; ``False`` never leaves dense.
      On CPU the 2:4 route does not exist: a layer asked for it computes masked dense, the same
      math. A CSR-stored layer whose kernel is off scatters its values into a dense weight.
      ``kernels`` holds the agreed choice per local layer, ``local_kernels`` this rank's own.
    * Checkpoints stay in the dense single-process format: ``PrunableLinear`` densifies its state
      dict and :meth:`on_save_checkpoint` densifies the optimizer state of CSR-stored weights. On
      resume the layers are compressed again at ``on_train_start``.
    * ``dp_sharding="fsdp"``: each replica holds a ``Shard(0)`` piece of every weight, its mask
      rows alongside (:class:`~lightning_dynmo.dynamic.PrunableLinear`, sharded). The threshold
      counts each replica's piece and sums over the replicas and the pipeline (every weight once:
      the single-process threshold exactly); dense-stored layers' masks, weights and moments
      change on the shards without communication and run masked dense on the all-gathered
      weight. A layer that reaches ``storage_density`` is gathered whole over its replicas,
      compressed as under ``replicate`` and sharded again: its CSR values, their gradient and
      moments are ``1/dp`` shards, its pattern whole on every replica, and ``sparse_kernels``
      picks its kernel, agreed over the replicas. A CSR-stored layer that loses weights at a
      later pruning step is gathered and sharded again the same way (one all-gather of each
      such layer per pruning step; see docs/parallelism.md).
    * ``repack``: after the last pruning step, ask the strategy to pack the pipeline onto fewer
      ranks (``strategy.pipeline.request_repack(repack)``: an int target or ``"auto"``); None: do not ask.
    * Logs ``pruning/sparsity`` (global, measured), ``pruning/target_sparsity`` and
      ``pruning/density_L{i}`` per layer; ``history`` records each step's threshold and per-layer
      densities; calls ``strategy.pipeline.request_rebalance("pruning: ...")``.
    """

    def __init__(
        self,
        final_sparsity: float = 0.8,
        initial_sparsity: float = 0.0,
        start_step: int = 0,
        n_steps: int = 10,
        frequency: int = 100,
        layer_filter: Callable[[int, nn.Module], bool] | None = None,
        sparse_kernels: bool | Literal["auto"] = "auto",
        kernel_tokens: int = 2048,
        storage_density: float | None = 0.5,
        repack: int | str | None = None,
        pattern: str = "unstructured",
    ) -> None:
        for name, v in (("final_sparsity", final_sparsity), ("initial_sparsity", initial_sparsity)):
            if not 0.0 <= float(v) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {v}")
        if int(n_steps) < 1 or int(frequency) < 1 or int(start_step) < 0:
            raise ValueError("n_steps and frequency must be >= 1 and start_step >= 0")
        if sparse_kernels not in (True, False, "auto"):
            raise ValueError(f"sparse_kernels must be True, False or 'auto', got {sparse_kernels!r}")
        if storage_density is not None and not 0.0 <= float(storage_density) <= 1.0:
            raise ValueError(f"storage_density must be in [0, 1] or None, got {storage_density}")
        if repack is not None and not (repack == "auto" or (isinstance(repack, int) and repack >= 1)):
            raise ValueError(f"repack must be None, 'auto' or a rank count >= 1, got {repack!r}")
        self.transposable = pattern == "2:4T"
        self.nm = (2, 4) if self.transposable else parse_nm(pattern)
        if self.nm is not None:
            cap = nm_max_sparsity(*self.nm)
            for name, v in (("final_sparsity", final_sparsity), ("initial_sparsity", initial_sparsity)):
                if float(v) > cap + 1e-9:
                    raise ValueError(f"{name}={v} exceeds what pattern {pattern!r} reaches: an N:M pattern keeps "
                                     f"N of every M weights, so sparsity is capped at 1 - N/M = {cap:g}")
        self.pattern = pattern
        self.final_sparsity = float(final_sparsity)
        self.initial_sparsity = float(initial_sparsity)
        self.start_step = int(start_step)
        self.n_steps = int(n_steps)
        self.frequency = int(frequency)
        self.layer_filter = layer_filter
        self.sparse_kernels = sparse_kernels
        self.kernel_tokens = int(kernel_tokens)
        self.storage_density = None if storage_density is None else float(storage_density)
        self.repack = repack
        # state
        self.last_prune_step = -1
        self.target_sparsity = 0.0
        self.sparsity = 0.0
        self.history: list[dict] = []
        self._prunable: set[int] = set()
        self._warned_storage = False
        self.kernels: dict[str, str] = {}  # agreed kernel per local prunable Linear (qualified name)
        self.local_kernels: dict[str, str] = {}  # what this rank measured, before the agreement

    # ------------------------------------------------------------------ schedule
    def sparsity_at(self, step: int) -> float:
        return cubic_sparsity(step, self.initial_sparsity, self.final_sparsity, self.start_step, self.n_steps,
                              self.frequency)

    def is_pruning_step(self, step: int) -> bool:
        off = step - self.start_step
        return 0 <= off <= self.n_steps * self.frequency and off % self.frequency == 0

    @property
    def last_step(self) -> int:
        return self.start_step + self.n_steps * self.frequency

    # ------------------------------------------------------------------ setup
    def setup(self, trainer, pl_module, stage: str) -> None:
        layers = pipeline_layers(pl_module)
        if layers is None:
            raise TypeError(f"GradualPruning needs pipeline_layers() on {type(pl_module).__name__}")
        L = len(layers)
        chosen = set()
        for i, layer in enumerate(layers):
            keep = self.layer_filter(i, layer) if self.layer_filter is not None else default_prunable_layer(i, layer, L)
            if keep:
                chosen.add(i)
        if not chosen and self.layer_filter is None:
            chosen = set(range(1, L - 1))
        self._prunable = chosen
        for i, layer in local_layers(pl_module):
            if i in chosen:
                make_prunable(layer)

    def _local_prunable(self, pl_module) -> list[tuple[int, str, PrunableLinear]]:
        return [(i, n, m) for i, layer in local_layers(pl_module) if i in self._prunable
                for n, m in prunable_modules(layer)]

    # ------------------------------------------------------------------ kernels and storage
    def _compute_dtype(self, trainer, m: PrunableLinear) -> torch.dtype:
        precision = str(getattr(trainer, "precision", ""))
        if "bf16" in precision:
            return torch.bfloat16
        if precision.startswith("16"):
            return torch.float16
        return m.weight.dtype

    def _choose_kernel(self, trainer, m: PrunableLinear) -> str:
        """This rank's choice among ``dense``, ``2:4`` and ``csr`` for ``m`` (see the class docstring)."""
        from ..sparse.dispatch import choose_linear_kernel, linear_kernel_candidates

        if self.sparse_kernels is False or m.sharded or m.density >= 1.0:
            return "dense"  # (sharded: masked dense on the all-gathered weight)
        device, dtype = m.weight.device, self._compute_dtype(trainer, m)
        two_four = not m.compressed and self.nm == (2, 4) and satisfies_nm(m.weight_mask, 2, 4)
        if self.sparse_kernels is True:
            cands = linear_kernel_candidates(m.in_features, m.out_features, device, dtype, m.density, two_four)
            if "2:4" in cands:
                return "2:4"
            return "csr" if sparse_kernels_available() else "dense"
        return choose_linear_kernel(m.in_features, m.out_features, self.kernel_tokens, device, dtype, m.density,
                                    two_four)

    def _agree(self, trainer, pl_module, choices: list[str]) -> list[str]:
        """The data-parallel replicas of this stage adopt their first replica's choices: ONE
        broadcast over the replica group (its length is checked, replicas hold the same layers)."""
        from ..sparse.dispatch import LINEAR_KERNELS

        group, replicated = replica_group(trainer)
        if not replicated or self.sparse_kernels != "auto":  # True and False decide without measuring
            return choices
        codes = torch.tensor([len(choices)] + [LINEAR_KERNELS.index(c) for c in choices], dtype=torch.int64,
                             device=reduce_device(trainer, pl_module))
        dist.broadcast(codes, group=group, group_src=0)
        codes = codes.cpu().tolist()
        if codes[0] != len(choices):
            raise RuntimeError(f"GradualPruning: this replica holds {len(choices)} prunable Linears, the first "
                               f"replica of its stage {codes[0]}; replicas of a stage must hold the same layers")
        return [LINEAR_KERNELS[c] for c in codes[1:]]

    def _refresh_kernels(self, trainer, pl_module) -> None:
        if self.sparse_kernels is True and not sparse_kernels_available() and self.nm != (2, 4):
            warnings.warn("GradualPruning(sparse_kernels=True): the sparse extension is not available; "
                          "pruned layers stay masked dense (their cost does not drop)")
        names = {id(m): n for n, m in pl_module.named_modules()}
        mods = [m for _, _, m in self._local_prunable(pl_module)]
        local = [self._choose_kernel(trainer, m) for m in mods]
        agreed = self._agree(trainer, pl_module, local)
        self.local_kernels = {names[id(m)]: k for m, k in zip(mods, local)}
        self.kernels = {names[id(m)]: k for m, k in zip(mods, agreed)}
        for m, kernel in zip(mods, agreed):
            if kernel == "csr" and not sparse_kernels_available():
                raise RuntimeError("GradualPruning: the replicas agreed on the CSR kernel, but this rank has no "
                                   "sparse extension; build it on every rank or use sparse_kernels=False")
            if (kernel == "csr") != m.sparse_kernel:
                m.set_sparse_kernel(kernel == "csr")
            if not m.compressed and (kernel == "2:4") != m.semi_structured:
                m.set_semi_structured(kernel == "2:4")

    def _can_swap_parameters(self, trainer) -> bool:
        """Parameter swaps need a strategy whose optimizers can be re-mapped in place: DynMo's
        layout, or a single process. DDP-style wrappers register parameters once."""
        from lightning.pytorch.strategies import SingleDeviceStrategy

        strategy = trainer.strategy
        if callable(getattr(getattr(pipeline_of(trainer), "optimizer_layout", None), "replace_param", None)):
            return True
        if isinstance(strategy, SingleDeviceStrategy):
            return True
        if not self._warned_storage:
            self._warned_storage = True
            warnings.warn(f"GradualPruning: {type(strategy).__name__} cannot re-map optimizer parameters; "
                          "pruned layers keep their dense master weight (storage_density ignored)")
        return False

    def _apply_swaps(self, trainer, pl_module, swaps: list[tuple[PrunableLinear, ParamSwap]]) -> None:
        """Re-map the optimizers for parameters a layer replaced (storage or pattern change)."""
        if not swaps:
            return
        names = {id(m): n for n, m in pl_module.named_modules()}
        layout = getattr(pipeline_of(trainer), "optimizer_layout", None)
        for m, swap in swaps:
            fqn = f"{names[id(m)]}.{swap.name}"
            if layout is not None and callable(getattr(layout, "replace_param", None)):
                layout.replace_param(trainer.optimizers, fqn, swap.old, swap.new, swap.state_map)
            else:
                replace_param(trainer.optimizers, swap.old, swap.new, swap.state_map)
        invalidate_pipeline(trainer)  # stages are rebuilt on the new parameters

    def _refresh_storage(self, trainer, pl_module) -> list[tuple[PrunableLinear, ParamSwap]]:
        """Compress every whole dense-stored layer whose density reached ``storage_density``
        (a sharded one is gathered first: :meth:`_layers_to_swap`)."""
        if self.storage_density is None or self.nm is not None:
            return []
        if not self._can_swap_parameters(trainer):
            return []
        return [(m, m.compress()) for _, _, m in self._local_prunable(pl_module)
                if not m.compressed and not m.sharded and m.density <= self.storage_density and m.density < 1.0]

    def _layers_to_swap(self, trainer, pl_module, threshold: float | None) -> list[int]:
        """``dp_sharding="fsdp"``: the local layers a pruning at ``threshold`` (None: none) makes
        swap a parameter, so they must be gathered whole first: a dense-stored Linear whose
        density reaches ``storage_density``, or a CSR-stored one that loses values. Decided from
        the replicas' counts summed in one all-reduce, the same on every replica."""
        if not shards_over_replicas(trainer) or self.storage_density is None or self.nm is not None:
            return []
        mods = self._local_prunable(pl_module)
        counts = torch.zeros(len(mods), 3, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        for k, (_, _, m) in enumerate(mods):
            w = _local(m.weight.detach())
            if m.compressed:  # values it would drop
                counts[k, 0] = 0 if threshold is None else int((w.abs() <= threshold).sum())
            else:  # weights it would keep, of all
                keep = _local(m.weight_mask) if threshold is None else _local(m.weight_mask) & (w.abs() > threshold)
                counts[k, 1], counts[k, 2] = int(keep.sum()), keep.numel()
        dist.all_reduce(counts, group=pipeline_of(trainer).data_parallel_group)
        swap = {i for (i, _, m), (drop, kept, total) in zip(mods, counts.tolist())
                if (m.compressed and drop > 0)
                or (not m.compressed and total > 0 and kept < total and kept / total <= self.storage_density)}
        return sorted(swap)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        if self.nm is not None:
            self._check_nm_shapes(trainer, pl_module)
        # resumed masks came with the (dense) model state; make weights, storage and kernels follow
        for _, _, m in self._local_prunable(pl_module):
            m.apply_mask()
        self._reshard(pl_module)
        with whole_layers(trainer, self._layers_to_swap(trainer, pl_module, None)):
            self._apply_swaps(trainer, pl_module, self._refresh_storage(trainer, pl_module))
        self._refresh_kernels(trainer, pl_module)

    def _check_nm_shapes(self, trainer, pl_module) -> None:
        """Every rank of the pipeline learns of a Linear an N:M pattern cannot split (one all-reduce)."""
        m_ = self.nm[1]
        bad = [f"L{i}.{n} (in_features={m.in_features}, out_features={m.out_features})"
               for i, n, m in self._local_prunable(pl_module)
               if m.in_features % m_ or (self.transposable and m.out_features % m_)]
        if self.transposable:  # fsdp: each shard's first row must start a 4x4 tile (torch.chunk's rows per shard)
            bad += [f"L{i}.{n} (out_features={m.out_features} in shards of {-(-m.out_features // dp)} rows over "
                    f"{dp} replicas)" for i, n, m in self._local_prunable(pl_module) if m.sharded
                    for dp in [m.weight.device_mesh.size()] if -(-m.out_features // dp) % m_]
        count = all_reduce_over_pipeline(
            trainer, torch.tensor([len(bad)], dtype=torch.int64, device=reduce_device(trainer, pl_module)))
        if int(count):
            raise ValueError(f"GradualPruning(pattern={self.pattern!r}): {int(count)} prunable Linear(s) have "
                             f"in_features{' or out_features' if self.transposable else ''} not divisible by {m_}"
                             + (f", here: {', '.join(bad)}" if bad else " on other pipeline ranks")
                             + "; exclude them with layer_filter or pick another pattern")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.is_pruning_step(step) and step != self.last_prune_step:
            self.prune(trainer, pl_module, self.sparsity_at(step))
            self.last_prune_step = step
            if step == self.last_step and self.repack is not None:
                fn = getattr(pipeline_of(trainer) or trainer.strategy, "request_repack", None)
                if callable(fn):
                    fn(self.repack)

    def _reshard(self, pl_module) -> None:
        """Sharded layers whose shards just changed in place drop any all-gathered copy a forward
        outside a training step left (FSDP2 reuses it), so their next forward gathers the pruned
        weights (no communication; nothing to do under ``replicate``)."""
        for i, layer in local_layers(pl_module):
            if i in self._prunable and isinstance(layer, FSDPModule):
                layer.reshard()

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.target_sparsity > 0:
            for _, _, m in self._local_prunable(pl_module):
                m.mask_grad()  # sharded layers: the forward ran unmasked (see PrunableLinear)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.target_sparsity > 0:
            for _, _, m in self._local_prunable(pl_module):
                m.apply_mask()  # optimizers (momentum, weight decay) must not revive pruned weights

    @torch.no_grad()
    def prune(self, trainer, pl_module, sparsity: float) -> float:
        """Prune to global ``sparsity`` now (collective over the pipeline group); returns the
        measured global sparsity."""
        self._reshard(pl_module)  # (an evaluation forward may have left units gathered: the shards count)
        mods = self._local_prunable(pl_module)
        before = self.sparsity
        needs, groups = model_reduce_groups(trainer)  # (fsdp: each replica counts its shards)
        zeros = sum(total - kept for _, _, m in mods for kept, total in [self._counts(trainer, m)])
        if self.nm is not None:  # only weights outside their group's top N compete (the rest rank as +inf)
            local = [(_local(m.weight.detach()), _local(m.weight_mask)) for _, _, m in mods]  # (rows: whole groups)
            droppable = [transposable_droppable(w, mask) if self.transposable else nm_droppable(w, mask, *self.nm)
                         for w, mask in local]
            ranked = [torch.where(d, w.abs(), torch.full_like(w, float("inf")))[mask]
                      for (w, mask), d in zip(local, droppable)]
        else:
            ranked = [m.kept_values() for _, _, m in mods]
        thr = global_magnitude_threshold(ranked, sparsity, group=groups, distributed=needs, zeros=zeros)
        with whole_layers(trainer, self._layers_to_swap(trainer, pl_module, thr)):  # (fsdp: storage changes)
            if self.nm is None:
                mods = self._local_prunable(pl_module)  # (the gathered layers are new modules)
            swaps = []
            for k, (_, _, m) in enumerate(mods):
                if self.nm is not None:
                    w, mask = local[k]
                    m.set_mask(mask & ~(droppable[k] & (w.abs() <= thr)))
                    swap = None
                else:  # (a sharded CSR layer left sharded has nothing to drop: see _layers_to_swap)
                    swap = None if m.values_sharded else m.prune_magnitude(thr)
                if swap is not None:
                    swaps.append((m, swap))
                elif not m.compressed:  # dense storage: pruned weights' optimizer state is zeroed
                    for opt in trainer.optimizers:
                        state = getattr(opt, "_optimizer", opt).state.get(m.weight)
                        for v in (state or {}).values():
                            if torch.is_tensor(v) and v.shape == m.weight_mask.shape:
                                _local(v).mul_(_local(m.weight_mask))  # (fsdp: a moment's shard, the mask's rows)
            self._reshard(pl_module)
            swaps += self._refresh_storage(trainer, pl_module)
            self._apply_swaps(trainer, pl_module, swaps)
        self._refresh_kernels(trainer, pl_module)
        self.target_sparsity = float(sparsity)
        dens = self.layer_densities(trainer, pl_module)
        kept, total = dens.pop("__kept__"), dens.pop("__total__")
        self.sparsity = 1.0 - kept / total if total else 0.0
        self.history.append({"step": int(trainer.global_step), "target": self.target_sparsity,
                             "sparsity": self.sparsity, "threshold": thr,
                             "densities": {str(i): round(d, 6) for i, d in dens.items()}})
        pl_module.log("pruning/sparsity", self.sparsity, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("pruning/target_sparsity", self.target_sparsity, on_step=True, on_epoch=False, batch_size=1)
        for i, d in dens.items():
            pl_module.log(f"pruning/density_L{i}", d, on_step=True, on_epoch=False, batch_size=1)
        log.info("pruning: step %d target %.4f measured %.4f (threshold %.3g)", trainer.global_step, sparsity,
                 self.sparsity, thr)
        if self.sparsity > before:  # (the schedule's t0 with s_i = 0 prunes nothing: no rebalance)
            request_rebalance(trainer, f"pruning: global sparsity {self.sparsity:.3f}")
        return self.sparsity

    @staticmethod
    def _counts(trainer, m: PrunableLinear) -> tuple[int, int]:
        """``(kept, total)`` of ``m`` that this rank adds to the sums over the model: its mask's
        shard (dense-stored under fsdp), else the whole layer, counted by one replica where
        each holds the whole pattern (CSR-stored under fsdp)."""
        if m.compressed and shards_over_replicas(trainer):
            group = pipeline_of(trainer).data_parallel_group
            return m.local_counts() if dist.get_rank(group) == 0 else (0, 0)
        return m.local_counts()

    def layer_densities(self, trainer, pl_module) -> dict:
        """``{layer index: kept fraction}`` over the prunable layers (collective under a pipeline),
        plus ``__kept__``/``__total__`` counts."""
        L = len(pipeline_layers(pl_module))
        vec = torch.zeros(2 * L, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        for i, _, m in self._local_prunable(pl_module):
            kept, total = self._counts(trainer, m)  # (fsdp: this replica's share; summed over the replicas below)
            vec[i] += float(kept)
            vec[L + i] += total
        vec = all_reduce_over_model(trainer, vec).cpu().tolist()
        out: dict = {i: vec[i] / vec[L + i] for i in range(L) if vec[L + i] > 0}
        out["__kept__"], out["__total__"] = sum(vec[:L]), sum(vec[L:])
        return out

    def state_bytes(self, trainer, pl_module) -> dict[str, float]:
        """Memory of the prunable layers over the pipeline (collective): ``stored`` = parameters +
        gradients (one per trainable parameter, as a training step holds them) + optimizer state
        as they are now; ``dense`` = the same for dense layers with the same optimizer; ``index`` = their
        buffers (CSR indices, dense masks). ``ratio = stored / dense``; ``ratio_with_index``
        counts the buffers too. Under ``dp_sharding="fsdp"`` each rank counts its shards and the
        sums run over the replicas too: the model's state once, as stored over all ranks."""
        vec = torch.zeros(3, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
        # (fsdp: a tensor that is not a shard, e.g. Adam's step, is on every replica: counted once)
        replicas = dist.get_world_size(pipeline_of(trainer).data_parallel_group) if shards_over_replicas(trainer) else 1
        for _, _, m in self._local_prunable(pl_module):
            for name, p in m.named_parameters(recurse=False):
                numel = _local(p).numel()
                dense_numel = m.in_features * m.out_features if name == "weight" and m.compressed else numel
                copies = 2 if p.requires_grad else 1  # the parameter, and its gradient while it trains
                vec[0] += copies * numel * p.element_size()
                vec[1] += copies * dense_numel * p.element_size()
                for opt in opts:
                    for v in opt.state.get(p, {}).values():
                        if torch.is_tensor(v):
                            like = v.dim() > 0 and v.shape == p.shape
                            share = 1 if isinstance(v, DTensor) else replicas
                            vec[0] += _local(v).numel() * v.element_size() / share
                            vec[1] += (dense_numel if like else _local(v).numel()) * v.element_size() / share
            vec[2] += sum(_local(b).numel() * b.element_size() for b in m.buffers(recurse=False))
        stored, dense, index = all_reduce_over_model(trainer, vec).cpu().tolist()
        return {"stored": stored, "dense": dense, "index": index,
                "ratio": stored / dense if dense else 1.0,
                "ratio_with_index": (stored + index) / dense if dense else 1.0}

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        """Densify the optimizer state of CSR-stored weights (nnz-long moments become ``[out, in]``
        with zeros at pruned positions), so the checkpoint is exactly what a masked-dense
        single-process run writes. A single-file checkpoint holds the states where it was
        gathered (rank 0 under ``DynMoStrategy``); a DCP one holds each rank's own, keyed by
        name, whose fsdp shards become the dense moments' row shards (collective over the
        replicas, :meth:`PrunableLinear.dense_like`)."""
        states, model = checkpoint.get("optimizer_states"), checkpoint.get("state_dict")
        if not states or not model:
            return
        csr = {state_dict_key(pl_module, f"{n}.weight"): m for n, m in pl_module.named_modules()
               if isinstance(m, PrunableLinear) and m.compressed}
        for key, m in csr.items():  # DCP: by name, in module order (the same on every replica)
            for sd in states:
                state = sd.get("state", {}).get(key) if isinstance(sd, dict) else None
                for k, v in (state or {}).items():
                    if torch.is_tensor(v) and v.dim() == 1 and tuple(v.shape) == tuple(m.weight.shape):
                        state[k] = m.dense_like(v)
        names = _optimizer_index_names(trainer, pl_module)
        for o, sd in enumerate(states):
            if not isinstance(sd, dict) or o >= len(names):
                continue
            for index, state in sd.get("state", {}).items():
                if isinstance(index, str):  # (DCP: done above)
                    continue
                fqn = names[o].get(index)
                if fqn is None or not fqn.endswith(".weight"):
                    continue
                key = state_dict_key(pl_module, fqn)  # the parameter's name as the checkpoint keys it
                mask = model.get(key[: -len("weight")] + "weight_mask")
                if mask is None or mask.dim() != 2:
                    continue
                mask = mask.bool()
                nnz = int(mask.sum())
                for key, v in list(state.items()):
                    if torch.is_tensor(v) and v.dim() == 1 and v.numel() == nnz and mask.numel() != nnz:
                        dense = v.new_zeros(mask.shape)
                        dense[mask.to(v.device)] = v
                        state[key] = dense

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"last_prune_step": self.last_prune_step, "target_sparsity": self.target_sparsity,
                "sparsity": self.sparsity, "history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_prune_step = int(state_dict.get("last_prune_step", -1))
        self.target_sparsity = float(state_dict.get("target_sparsity", 0.0))
        self.sparsity = float(state_dict.get("sparsity", 0.0))
        self.history = list(state_dict.get("history", []))


def _optimizer_index_names(trainer, pl_module) -> list[dict[int, str]]:
    """For each optimizer, single-process state index -> parameter name."""
    layout = getattr(pipeline_of(trainer), "optimizer_layout", None)
    if layout is not None and hasattr(layout, "slots"):
        out: list[dict[int, str]] = [{} for _ in trainer.optimizers]
        for fqn, slot in layout.slots.items():
            if slot.optimizer < len(out):
                out[slot.optimizer][slot.index] = fqn
        return out
    names = {id(p): n for n, p in pl_module.named_parameters()}
    out = []
    for opt in trainer.optimizers:
        opt = getattr(opt, "_optimizer", opt)
        flat = [p for group in opt.param_groups for p in group["params"]]
        out.append({k: names[id(p)] for k, p in enumerate(flat) if id(p) in names})
    return out
