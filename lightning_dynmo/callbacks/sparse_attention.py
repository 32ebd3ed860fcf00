"""``SparseAttentionMonitor``: logs the block density of each hash-sparse attention layer and asks
a pipeline to rebalance when the per-layer density profile shifts."""
from __future__ import annotations

from ._pipeline_access import pipeline_layers
from ..models.gpt.hash_attention import SparseAttentionLoad
from ..protocol import RemoteLayer
from ._layer_monitor import LayerLoadMonitor


class SparseAttentionMonitor(LayerLoadMonitor):
    """Watches the :class:`~lightning_dynmo.models.SparseAttentionBlock` layers of a GPT built with
    ``attention="hash_sparse"`` (for some or all blocks) and requests a rebalance from a
    :class:`~lightning_dynmo.protocol.PipelineControl` strategy when a layer's block density
    (computed / dense causal block pairs) moved by more than ``shift_threshold`` since the last
    request (:class:`LayerLoadMonitor`). How many block pairs survive the hash bucketing depends on
    the keys, so it drifts as the model trains (and every step with ``hash_redraw``).

    The window is one training step (``reset_density_stats`` when it starts, separate from the
    strategy's ``reset_load``); only training forwards count.

    Args:
        shift_threshold: absolute change of a layer's block density that triggers a request;
            before the first request the baseline is 1.0 (dense attention, what a partition made
            without knowing the sparsity assumes).
        check_interval: measure every this many steps (one all-reduce of ``3 x num_layers``
            numbers over the pipeline group).

    Logs, per hash-sparse layer ``i`` (global pipeline index, every rank after the reduction),
    ``attn/block_density_L{i}`` and ``attn/load_L{i}`` (the block's work relative to the same
    block with dense attention, what the strategy's cost model uses); over those layers
    ``attn/block_density`` (mean) and ``attn/block_density_spread`` (max - min).
    """

    prefix = "attn"
    fields = ("density", "load")
    tracked = "density"
    tracked_name = "block density"

    def monitored(self, pl_module) -> list[tuple[int, SparseAttentionLoad]]:
        # a SparseAttentionBlock, or its attention half at sublayer granularity
        return self.local_layers(pl_module, SparseAttentionLoad)

    def setup(self, trainer, pl_module, stage: str) -> None:
        layers = pipeline_layers(pl_module) or []
        if not any(isinstance(layer, (SparseAttentionLoad, RemoteLayer)) for layer in layers):
            raise TypeError(
                "SparseAttentionMonitor needs a model whose pipeline layers include SparseAttentionBlock layers: "
                f"build the GPT with attention='hash_sparse' (or a per-layer tuple); got {type(pl_module).__name__} "
                "with dense attention only"
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for _, block in self.monitored(pl_module):
            block.reset_density_stats()

    def layer_values(self, block: SparseAttentionLoad) -> tuple[float, float] | None:
        density = block.density_stats()
        return None if density is None else (density, block.relative_work(density))

    def log_stats(self, pl_module, stats: dict[int, dict[str, float]]) -> None:
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        for i, s in stats.items():
            pl_module.log(f"attn/block_density_L{i}", s["density"], **log)
            pl_module.log(f"attn/load_L{i}", s["load"], **log)
        densities = [s["density"] for s in stats.values()]
        pl_module.log("attn/block_density", sum(densities) / len(densities), **log)
        pl_module.log("attn/block_density_spread", max(densities) - min(densities), **log)
