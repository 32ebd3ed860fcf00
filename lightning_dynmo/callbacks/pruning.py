"""``GradualPruning``: Zhu & Gupta gradual global magnitude pruning across pipeline stages."""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Literal

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from ..dynamic._dist import all_reduce_over_pipeline, local_layers, pipeline_layers, pipeline_reduce_group, \
    reduce_device, request_rebalance
from ..dynamic.pruning import PrunableLinear, cubic_sparsity, default_prunable_layer, \
    global_magnitude_threshold, make_prunable, prunable_modules, sparse_kernels_available

log = logging.getLogger(__name__)


class GradualPruning(Callback):
    """Unstructured global magnitude pruning on the cubic schedule of Zhu & Gupta (2017):

    ``s_t = s_f + (s_i - s_f) (1 - (t - t0) / (n dt))^3`` at ``t = t0, t0 + dt, ..., t0 + n dt``

    (``t``: optimizer step, ``t0 = start_step``, ``dt = frequency``, ``n = n_steps``). Pruning runs
    at the start of a scheduled step, so that step already trains the new mask; at step
    ``t0 + n dt`` the global sparsity over all prunable weights is ``final_sparsity``.

    * Prunable weights: every ``nn.Linear`` inside the GPT blocks (not embeddings, final norm or
      head); ``layer_filter(index, layer) -> bool`` overrides the choice of layers. At ``setup``
      their Linears become :class:`~lightning_dynmo.dynamic.PrunableLinear` (same Parameters, a
      ``weight_mask`` buffer that migrates with its layer and is saved in checkpoints).
    * Threshold: :func:`~lightning_dynmo.dynamic.global_magnitude_threshold` over the local
      prunable weights, reduced over ``strategy.pipeline_group`` (exact k-th |w|, no weight
      gathering; identical on data-parallel replicas). Masks only shrink.
    * After pruning: pruned weights and their optimizer state (e.g. Adam moments) are zeroed, and
      masks are re-applied after every optimizer step (``on_train_batch_end``); the forward also
      multiplies by the mask, so pruned weights never contribute and get zero gradient.
    * Kernels (``sparse_kernels``): ``"auto"`` switches a layer to the CSR kernel of
      :mod:`lightning_dynmo.sparse` when its extension is available
      (``extension_available()``) and the measured crossover density
      (``crossover_density``, the measurement ``maybe_sparsify`` uses) says sparse is faster at
      the layer's density; ``True`` forces the kernel wherever the extension exists; ``False``
      keeps masked dense layers. Masked dense layers do **not** get cheaper: without sparse
      kernels pruning changes no per-layer cost and the rebalance requests find nothing to do.
    * Logs ``pruning/sparsity`` (global, measured), ``pruning/target_sparsity`` and
      ``pruning/density_L{i}`` per layer; calls ``strategy.request_rebalance("pruning: ...")``.
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
    ) -> None:
        for name, v in (("final_sparsity", final_sparsity), ("initial_sparsity", initial_sparsity)):
            if not 0.0 <= float(v) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {v}")
        if int(n_steps) < 1 or int(frequency) < 1 or int(start_step) < 0:
            raise ValueError("n_steps and frequency must be >= 1 and start_step >= 0")
        if sparse_kernels not in (True, False, "auto"):
            raise ValueError(f"sparse_kernels must be True, False or 'auto', got {sparse_kernels!r}")
        self.final_sparsity = float(final_sparsity)
        self.initial_sparsity = float(initial_sparsity)
        self.start_step = int(start_step)
        self.n_steps = int(n_steps)
        self.frequency = int(frequency)
        self.layer_filter = layer_filter
        self.sparse_kernels = sparse_kernels
        self.kernel_tokens = int(kernel_tokens)
        # state
        self.last_prune_step = -1
        self.target_sparsity = 0.0
        self.sparsity = 0.0
        self.history: list[dict] = []
        self._prunable: set[int] = set()

    # ------------------------------------------------------------------ schedule
    def sparsity_at(self, step: int) -> float:
        return cubic_sparsity(step, self.initial_sparsity, self.final_sparsity, self.start_step, self.n_steps,
                              self.frequency)

    def is_pruning_step(self, step: int) -> bool:
        off = step - self.start_step
        return 0 <= off <= self.n_steps * self.frequency and off % self.frequency == 0

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

    # ------------------------------------------------------------------ kernels
    def _choose_kernel(self, m: PrunableLinear) -> bool:
        if self.sparse_kernels is False or not sparse_kernels_available():
            return False
        density = m.density
        if density >= 1.0:
            return False
        if self.sparse_kernels is True:
            return True
        from ..sparse import crossover_density

        return density < crossover_density(m.in_features, m.out_features, self.kernel_tokens, m.weight.device)

    def _refresh_kernels(self, pl_module) -> None:
        if self.sparse_kernels is True and not sparse_kernels_available():
            warnings.warn("GradualPruning(sparse_kernels=True): the sparse extension is not available; "
                          "pruned layers stay masked dense (their cost does not drop)")
        for _, _, m in self._local_prunable(pl_module):
            want = self._choose_kernel(m)
            if want or m.sparse_kernel:
                m.set_sparse_kernel(want)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        # resumed masks came with the model's state dict; make weights and kernels follow them
        for _, _, m in self._local_prunable(pl_module):
            m.apply_mask()
        self._refresh_kernels(pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.is_pruning_step(step) and step != self.last_prune_step:
            self.prune(trainer, pl_module, self.sparsity_at(step))
            self.last_prune_step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.target_sparsity > 0:
            for _, _, m in self._local_prunable(pl_module):
                m.apply_mask()  # optimizers (momentum, weight decay) must not revive pruned weights

    @torch.no_grad()
    def prune(self, trainer, pl_module, sparsity: float) -> float:
        """Prune to global ``sparsity`` now (collective over the pipeline group); returns the
        measured global sparsity."""
        mods = self._local_prunable(pl_module)
        needs, group = pipeline_reduce_group(trainer)
        thr = global_magnitude_threshold([m.weight * m.weight_mask for _, _, m in mods], sparsity, group=group,
                                         distributed=needs)
        for _, _, m in mods:
            mask = m.weight_mask & ((m.weight * m.weight_mask).abs() > thr)
            m.set_mask(mask)
            for opt in trainer.optimizers:
                state = getattr(opt, "_optimizer", opt).state.get(m.weight)
                for v in (state or {}).values():
                    if torch.is_tensor(v) and v.shape == mask.shape:
                        v.mul_(mask)
        self._refresh_kernels(pl_module)
        self.target_sparsity = float(sparsity)
        dens = self.layer_densities(trainer, pl_module)
        kept, total = dens.pop("__kept__"), dens.pop("__total__")
        self.sparsity = 1.0 - kept / total if total else 0.0
        self.history.append({"step": int(trainer.global_step), "target": self.target_sparsity,
                             "sparsity": self.sparsity, "threshold": thr})
        pl_module.log("pruning/sparsity", self.sparsity, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("pruning/target_sparsity", self.target_sparsity, on_step=True, on_epoch=False, batch_size=1)
        for i, d in dens.items():
            pl_module.log(f"pruning/density_L{i}", d, on_step=True, on_epoch=False, batch_size=1)
        log.info("pruning: step %d target %.4f measured %.4f (threshold %.3g)", trainer.global_step, sparsity,
                 self.sparsity, thr)
        request_rebalance(trainer, f"pruning: global sparsity {self.sparsity:.3f}")
        return self.sparsity

    def layer_densities(self, trainer, pl_module) -> dict:
        """``{layer index: kept fraction}`` over the prunable layers (collective under a pipeline),
        plus ``__kept__``/``__total__`` counts."""
        L = len(pipeline_layers(pl_module))
        vec = torch.zeros(2 * L, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        for i, _, m in self._local_prunable(pl_module):
            vec[i] += float(m.weight_mask.sum())
            vec[L + i] += m.weight_mask.numel()
        vec = all_reduce_over_pipeline(trainer, vec).cpu().tolist()
        out: dict = {i: vec[i] / vec[L + i] for i in range(L) if vec[L + i] > 0}
        out["__kept__"], out["__total__"] = sum(vec[:L]), sum(vec[L:])
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"last_prune_step": self.last_prune_step, "target_sparsity": self.target_sparsity,
                "sparsity": self.sparsity, "history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_prune_step = int(state_dict.get("last_prune_step", -1))
        self.target_sparsity = float(state_dict.get("target_sparsity", 0.0))
        self.sparsity = float(state_dict.get("sparsity", 0.0))
        self.history = list(state_dict.get("history", []))
