"""Project lightning_dynmo's dynamic balancing to the DynMo paper's scale, in simulation (Hydra).

    python recipes/paper_scale.py                 # full grid; report in outputs/paper_scale/<date>/<time>/
    python recipes/paper_scale.py quick=true      # the headline cells only (~1 minute)
    python recipes/paper_scale.py --help          # every option

Everything is simulated by :mod:`lightning_dynmo.sim` (torch's schedule order, the training
balancers and cost model): per-layer costs from a measured profile of the paper's GPT block,
changed over training by synthetic models of each dynamism case. The run directory gets
``report.md``, ``paper_scale.png`` and ``results.json``; the last line printed is one JSON object
whose ``projected_speedup_vs_static`` maps each case to its speedup (best dynamic over best static
at the same granularity) at the headline cell (default: 48 layers on 24 stages, fine
granularity: five pieces per block, the LM head + loss in ``head_chunks`` vocabulary chunks),
with ``fluid_ceiling`` per case, ``dense_efficiency``, bubble fractions before/after, the
sub-layer and block-granularity figures (``granularities``), the zero-bubble schedules (``schedules``) and the
packing figures.
"""
from __future__ import annotations

import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="../conf", config_name="paper_scale", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from lightning_dynmo.sim.scenarios.projection import project

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    summary = project(OmegaConf.to_container(cfg, resolve=True), out_dir)
    cells = summary.pop("cells")
    summary.pop("packing_detail")
    print(Path(summary["report"]).read_text())
    print(f"({len(cells)} cells; report {summary['report']}, plot {summary['plot']})")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
