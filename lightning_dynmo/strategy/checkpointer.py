"""Which format a checkpoint has and which ranks write it, chosen once from ``checkpoint_format``.

The state itself is gathered and scattered by :mod:`~lightning_dynmo.strategy.checkpoint` (one
file on rank 0; any partition can load it) and :mod:`~lightning_dynmo.strategy.dcp_checkpoint`
(every rank its own layers). Reading needs no choice: a DCP directory is recognised whatever
``checkpoint_format`` says, so :func:`read` serves both.
"""
from __future__ import annotations

from typing import Any

from . import checkpoint, dcp_checkpoint
from .collectives import explain_timeout
from .options import CheckpointFormat
from .state import RankPipeline

__all__ = ["Checkpointer", "DcpCheckpointer", "SingleFileCheckpointer", "checkpointer_for", "read"]


class Checkpointer:
    """What a format decides at save time: the state each rank contributes, and who writes."""

    def model_state(self, pipe: RankPipeline) -> dict[str, Any]:
        raise NotImplementedError

    def optimizer_state(self, pipe: RankPipeline, optimizer) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, strategy, checkpoint_dict: dict[str, Any], filepath, storage_options: Any | None) -> None:
        raise NotImplementedError


class SingleFileCheckpointer(Checkpointer):
    """The whole model in single-process format (global layer indices), written by rank 0 through
    the strategy's ``CheckpointIO``; the other ranks contribute their layers and write nothing."""

    def model_state(self, pipe: RankPipeline) -> dict[str, Any]:
        return checkpoint.full_model_state_dict(pipe)

    def optimizer_state(self, pipe: RankPipeline, optimizer) -> dict[str, Any]:
        return checkpoint.full_optimizer_state(pipe, optimizer)

    def save(self, strategy, checkpoint_dict: dict[str, Any], filepath, storage_options: Any | None) -> None:
        if strategy.is_global_zero:
            strategy.checkpoint_io.save_checkpoint(checkpoint_dict, filepath, storage_options=storage_options)


class DcpCheckpointer(Checkpointer):
    """A ``torch.distributed.checkpoint`` directory: every rank writes its own layers' state,
    keyed by name, so no rank ever holds the whole model."""

    def model_state(self, pipe: RankPipeline) -> dict[str, Any]:
        return dcp_checkpoint.local_model_state(pipe)

    def optimizer_state(self, pipe: RankPipeline, optimizer) -> dict[str, Any]:
        return dcp_checkpoint.local_optimizer_state(pipe, optimizer)

    def save(self, strategy, checkpoint_dict: dict[str, Any], filepath, storage_options: Any | None) -> None:
        if storage_options is not None:
            raise TypeError("checkpoint_format='dcp' writes with torch.distributed.checkpoint, not the CheckpointIO: "
                            "storage_options is not supported")
        with explain_timeout(checkpoint.SAVE_ON_EVERY_RANK):
            dcp_checkpoint.save(checkpoint_dict, strategy.broadcast(filepath), strategy.global_rank)


def checkpointer_for(fmt: CheckpointFormat) -> Checkpointer:
    return DcpCheckpointer() if fmt is CheckpointFormat.DCP else SingleFileCheckpointer()


def read(pipeline, checkpoint_io, checkpoint_path, weights_only: bool | None) -> dict[str, Any]:
    """Read a checkpoint safely (``weights_only=True`` unless the caller passes ``False``), refusing
    files that are not checkpoints and NaN/Inf tensors; every rank reads and checks the file. A DCP
    directory (either ``checkpoint_format``) is read by every rank for its own layers only."""
    if dcp_checkpoint.is_dcp_checkpoint(checkpoint_path):
        with explain_timeout(dcp_checkpoint.LOAD_ON_EVERY_RANK):
            return dcp_checkpoint.load(pipeline.snapshot(), checkpoint_path, weights_only,
                                       pipeline.lightning_module.strict_loading)
    return checkpoint.read_checkpoint(checkpoint_io, checkpoint_path, weights_only)
