"""The paper-scale projection's outputs: the Markdown report and the PNG (see :mod:`.projection`)."""
from __future__ import annotations

import math

from .profile import Profile

#: The DynMo paper's figures (seeds/001), for side-by-side reading only (never used as targets).
PAPER = {
    "speedup": {"moe": 1.23, "pruning": 3.18, "freezing": 2.23, "sparse_attention": 4.02, "early_exit": 4.52,
                "mod": 1.17},
    "bubble": {"moe": (0.25, 0.08), "mod": (0.18, 0.04)},
    "packing": {"pruning": (8, 5.8)},
    "note": "early exit and sparse attention speedups are over the model without the dynamism "
            "(paper 4.1); the others over the best of static Megatron-LM / DeepSpeed",
}


# ------------------------------------------------------------------------------ outputs
def plot(cells: list[dict], packing: dict, cfg: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = cfg["headline"]["layers"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.2))
    grans = list(dict.fromkeys(c["granularity"] for c in cells))
    for i, case in enumerate(cfg["cases"]):
        for g, style in zip(grans, ("-", "--", ":")):
            pts = sorted((c["stages"], c["speedup_vs_static"]) for c in cells if c["case"] == case and c["layers"] == L
                         and c["granularity"] == g and c["schedule"] == cfg["schedule"])
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{case} ({g})")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("pipeline stages")
    ax.set_ylabel("speedup, best dynamic / best static")
    ax.set_title(f"{L}-layer GPT, {cfg['schedule']} (simulated)")
    ax.legend(fontsize=7, ncol=2)
    for case, d in packing.items():
        v = d.get(str(L)) or next(iter(d.values()))
        x, acc = [], 0.0
        for it in v["iterations"]:
            x.append(acc)
            acc += it
        ax2.step(x + [acc], v["ranks_over_time"] + v["ranks_over_time"][-1:], where="post",
                 label=f"{case} (mean {v['mean_gpus']:.2f})")
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("pipeline GPUs in use (per replica)")
    ax2.set_title("re-packing (simulated)")
    ax2.set_ylim(0, int(cfg["repack"]["stages"]) + 0.5)
    ax2.legend(fontsize=8)
    fig.suptitle(f"Simulated from measured per-layer costs ({cfg['profile']}) and synthetic dynamism models",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(x, fmt=".2f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _by_case(cells: list[dict], **where) -> dict[str, dict]:
    return {c["case"]: c for c in cells if all(c[k] == v for k, v in where.items())}


def report(summary: dict, cells: list[dict], packing: dict, cfg: dict, profile: Profile) -> str:
    h = summary["headline"]
    gran, sched = summary["granularity"], cfg["schedule"]
    at = dict(layers=h["layers"], stages=h["stages"])
    head = _by_case(cells, granularity=gran, schedule=sched, **at)
    cut = {"block": "one pipeline layer per transformer block, the LM head + loss one layer",
           "sublayer": "each block as two pipeline layers (attention half, MLP half)",
           "fine": "each block as five pipeline layers (LN + QKV, attention core, output projection, LN + fc1 + "
                   "GELU, fc2; halves shared out by FLOPs, wide cuts charged their bytes)"}[gran]
    if gran != "block":
        cut += f", the LM head + loss as {summary['head_chunks']} vocabulary chunks"
    lines = [
        "# Paper-scale projection (simulated)",
        "",
        "**Everything below is simulated**, not measured at scale. Per-layer costs: "
        f"{profile.source}; GPT with hidden {profile.hidden}, {profile.heads} heads, sequence {profile.seq}, "
        f"micro-batch {profile.micro_batch}, vocabulary {profile.vocab} (the DynMo paper's appendix A), "
        "embedding and LM head + loss included as pipeline layers"
        + (f" (head cost x {cfg['head_scale']})" if cfg["head_scale"] != 1.0 else "") + ". "
        "How each dynamism changes those costs over training is a synthetic model whose parameters and "
        "sources are listed in `lightning_dynmo/sim/scenarios/__init__.py`. Schedule "
        f"`{sched}`, {cfg['microbatches_per_stage']} x stages micro-batches, data parallelism "
        f"{cfg['data_parallel']['replicas']}-way ({cfg['data_parallel']['moe_replicas']}-way for MoE/MoD, expert "
        f"parallel over it), {cfg['network']['gpus_per_node']} GPUs per node (NVLink inside, InfiniBand between), "
        "migrations charged, static partitions decided once (`static_time`: the exact time-balanced split of "
        "the first step's profiled costs, so the best static baseline is not equal piece counts where the "
        "pieces differ in cost).",
        "",
        f"Granularity **{gran}**: {cut} ({summary['pipeline_layers']} pipeline layers at {h['layers']} blocks). "
        "A half's cost is the measured block minus the measured MLP at the same token count (so the halves add "
        "up to the block), a chunk's is 1/k of the measured head + loss; each dynamism model acts on the "
        "half it concerns (sparse attention: attention half; MoE: MLP half; MoD, early exit, freezing, pruning: "
        "both), and the finer boundaries' bytes (head chunks also carry max, sum-exp and target logit) cost link "
        "time in the simulator and the cost model, each boundary over its own link (NVLink or InfiniBand).",
        "",
        f"## Headline: {h['layers']} layers on {h['stages']} pipeline stages",
        "",
        "| case | speedup vs best static | fluid ceiling | vs best static at block granularity | vs Megatron | "
        "vs DeepSpeed param | vs dense model (static) | bubble static -> dynamic | paper |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    vs_block = summary.get("speedup_vs_block_static", {})
    for case in cfg["cases"]:
        if case not in summary["projected_speedup_vs_static"]:
            continue
        pb = PAPER["bubble"].get(case)
        paper = f"{PAPER['speedup'][case]}x" + (f"; bubble {pb[0]:.0%} -> {pb[1]:.0%}" if pb else "")
        lines.append(
            f"| {case} | **{_f(summary['projected_speedup_vs_static'][case], '.3f')}x** "
            f"({summary['best_dynamic_balancer'][case]}) | {_f(summary['fluid_ceiling'][case], '.3f')}x | "
            f"{_f(vs_block.get(case), '.3f')}x | "
            f"{_f(summary['speedup_vs_megatron'][case], '.3f')}x | "
            f"{_f(summary['speedup_vs_deepspeed_param'][case], '.3f')}x | "
            f"{_f(summary['speedup_vs_dense_static'][case], '.3f')}x | "
            f"{summary['bubble_static'][case]:.1%} -> {summary['bubble_dynamic'][case]:.1%} | {paper} |")
    lines += [
        "",
        f"The schedule's own bubble with equal stages is {_f(summary['inherent_bubble'], '.1%')} "
        "(1F1B: (p-1)/(m+p-1)). "
        "*Fluid ceiling*: the speedup over the best static partition if every rank held exactly its share of "
        "the work (the schedule's own bubble kept, links and all-reduce free): how far whole pieces still are "
        "from the limit. *Dense efficiency* (the model without dynamism: that ideal step over the best "
        f"partition's simulated step): **{_f(summary['dense_efficiency'], '.3f')}**. *vs best static at block "
        "granularity*: today's best static split of whole blocks over this granularity's best dynamic one (finer "
        "cuts and balancing together). The dense model gains "
        f"{_f(summary['dense_model_speedup_vs_static'], '.3f')}x from time-based balancing over the best static split.",
        "",
    ]
    grans = summary["granularities"]
    if len(grans) > 1 or summary["schedules"]:
        lines += ["## Granularity and schedule (headline cell)", "",
                  "| granularity | schedule | pipeline layers | dense efficiency | own bubble | "
                  + " | ".join(f"{c}: speedup / ceiling" for c in cfg["cases"]) + " |",
                  "|---|---|---|---|---|" + "---|" * len(cfg["cases"])]
        rows = [(g, sched, f) for g, f in grans.items()]
        rows += [(g, s, f) for s, d in summary["schedules"].items() for g, f in d.items()]
        for g, s, f in rows:
            lines.append(f"| {g} | {s} | {f['pipeline_layers']} | {_f(f['dense_efficiency'], '.3f')} | "
                         f"{_f(f['inherent_bubble'], '.1%')} | " + " | ".join(
                             f"{_f(f['projected_speedup_vs_static'].get(c), '.3f')} / "
                             f"{_f(f['fluid_ceiling'].get(c), '.3f')}"
                             for c in cfg["cases"]) + " |")
        lines += ["", "Whole-piece quantization (1F1B grid, free links): heaviest stage over the mean stage, exact "
                  "partition / equal piece counts (`uniform`), iteration-weighted over each trajectory:", "",
                  "| granularity | " + " | ".join(cfg["cases"]) + " |", "|---|" + "---|" * len(cfg["cases"])]
        for g, f in grans.items():
            q = f["stage_max_over_mean"]
            lines.append(f"| {g} | " + " | ".join(
                f"{q[c]['partition_time']:.3f} / {q[c]['uniform']:.3f}" if c in q else "-"
                for c in cfg["cases"]) + " |")
        lines += [""]
        step_rows = []
        for g in grans:
            for s in [sched, *summary["schedules"]]:
                d = _by_case(cells, granularity=g, schedule=s, **at)
                if d:
                    step_rows.append(f"| {g} | {s} | " + " | ".join(
                        f"{d[c]['seconds_per_iteration'][d[c]['best_dynamic']] * 1e3:.0f} ms "
                        f"({d[c]['bubble_dynamic']:.0%})" if c in d else "-" for c in cfg["cases"]) + " |")
        lines += ["Best dynamic balancer's seconds per iteration (bubble):", "",
                  "| granularity | schedule | " + " | ".join(cfg["cases"]) + " |",
                  "|---|---|" + "---|" * len(cfg["cases"]), *step_rows, ""]
    lines += [
        f"## All cells ({sched}; {', '.join(grans)}): speedup of the best dynamic balancer over the best static "
        "partition at the same granularity",
        "",
        "| case | layers | " + " | ".join(f"{s} stages" for s in cfg["stages"]) + " |",
        "|---|---|" + "---|" * len(cfg["stages"]),
    ]
    for case in cfg["cases"]:
        for L in cfg["layers"]:
            for g in grans:
                row = {c["stages"]: c for c in cells if c["case"] == case and c["layers"] == L
                       and c["granularity"] == g and c["schedule"] == sched}
                lines.append(f"| {case}{'' if g == gran else f' ({g})'} | {L} | " + " | ".join(
                    f"{row[s]['speedup_vs_static']:.3f}x ({row[s]['best_dynamic']})" if s in row else "-"
                    for s in cfg["stages"]) + " |")
    lines += ["", "## Per balancer (seconds per iteration, headline cell)", "",
              "| case | " + " | ".join([*cfg["static"], *cfg["dynamic"]]) + " |",
              "|---|" + "---|" * (len(cfg["static"]) + len(cfg["dynamic"]))]
    for case in cfg["cases"]:
        c = head.get(case)
        if c:
            lines.append(f"| {case} | " + " | ".join(f"{c['seconds_per_iteration'][n] * 1e3:.1f} ms"
                                                     for n in [*cfg["static"], *cfg["dynamic"]]) + " |")
    lines += ["", f"## Re-packing ({gran}; gradual shrinking of the work; pipeline GPUs per replica over training)", "",
              "| case | layers | start | mean GPUs | GPU-hours saved | worst throughput ratio | peak stage memory |",
              "|---|---|---|---|---|---|---|"]
    for case, d in packing.items():
        for L, v in d.items():
            lines.append(f"| {case} | {L} | {v['stages']} | {v['mean_gpus']:.2f} | "
                         f"{v['gpu_hours_saved_fraction']:.1%} | "
                         f"{v['min_throughput_ratio']:.3f} | {v['peak_stage_memory_gb']:.1f} GB |")
    lines += ["", f"Paper: gradual pruning packs 8 -> {PAPER['packing']['pruning'][1]} GPUs on average.", ""]
    if summary["sensitivity_head_scale"]:
        lines += [f"## Sensitivity: cost of the LM head + loss ({gran})", "",
                  "| head cost x | " + " | ".join(cfg["cases"]) + " |", "|---|" + "---|" * len(cfg["cases"]),
                  f"| {cfg['head_scale']} (run) | " + " | ".join(
                      _f(summary["projected_speedup_vs_static"].get(c), ".3f") for c in cfg["cases"]) + " |"]
        for k, d in summary["sensitivity_head_scale"].items():
            lines.append(f"| {k} | " + " | ".join(_f(d.get(c), ".3f") for c in cfg["cases"]) + " |")
        lines += ["", "(0: blocks only, as a model without embedding/head layers would be.)", ""]
    lines += ["![paper scale](paper_scale.png)", "", f"Simulated in {summary['seconds']} s.", ""]
    return "\n".join(lines)
