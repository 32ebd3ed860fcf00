"""recipes/cli_gpt.py (LightningCLI) end to end: the strategy and its options from flags, 2 CPU ranks
started the Lightning way (the script re-run for rank 1), the same losses as one process."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.multiproc import user_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "recipes" / "cli_gpt.py"
STEPS = 2
COMMON = ["--seed_everything=7", "--trainer.accelerator=cpu", f"--trainer.max_steps={STEPS}",
          "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
          "--trainer.enable_checkpointing=false", "--trainer.enable_model_summary=false",
          "--trainer.log_every_n_steps=1", "--model.config=tiny", "--data.block_size=32", "--data.batch_size=8",
          "--trainer.logger=lightning.pytorch.loggers.CSVLogger"]
PIPELINE = ["--trainer.devices=2", "--trainer.strategy=lightning_dynmo.DynMoStrategy",
            "--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.schedule=gpipe",
            "--trainer.strategy.plot=false"]


def _fit(args: list[str], save_dir: Path) -> tuple[list[float], Path]:
    env = user_env()
    proc = subprocess.run([sys.executable, str(SCRIPT), "fit", *COMMON, *args, f"--trainer.logger.save_dir={save_dir}"],
                          cwd=save_dir.parent, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"`max_steps={STEPS}` reached" in out, out[-6000:]
    run = save_dir / "lightning_logs" / "version_0"
    with (run / "metrics.csv").open() as f:
        losses = [float(r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]
    assert len(losses) == STEPS, losses
    return losses, run


@pytest.mark.slow
def test_cli_recipe_fits_on_two_pipeline_ranks_like_one_process(tmp_path):
    piped, run = _fit(PIPELINE, tmp_path / "pipeline")
    single, _ = _fit(["--trainer.devices=1"], tmp_path / "single")
    assert piped == pytest.approx(single, rel=1e-5, abs=1e-6)
    strategy = yaml.safe_load((run / "config.yaml").read_text())["trainer"]["strategy"]  # LightningCLI's record
    assert strategy["class_path"] == "lightning_dynmo.DynMoStrategy"
    assert strategy["init_args"]["pipeline_parallel"] == 2 and strategy["init_args"]["schedule"] == "gpipe"
