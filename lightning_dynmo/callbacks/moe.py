"""``MoELoadMonitor``: logs expert load per MoE layer and asks a pipeline to rebalance when it shifts."""
from __future__ import annotations

from torch import nn

from ._pipeline_access import local_layers, pipeline_layers
from ..models.moe import has_moe_mlp
from ..protocol import RemoteLayer
from ._layer_monitor import LayerLoadMonitor


class MoELoadMonitor(LayerLoadMonitor):
    """Logs how each MoE layer (an :class:`~lightning_dynmo.models.MoEBlock`, or a block such as a
    :class:`~lightning_dynmo.models.MoDBlock` whose ``mlp`` is an :class:`~lightning_dynmo.models.MoELayer`)
    spreads tokens over its experts and
    requests a rebalance from a :class:`~lightning_dynmo.protocol.PipelineControl` strategy when
    the blocks' relative work shifts (:class:`LayerLoadMonitor`).

    The measurement window is one training step: the callback restarts the blocks' monitoring
    window (``reset_routing_stats``, separate from the strategy's ``reset_load``) when a step
    starts and reads it when the step ends. Only training forwards count (see ``MoEBlock``).

    Args:
        shift_threshold: request a rebalance when a block's relative work (as ``load_factor()``,
            1.0 = dropless) moved by more than this from its value at the last request; before the
            first request the baseline is 1.0, what the initial partition assumes.
        check_interval: measure every this many steps (one all-reduce of ``5 x num_layers``
            numbers over the pipeline group).

    Logs, per MoE layer ``i``, ``moe/max_over_mean_load_L{i}`` (tokens of the busiest expert over
    the mean) and ``moe/dropped_fraction_L{i}``; over all MoE layers ``moe/max_over_mean_load``
    (max), ``moe/dropped_fraction`` and ``moe/aux_loss`` (means; the unscaled load-balancing loss,
    1.0 = uniform routing).
    """

    prefix = "moe"
    fields = ("load", "max_over_mean", "dropped", "balance_loss")
    tracked = "load"
    tracked_name = "relative work"

    def monitored(self, pl_module) -> list[tuple[int, nn.Module]]:
        return [(i, layer) for i, layer in local_layers(pl_module) if has_moe_mlp(layer)]

    def setup(self, trainer, pl_module, stage: str) -> None:
        layers = pipeline_layers(pl_module) or []
        if not any(has_moe_mlp(layer) or isinstance(layer, RemoteLayer) for layer in layers):
            raise TypeError(
                f"MoELoadMonitor needs a model whose pipeline layers include MoE layers "
                f"(e.g. lightning_dynmo.models.MoEGPT, or MoDGPT with moe=...), got {type(pl_module).__name__}"
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for _, block in self.monitored(pl_module):
            block.mlp.reset_routing_stats()

    def layer_values(self, block: nn.Module) -> tuple[float, ...] | None:
        stats = block.mlp.routing_stats()
        if stats is None:
            return None
        counts = stats.expert_counts.double()
        return stats.relative_work, float(counts.max() / counts.mean()), stats.dropped_fraction, stats.balance_loss

    def log_stats(self, pl_module, stats: dict[int, dict[str, float]]) -> None:
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        for i, s in stats.items():
            pl_module.log(f"moe/max_over_mean_load_L{i}", s["max_over_mean"], **log)
            pl_module.log(f"moe/dropped_fraction_L{i}", s["dropped"], **log)
        pl_module.log("moe/max_over_mean_load", max(s["max_over_mean"] for s in stats.values()), **log)
        pl_module.log("moe/dropped_fraction", sum(s["dropped"] for s in stats.values()) / len(stats), **log)
        pl_module.log("moe/aux_loss", sum(s["balance_loss"] for s in stats.values()) / len(stats), **log)

