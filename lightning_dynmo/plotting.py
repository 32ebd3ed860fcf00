"""Pictures of the pipeline: the timeline of one profiled step and stage loads before/after.

The timeline draws, per rank, a bar for every forward (F), backward (B) and weight-gradient (W)
chunk; the gaps are the bubble, as in Figure 5 of the DynMo paper. Chunk times come from the
same clock on every rank of a machine (``perf_counter``); across machines bars are aligned on
each rank's first chunk.
"""
from __future__ import annotations

from typing import Sequence

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def save_rebalance_figure(
    path: str,
    events: Sequence[dict],
    before: tuple[str, Sequence[float]],
    after: tuple[str, Sequence[float]] | None = None,
    title: str = "",
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [2.2, 1]})
    plot_timeline(ax_t, events)
    plot_stage_loads(ax_l, before, after)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(ax, events: Sequence[dict]) -> None:
    if not events:
        ax.set_title("no timeline recorded")
        return
    t0 = min(e["start"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    for e in events:
        y = ranks.index(e["rank"])
        ax.barh(y, (e["end"] - e["start"]) * 1e3, left=(e["start"] - t0) * 1e3, color=COLORS.get(e["kind"], "grey"),
                edgecolor="white", linewidth=0.4, height=0.8)
        width_ms = (e["end"] - e["start"]) * 1e3
        ax.text((e["start"] - t0) * 1e3 + width_ms / 2, y, str(e["mb"]), ha="center", va="center", fontsize=6,
                color="white")
    end = max(e["end"] for e in events)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since first chunk (gaps = idle)")
    busy = {r: sum(e["end"] - e["start"] for e in events if e["rank"] == r) for r in ranks}
    idle = 1 - sum(busy.values()) / (len(ranks) * (end - t0)) if end > t0 else 0.0
    ax.set_title(f"pipeline timeline (F forward, B backward, W weight grad); idle {idle:.0%}")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="lower right", fontsize=7)


def plot_stage_loads(ax, before: tuple[str, Sequence[float]], after: tuple[str, Sequence[float]] | None) -> None:
    label_b, loads_b = before
    n = len(loads_b)
    xs = range(n)
    width = 0.4 if after else 0.8
    ax.bar([x - (width / 2 if after else 0) for x in xs], [v * 1e3 for v in loads_b], width, label=f"before {label_b}")
    if after:
        label_a, loads_a = after
        ax.bar([x + width / 2 for x in xs], [v * 1e3 for v in loads_a], width, label=f"after {label_a}")
    ax.set_xticks(list(xs), [f"stage {s}" for s in xs])
    ax.set_ylabel("predicted time per micro-batch (ms)")
    ax.set_title("stage loads")
    ax.legend(fontsize=7)
