"""The checkpoint hooks of :class:`~lightning_dynmo.strategy.strategy.DynMoStrategy`: which format
a checkpoint has, which ranks write it and what each rank reads back. The state itself is gathered
and scattered by :mod:`~lightning_dynmo.strategy.checkpoint` (one file on rank 0, any partition can
load it) and :mod:`~lightning_dynmo.strategy.dcp_checkpoint` (every rank its own layers); this mixin
only routes Lightning's calls to them."""
from __future__ import annotations

from typing import Any

from typing_extensions import override

from . import checkpoint, dcp_checkpoint
from .collectives import explain_timeout
from .options import CheckpointFormat

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """Lightning's checkpoint hooks for a strategy that has ``options``, ``_pipe()``, ``agree`` and
    Lightning's ``broadcast``/``checkpoint_io``/``global_rank`` (mixed in before ``ParallelStrategy``)."""

    @property
    def _dcp(self) -> bool:
        """Saving writes a DCP directory, every rank its own layers (strategy/dcp_checkpoint.py)."""
        return self.options.checkpoint_format is CheckpointFormat.DCP

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint safely (``weights_only=True`` unless the caller passes ``False``), refusing
        files that are not checkpoints and NaN/Inf tensors; every rank reads and checks the file. A DCP
        directory (either ``checkpoint_format``) is read by every rank for its own layers only."""
        if dcp_checkpoint.is_dcp_checkpoint(checkpoint_path):
            with explain_timeout(dcp_checkpoint.LOAD_ON_EVERY_RANK):
                return dcp_checkpoint.load(self._pipe(), checkpoint_path, weights_only,
                                           self.lightning_module.strict_loading)
        return checkpoint.read_checkpoint(self.checkpoint_io, checkpoint_path, weights_only)

    @override
    def save_checkpoint(self, checkpoint_dict: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """``checkpoint_format="dcp"``: every rank writes its part of ``filepath`` (a directory);
        ``"single"``: rank 0 writes the gathered file."""
        if not self._dcp:
            return super().save_checkpoint(checkpoint_dict, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("checkpoint_format='dcp' writes with torch.distributed.checkpoint, not the CheckpointIO: "
                            "storage_options is not supported")
        with explain_timeout(checkpoint.SAVE_ON_EVERY_RANK):
            dcp_checkpoint.save(checkpoint_dict, self.broadcast(filepath), self.global_rank)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state dict (global layer indices) on rank 0, empty elsewhere; under
        ``checkpoint_format="dcp"`` this rank's layers, on every rank."""
        self.agree("save_checkpoint (model state)")
        if self._dcp:
            return dcp_checkpoint.local_model_state(self._pipe())
        return checkpoint.full_model_state_dict(self._pipe())

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The optimizer state in single-process format (any partition can load it), on rank 0; under
        ``checkpoint_format="dcp"`` this rank's parameters' state keyed by name, on every rank."""
        self.agree("save_checkpoint (optimizer state)")
        if self._dcp:
            return dcp_checkpoint.local_optimizer_state(self._pipe(), optimizer)
        return checkpoint.full_optimizer_state(self._pipe(), optimizer)

    @override
    def load_model_state_dict(self, checkpoint_dict, strict: bool = True) -> None:
        checkpoint.load_local_model_state(self._pipe(), checkpoint_dict, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint_dict) -> None:
        checkpoint.load_local_optimizer_state(self._pipe(), checkpoint_dict)
