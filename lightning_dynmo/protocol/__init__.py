"""The contract between models and the pipeline: both sides import it, neither imports the other.

* :mod:`.module`: what a LightningModule exposes (``pipeline_layers``, ``pipeline_loss`` ...),
  :class:`RemoteLayer`, :class:`ReportsLoad`, :class:`PipelineControl`;
* :mod:`.activations`: how a pipeline layer is called (one tensor or a fixed-arity tuple,
  pass-through of what it does not take), :func:`run_layers` for a single process;
* :mod:`.merges`: checkpoint names of parameters kept in pieces (``checkpoint_merges()``);
* :mod:`.layer_init`: per-layer initialisation of a model built on the meta device;
* :mod:`.services`: what a layer may ask of the runtime while it runs (recompute flag, expert
  dispatch, grad scaler), which the runtime provides.
"""
from .activations import run_layers
from .layer_init import InitializesPipelineLayers, MaterializationError, layer_seed, materialize_layer
from .module import (
    PipelineControl,
    PipelineProtocolError,
    RemoteLayer,
    ReportsLoad,
    layers_attribute_name,
    pipeline_layers_of,
    split_batch,
    state_dict_key,
)
from .services import DispatchesExperts, ExpertShard, ShardsExperts, expert_dispatch, is_recomputing

__all__ = [
    "DispatchesExperts",
    "ExpertShard",
    "InitializesPipelineLayers",
    "MaterializationError",
    "PipelineControl",
    "PipelineProtocolError",
    "RemoteLayer",
    "ReportsLoad",
    "ShardsExperts",
    "expert_dispatch",
    "is_recomputing",
    "layer_seed",
    "layers_attribute_name",
    "materialize_layer",
    "pipeline_layers_of",
    "run_layers",
    "split_batch",
    "state_dict_key",
]
