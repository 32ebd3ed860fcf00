"""``trainer.predict`` through the pipeline.

Each predict batch runs forward only, without a loss, over the pipeline's stages; the rank
holding the last stage gets the last layer's output for the whole batch (micro-batches merged
along dim 0). The module's own ``predict_step`` cannot run there (its layers are split over the
ranks), so an optional hook takes its place, called on that rank only::

    def pipeline_predict(self, output, batch, batch_idx, dataloader_idx=0):  # optional
        return output.argmax(-1)  # what predict_step would return for ``self(inputs)``

(``dataloader_idx`` is passed only with several predict loaders, as Lightning does for
``predict_step``). Without the hook a batch's prediction is the last layer's output. The
prediction (moved to the CPU, where Lightning keeps predictions anyway) is then sent to every
rank of that pipeline, so ``trainer.predict`` returns the same list on each of them.

What each rank returns is what Lightning's DDP returns: the predictions of the batches its
data-parallel replica loaded. With one replica that is every batch, in loader order (the same
list as one process); with ``dp`` replicas Lightning's predict sampler deals replica ``r`` the
samples ``r, r + dp, ...`` without padding (so replicas may run different batch counts: the
collectives here stay inside each pipeline). A rank that re-packing released holds no layers
and returns ``None`` per batch.

Batches are ``inputs``, ``(inputs,)`` or ``(inputs, targets)``; ``pipeline_inputs(inputs,
targets)``, where defined, gets ``targets=None`` when the batch has none. A problem on any
stage, or a hook that raises, is raised on every rank of the pipeline (never a hang).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..runtime.engine import raise_step_problem
from ..runtime.groups import group_ranks

_warned: set[type] = set()  # module classes already told that their predict_step is not called


def predict_inputs(batch) -> torch.Tensor:
    """The inputs of a predict batch: the tensor itself, or the first entry of ``(inputs,)`` /
    ``(inputs, targets)``."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) in (1, 2) and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise TypeError(
        f"the 'dynmo' pipeline predicts on batches of inputs, (inputs,) or (inputs, targets) with a tensor of "
        f"inputs, got {type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def skipped_predict_step_warning(module) -> str | None:
    """The warning to give when the module defines its own ``predict_step`` but no
    ``pipeline_predict``: under the pipeline that ``predict_step`` is not called."""
    import lightning as L

    step = getattr(type(module), "predict_step", None)
    if step is None or step is L.LightningModule.predict_step or callable(getattr(module, "pipeline_predict", None)):
        return None
    return (f"{type(module).__name__}.predict_step is not called under DynMoStrategy (its layers are split over the "
            "pipeline's ranks): each prediction is the last pipeline layer's output. Define "
            "`def pipeline_predict(self, output, batch, batch_idx)` to turn that output into what predict_step "
            "returns (it runs on the last stage's rank; defining it also silences this warning)")


def _apply_hook(module, output, batch, step_args: tuple) -> tuple[Exception | None, Any]:
    """``(error, prediction)`` of the module's ``pipeline_predict`` hook (or the output itself)."""
    hook = getattr(module, "pipeline_predict", None)
    if not callable(hook):
        return None, output
    try:
        return None, hook(output, batch, *step_args)
    except Exception as err:  # noqa: BLE001 - raised on every rank of the pipeline below
        return err, None


def predict_batch(pipeline, plugin, batch, *step_args: Any):
    """One predict batch (``step_args``: ``batch_idx`` and, with several loaders,
    ``dataloader_idx``); returns the prediction on every rank of this pipeline."""
    s = pipeline
    module = s.lightning_module
    if s.released:
        return None
    if type(module) not in _warned:
        _warned.add(type(module))
        message = skipped_predict_step_warning(module)
        if message:
            rank_zero_warn(message)
    inputs = predict_inputs(batch)
    with plugin.predict_step_context():
        engine = s.engine_for(inputs, None, plugin, train=False, predict=True)
        output, problem = engine.predict(inputs), engine.problem
    flag = torch.tensor([0.0 if problem is None else 1.0], device=s.root_device)
    if s.layout.pp_size > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=s.pipeline_group)
    raise_step_problem(problem, bool(flag.item() > 0), s.pipeline_group)
    payload: list = [None]
    cause = None
    if engine.has_last:
        cause, prediction = _apply_hook(module, output, batch, step_args)
        error = f"{type(module).__name__}.pipeline_predict raised {type(cause).__name__}: {cause}" if cause else None
        payload = [(error, move_data_to_device(prediction, torch.device("cpu")) if cause is None else None)]
    if s.layout.pp_size > 1:
        last = s.layout.rank_of_stage(s.layout.num_stages - 1)
        dist.broadcast_object_list(payload, src=group_ranks(s.pipeline_group)[last], group=s.pipeline_group,
                                   device=s.root_device if s.root_device.type == "cuda" else None)
    error, prediction = payload[0]
    if error is not None:
        raise RuntimeError(error) from cause
    return prediction
