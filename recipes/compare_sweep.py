"""Collect a Hydra sweep of ``recipes/train_gpt.py`` into one comparison table (Markdown) and plot (PNG).

    python recipes/train_gpt.py -m experiment=freezing strategy.balancer=uniform,param,partition_time,diffusion_time
    python recipes/compare_sweep.py multirun/train_gpt/<date>/<time>        # writes comparison.md / .png there
    python recipes/compare_sweep.py SWEEP_DIR --out report/ --baseline strategy.balancer=uniform

Every job directory under SWEEP_DIR that holds a ``summary.json`` is one row. The columns are the
overrides that differ between jobs (read from each job's ``.hydra/overrides.yaml``), then
tokens/s, the speedup over the baseline row (default: the first row whose balancer is
``uniform`` or ``param``, else the first row; rows are grouped by the other varying overrides,
so ``-m dynamism=a,b strategy.balancer=x,y`` compares balancers within each dynamism), train/val
loss, the final partition and the rebalances applied. The PNG shows tokens/s per row. The last
line printed is one JSON object (the rows).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

STATIC = ("uniform", "param")


def _overrides(job: Path) -> dict[str, str]:
    f = job / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return {}
    out = {}
    for line in f.read_text().splitlines():
        line = line.strip()
        if line.startswith("- "):
            key, _, val = line[2:].strip().strip("'\"").partition("=")
            out[key.lstrip("+~")] = val
    return out


def collect(sweep: Path) -> list[dict]:
    rows = []
    for path in sorted(sweep.rglob("summary.json"), key=lambda p: [int(x) if x.isdigit() else x for x in p.parts]):
        job = path.parent
        try:
            s = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        rows.append({"job": str(job.relative_to(sweep)), "overrides": _overrides(job), "summary": s})
    return rows


def table(rows: list[dict], baseline: str | None = None) -> tuple[list[str], list[dict]]:
    keys = sorted({k for r in rows for k in r["overrides"]})
    varying = [k for k in keys if len({r["overrides"].get(k) for r in rows}) > 1]
    group_keys = [k for k in varying if k != "strategy.balancer"]
    out = []
    for r in rows:
        s, o = r["summary"], r["overrides"]
        out.append({
            "job": r["job"], **{k: o.get(k, "") for k in varying},
            "tokens_per_sec": s.get("tokens_per_sec_mean"),
            "train_loss": s.get("train_loss"), "val_loss": s.get("val_loss"),
            "partition": s.get("partition"), "initial_partition": s.get("initial_partition"),
            "rebalances_applied": s.get("rebalances_applied"), "steps": s.get("steps"),
            "_group": tuple(o.get(k, "") for k in group_keys),
            "_balancer": o.get("strategy.balancer", ""),
        })
    bkey, _, bval = (baseline or "").partition("=")
    for group in dict.fromkeys(r["_group"] for r in out):
        members = [r for r in out if r["_group"] == group]
        if baseline:
            base = next((r for r in members if r.get(bkey) == bval), None)
        else:
            base = next((r for r in members if r["_balancer"] in STATIC), members[0])
        for r in members:
            ok = base and r["tokens_per_sec"] and base["tokens_per_sec"]
            r["speedup"] = r["tokens_per_sec"] / base["tokens_per_sec"] if ok else None
            r["baseline"] = base["job"] if base else None
    return varying, out


def _fmt(v, spec):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def markdown(sweep: Path, varying: list[str], rows: list[dict]) -> str:
    head = ["job", *varying, "tokens/s", "speedup", "train loss", "val loss", "partition (initial -> final)",
            "rebalances"]
    lines = [f"# Sweep comparison: `{sweep}`", "",
             "tokens/s: the strategy's mean over all steps of a run (profiled steps and migrations included); "
             "speedup: over the row named in `baseline` (a static balancer of the same group).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["job"], *(str(r[k]) for k in varying), _fmt(r["tokens_per_sec"], ",.0f"),
            (_fmt(r["speedup"], ".3f") + "x") if r["speedup"] is not None else "n/a",
            _fmt(r["train_loss"], ".4f"), _fmt(r["val_loss"], ".4f"),
            f"{r['initial_partition']} -> {r['partition']}".replace("|", "\\|"), _fmt(r["rebalances_applied"], "d"),
        ]) + " |")
    return "\n".join(lines) + "\n"


def plot(varying: list[str], rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [", ".join(f"{k.split('.')[-1]}={r[k]}" for k in varying) or r["job"] for r in rows]
    values = [r["tokens_per_sec"] or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.2))
    bars = ax.bar(range(len(rows)), values, color=["#999999" if r["_balancer"] in STATIC else "#1f77b4" for r in rows])
    for b, r in zip(bars, rows):
        if r["speedup"] is not None:
            ax.annotate(f"{r['speedup']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tokens/s (mean over the run)")
    ax.set_title("sweep comparison (grey: static balancers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="the sweep directory (hydra.sweep.dir) holding one sub-directory per job")
    ap.add_argument("--out", default=None, help="where comparison.md / comparison.png go (default: the sweep dir)")
    ap.add_argument("--baseline", default=None, help="key=value picking each group's baseline row, e.g. "
                                                     "strategy.balancer=param")
    args = ap.parse_args(argv)
    sweep = Path(args.sweep)
    rows = collect(sweep)
    if not rows:
        sys.exit(f"no summary.json under {sweep}: is it a train_gpt sweep directory (hydra.sweep.dir)?")
    varying, out = table(rows, args.baseline)
    dest = Path(args.out) if args.out else sweep
    dest.mkdir(parents=True, exist_ok=True)
    md = markdown(sweep, varying, out)
    (dest / "comparison.md").write_text(md)
    png = plot(varying, out, dest / "comparison.png")
    print(md)
    result = {"sweep": str(sweep), "markdown": str(dest / "comparison.md"), "plot": str(png), "varying": varying,
              "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in out]}
    print(json.dumps(result, default=str))
    return result


if __name__ == "__main__":
    main()
