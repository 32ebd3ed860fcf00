"""Mixture of Experts on the GPT: ``config`` (settings), ``router`` (top-k routing and its
losses), ``experts`` (grouped SwiGLU experts, shardable for expert parallelism), ``load``
(routing counters the strategy reads every step) and ``model`` (the layer, block, half and
:class:`MoEGPT`)."""
from .config import MoEConfig
from .experts import GroupedExperts, SwiGLU
from .load import MoELoad, RoutingCounts, RoutingStats, routed_tokens
from .model import MoEBlock, MoEGPT, MoEHalf, MoELayer, has_moe_mlp, install_moe, moe_block_ids
from .router import Routing, TopKRouter, load_balancing_loss, router_z_loss

__all__ = [
    "GroupedExperts",
    "MoEBlock",
    "MoEConfig",
    "MoEGPT",
    "MoEHalf",
    "MoELayer",
    "MoELoad",
    "Routing",
    "RoutingCounts",
    "RoutingStats",
    "SwiGLU",
    "TopKRouter",
    "has_moe_mlp",
    "install_moe",
    "load_balancing_loss",
    "moe_block_ids",
    "routed_tokens",
    "router_z_loss",
]
