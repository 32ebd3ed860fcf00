"""Process launchers: Lightning's own, plus a spawn launcher that returns the whole model."""
from __future__ import annotations

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher


class PipelineSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher hands rank 0's ``state_dict`` back to the main process; on a
    pipeline rank 0 owns only its own layers, so hand back the gathered full model instead."""

    def _collect_rank_zero_results(self, trainer, results):
        module = trainer.lightning_module
        full = self._strategy.lightning_module_state_dict()  # collective: every rank calls it
        original = module.state_dict
        module.state_dict = lambda *a, **k: full  # what the parent class saves for the main process
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            module.state_dict = original
