"""One GPU, one process: ``checkpoint_format="dcp"`` with CUDA tensors and the NCCL process group.

    python scripts/gpu_dcp_check.py

Why: the CPU suite saves and loads DCP directories from CPU tensors over gloo only. Here a tiny
GPT trains 4 steps uninterrupted, then 2 steps saving a DCP checkpoint and 2 more resumed from it
(CUDA weights and Adam state written by DCP, read back into CUDA parameters), and the directory is
consolidated into a single file. fp32, so the resumed losses must equal the uninterrupted ones to
1e-5. Last line: one JSON object; exit 1 when a check fails. Without CUDA it runs on the CPU (gloo),
which checks the script, not the GPU path.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo import DynMoStrategy, consolidate_checkpoint
from lightning_dynmo.models import GPT, GPTConfig


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def fit(root: Path, steps: int, ckpt_dir: Path | None = None, resume=None) -> list[float]:
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=64, dropout=0.0, bias=False)
    model = GPT(cfg, lr=3e-3, warmup_steps=2, max_steps=20, seed=0)
    data = torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous()), batch_size=16,
                        drop_last=True)  # 2 steps per epoch: the checkpoint at step 2 closes epoch 0
    rec = Losses()
    callbacks: list = [rec]
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True,
                                                             every_n_train_steps=steps))
    trainer = L.Trainer(strategy=DynMoStrategy(pipeline_parallel=1, microbatches=2, checkpoint_format="dcp"),
                        accelerator="cuda" if torch.cuda.is_available() else "cpu", devices=1, max_steps=steps,
                        logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks, default_root_dir=root)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=resume)
    return rec.losses


def main() -> int:
    t0 = time.perf_counter()
    res: dict = {"check": "gpu_dcp", "cuda": torch.cuda.is_available(),
                 "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            full = fit(tmp / "full", 4)
            first = fit(tmp / "first", 2, ckpt_dir=tmp / "ck")
            last = tmp / "ck" / "last.ckpt"
            res["saved_dir"] = last.is_dir() and (last / "meta.pt").is_file()
            second = fit(tmp / "second", 4, resume=last)
            ckpt = consolidate_checkpoint(last, tmp / "single.ckpt")
            res.update(full=full, first=first, resumed=second, consolidated_step=ckpt["global_step"],
                       consolidated_devices=sorted({str(v.device) for v in ckpt["state_dict"].values()}))
        res["ok"] = (res["saved_dir"] and first == full[:2] and len(second) == 2 and res["consolidated_step"] == 2
                     and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(second, full[2:])))
    except Exception as exc:  # noqa: BLE001 - reported in the JSON line, and the exit code says it failed
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
