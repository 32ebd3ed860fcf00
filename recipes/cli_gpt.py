"""Train the byte-level GPT with Lightning's own command line (``LightningCLI``): every Trainer,
model, data and ``DynMoStrategy`` argument is a flag, or a key of a YAML file given as ``--config``.

    python recipes/cli_gpt.py fit --trainer.accelerator=cpu --trainer.devices=2 \\
        --trainer.strategy=lightning_dynmo.DynMoStrategy --trainer.strategy.pipeline_parallel=2 \\
        --trainer.strategy.schedule=gpipe --trainer.max_steps=20
    python recipes/cli_gpt.py fit --trainer.strategy.help lightning_dynmo.DynMoStrategy  # the options
    python recipes/cli_gpt.py fit --print_config [flags...] > run.yaml  # then: fit --config run.yaml

Needs ``pip install -e ".[cli]"`` (jsonargparse). ``--trainer.strategy=dynmo`` picks the strategy
at its defaults; naming the class lets ``--trainer.strategy.<option>`` set any option. Lightning
starts ranks > 0 by re-running this script with the same flags. The Hydra recipe
(``recipes/train_gpt.py``) adds run directories, a summary, dynamism configs and resuming.
"""
from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_dynmo  # noqa: F401  (registers strategy="dynmo")
from lightning_dynmo.data import ByteTextDataModule
from lightning_dynmo.models import GPT


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(GPT, ByteTextDataModule, args=args)


if __name__ == "__main__":
    main()
