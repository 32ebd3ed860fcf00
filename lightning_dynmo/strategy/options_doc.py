"""``docs/options.md`` from :class:`PipelineOptions` itself (names, defaults and the field
docstrings), so the page cannot drift from the code; ``tests/unit/test_options_doc.py`` checks it.

    python -m lightning_dynmo.strategy.options_doc > docs/options.md
"""
from __future__ import annotations

from dataclasses import MISSING, fields
from enum import Enum

from .options import PipelineOptions
from .signature import field_docs

HEADER = """# DynMoStrategy options

Generated from `PipelineOptions` (`lightning_dynmo/strategy/options.py`) by
`python -m lightning_dynmo.strategy.options_doc > docs/options.md`; do not edit by hand.
Pass any of them to `DynMoStrategy(...)`, or in the Hydra recipe as `strategy.<name>=<value>`
(the structured config `dynmo_options` is registered from the same dataclass; the
recipe's own overrides are in `conf/strategy/dynmo.yaml`), or under Lightning's `LightningCLI`
(`recipes/cli_gpt.py`, `pip install -e ".[cli]"`) as `--trainer.strategy.<name>=<value>` after
`--trainer.strategy=lightning_dynmo.DynMoStrategy` (the strategy's signature lists them, made from
the same dataclass; `--trainer.strategy.help lightning_dynmo.DynMoStrategy` prints this table's
meanings). Lightning's own strategy arguments (`accelerator`, `parallel_devices`,
`cluster_environment`, `checkpoint_io`, `precision_plugin`) are accepted too.

| option | default | meaning |
|---|---|---|
"""


def default_text(value) -> str:
    """A default as a user writes it."""
    if isinstance(value, Enum):
        value = value.value
    return f"`{value!r}`"


def markdown() -> str:
    docs = field_docs()
    rows = []
    for f in fields(PipelineOptions):
        if f.name not in docs:
            raise ValueError(f"PipelineOptions.{f.name} has no docstring: add a string literal under the field")
        default = default_text(f.default) if f.default is not MISSING else "required"
        rows.append(f"| `{f.name}` | {default} | {docs[f.name].replace('|', '&#124;')} |")
    return HEADER + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
