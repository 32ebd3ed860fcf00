"""Do hash buckets stay balanced while a hash-sparse GPT trains? Per-layer block density per step
for each ``hash_center`` mode.

Angular LSH puts a token in the bucket its key points to. Training grows a direction that all
keys share, so raw keys drift into one bucket and the block density of an ``nb_hash``-bucket
layer climbs from about ``1 / nb_hash`` towards 1 (the sparse layer then does dense work).
``hash_center="causal"`` hashes each key minus the running mean of the keys at positions <= t.

Setup (not tuned to the result): the model of ``benchmarks/dynamism_cases/sparse_attention.py``
(8 hash-sparse blocks, nb_hash 1, 1, 2, 2, 4, 4, 8, 8, rotations redrawn every step, 2048
tokens), one process, AdamW (lr 6e-4, 2 warm-up steps, betas 0.9/0.95, weight decay 0.1), the
same seed, weights and batches for every mode; batches are random tokens (what the dynamism
benchmark trains on) or the standard library's help text (``--data text``). ``balanced`` is the
density the layout would have with equal buckets. Prints one JSON object as the last line.

    python benchmarks/hash_bucket_balance.py [--quick] [--data random|text] [--centers none causal]
    python benchmarks/hash_bucket_balance.py --smoke     # seconds: 2 steps of batch 1, 512 tokens
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dynamism_cases.sparse_attention import MODEL
from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.models.gpt import SparseAttentionBlock, set_hash_step
from lightning_dynmo.sparse.hash_layout import HASH_CENTERS, hash_sort_plan

#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("data", "steps", "batch", "seq", "block", "nb_hash", "balanced", "runs")


def batches(kind: str, n: int, batch: int, t: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return [torch.randint(0, 256, (batch, t + 1), generator=g) for _ in range(n)]
    from lightning_dynmo.data.text import default_text_bytes

    data = torch.frombuffer(bytearray(default_text_bytes()), dtype=torch.uint8).long()
    starts = torch.randint(0, data.numel() - t - 1, (n, batch), generator=g)
    return [torch.stack([data[s:s + t + 1] for s in row.tolist()]) for row in starts]


def balanced_density(t: int, nb: int, bs: int) -> float:
    """Density of the layout when every bucket holds an equal share of the tokens."""
    buckets = (torch.arange(t) * nb // t).view(1, 1, t)
    return hash_sort_plan(buckets, nb, bs).density


def train(center: str, data: list[torch.Tensor], model_cfg: dict) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_cfg, hash_center=center), seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    blocks = [m for m in model.layers if isinstance(m, SparseAttentionBlock)]
    density, losses = [[] for _ in blocks], []
    t0 = time.perf_counter()
    for step, xy in enumerate(data):
        for g in opt.param_groups:
            g["lr"] = 6e-4 * min(1.0, (step + 1) / 2)
        set_hash_step(model, step)
        opt.zero_grad(set_to_none=True)
        loss = model.pipeline_loss(model(xy[:, :-1]), xy[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        for i, b in enumerate(blocks):
            density[i].append(round(b.attn.last_density, 3))
    tail = max(1, len(data) // 5)
    return {"density_per_step": density,
            "density_first": [d[0] for d in density],
            "density_last_mean": [round(sum(d[-tail:]) / tail, 3) for d in density],
            "loss_first": round(losses[0], 4), "loss_last_mean": round(sum(losses[-tail:]) / tail, 4),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 steps, batch 2 (default: 60 steps, batch 4)")
    ap.add_argument("--data", choices=("random", "text"), default="random")
    ap.add_argument("--centers", nargs="+", choices=HASH_CENTERS, default=["none", "causal"])
    ap.add_argument("--smoke", action="store_true",
                    help="2 steps of batch 1 on 512 tokens (8 attention blocks): checks that the script runs")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steps = args.steps or (2 if args.smoke else 30 if args.quick else 60)
    batch = args.batch or (1 if args.smoke else 2 if args.quick else 4)
    model = dict(MODEL, block_size=512) if args.smoke else MODEL
    t, bs = model["block_size"], model["attention_block"]
    data = batches(args.data, steps, batch, t)
    nbs = list(model["nb_hash"])
    runs = {c: train(c, data, model) for c in args.centers}
    for c, r in runs.items():
        print(f"{c:>10}: first {r['density_first']}  last {r['density_last_mean']}  loss {r['loss_last_mean']}",
              file=sys.stderr)
    print(json.dumps({"smoke": args.smoke, "data": args.data, "steps": steps, "batch": batch, "seq": t, "block": bs,
                      "nb_hash": nbs,
                      "balanced": [round(balanced_density(t, nb, bs), 3) for nb in nbs], "runs": runs}))


if __name__ == "__main__":
    main()
