"""Lightning callbacks that make a model dynamic and ask the strategy to rebalance.

Each works under plain single-process (or DDP) Lightning too: ``request_rebalance`` and
``invalidate_pipeline`` are only called when the trainer's strategy has them, and per-layer
quantities are reduced over ``strategy.pipeline.pipeline_group`` only under a pipeline strategy.
"""
from .early_exit import EarlyExit
from .freezing import LayerFreezing
from .mod import MixtureOfDepths
from .moe import MoELoadMonitor
from .pruning import GradualPruning
from .sparse_attention import SparseAttentionMonitor

__all__ = ["EarlyExit", "GradualPruning", "LayerFreezing", "MixtureOfDepths", "MoELoadMonitor",
           "SparseAttentionMonitor"]
