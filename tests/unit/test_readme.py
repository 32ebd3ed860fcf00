"""The README and docs/ say what the code does: the main job's sample output is what the current
summary functions print for the recorded run, and every link points inside the repository."""
from __future__ import annotations

import json
import re
from pathlib import Path

from lightning_dynmo.strategy.recorder import dynmo_summary_text
from recipes.train_gpt import summary_text

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN = ROOT / "benchmarks" / "results" / "2026-11-27.md"  # the recorded main job (its summary.json)
MARK = "<!-- sample: tests/unit/test_readme.py -->"
#: lines of the recipe's report that name files of one run (left out of the sample)
PATH_LABELS = ("  run dir", "  csv metrics", "  tensorboard", "  rebalances", "  checkpoints", "  summary ")


def recorded_summary() -> dict:
    return json.loads(re.search(r"```json\n(.*?)\n```", RUN.read_text(), re.S).group(1))


def sample_output(summary: dict) -> str:
    """What the main job prints at its end: the strategy's DynMo line, then the recipe's report."""
    report = [line for line in summary_text(summary).splitlines()
              if line and not line.startswith("=") and not line.startswith(PATH_LABELS)]
    return dynmo_summary_text(summary["dynmo"]) + "\n" + "\n".join(report)


def readme_sample() -> str:
    text = README.read_text()
    assert MARK in text, f"README.md lost the marker {MARK} before its sample output"
    return re.search(r"```\n(.*?)\n```", text[text.index(MARK):], re.S).group(1)


def test_readme_sample_is_what_the_code_prints_for_the_recorded_run():
    expected = sample_output(recorded_summary())
    assert readme_sample() == expected, f"README.md's sample output is stale; paste this block:\n{expected}"


def test_readme_is_short_and_links_stay_inside_the_repository():
    assert len(README.read_text().splitlines()) <= 250
    for page in [README, *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]:
        text = page.read_text()
        assert "shared/" not in text and "/work/" not in text, f"{page.name} points outside the repository"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            assert path.exists() and ROOT in path.parents, f"{page.relative_to(ROOT)} links to missing {target}"


def test_readme_option_defaults_are_the_dataclass_defaults():
    """The README's short option table shows defaults too; they are PipelineOptions' own."""
    import dataclasses

    from lightning_dynmo.strategy.options import PipelineOptions
    from lightning_dynmo.strategy.options_doc import default_text

    defaults = {f.name: default_text(f.default) for f in dataclasses.fields(PipelineOptions)}
    rows = re.findall(r"^\| `(\w+)` \| (`[^`]*`) \|", README.read_text(), re.M)
    assert len(rows) >= 8
    for name, shown in rows:
        assert name in defaults, f"README.md's option table names {name!r}, which PipelineOptions does not have"
        assert shown == defaults[name], f"README.md shows {name}={shown}, PipelineOptions has {defaults[name]}"


def test_a_decision_with_no_measured_step_reads_not_measured():
    """With a rebalance every step nothing is measured around a decision; "0.0 ms before" read
    like a measurement."""
    summary = {"overhead_s": 0.01, "train_s": 1.0, "overhead_fraction": 0.01, "migration_s": 0.0, "decisions": 2,
               "skipped": 0, "applied_decisions": [
                   {"step": 1, "step_ms_before": 0.0, "step_ms_after": None, "gain": None},
                   {"step": 2, "step_ms_before": 12.5, "step_ms_after": None, "gain": None}]}
    lines = dynmo_summary_text(summary).splitlines()
    assert lines[1] == "  step 1: applied, step time not measured"
    assert lines[2] == "  step 2: applied, step time 12.5 ms before, not measured after"
