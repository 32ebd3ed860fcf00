"""The package's layering, read from its imports with ``ast`` (no module is imported).

Rules (the design brief's three layers, plus the contract both sides share):

* every package imports only the ``lightning_dynmo`` packages :data:`MAY_IMPORT` lists for it
  (``plan/`` and ``protocol/`` none; ``models/`` no ``runtime/``: what a model needs from the
  runtime comes through ``protocol/``);
* ``plan/`` and ``protocol/`` import neither ``torch.distributed`` nor Lightning;
* the module import graph has no cycle, inside a package or across packages;
* a module over :data:`MAX_MODULE_LINES` lines is a smell to look at, not a design rule.

What counts as an import: every ``import`` statement anywhere in a module (module level, inside
functions, under ``if TYPE_CHECKING``), relative ones resolved. ``from pkg import name`` is an
edge to the module ``pkg.name`` when that is a module, else to ``pkg``. An edge from a module to
one of its own parent packages is not counted: Python initialises those before the module runs.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "lightning_dynmo"
MAX_MODULE_LINES = 600

#: the lightning_dynmo packages each package may import besides itself (unlisted ones: any)
MAY_IMPORT: dict[str, set[str]] = {
    "protocol": set(),  # the contract between models and the pipeline: both sides import it
    "plan": set(),  # pure decisions on plain numbers
    "sparse": set(),
    "sim": {"plan", "protocol"},
    "runtime": {"plan", "protocol"},
    "models": {"protocol", "sparse"},
    "dynamic": {"models", "protocol", "sparse"},
}
#: third-party modules a package must not import (prefix match)
MUST_NOT_IMPORT: dict[str, tuple[str, ...]] = {
    "plan": ("torch.distributed", "lightning"),
    "protocol": ("torch.distributed", "lightning"),
}
#: strategy/ helpers that must not import the strategy class's module (they hold no strategy)
STRATEGY_HELPERS = ("rebalancer", "checkpoint", "checkpointer", "dcp_checkpoint", "state", "pipeline")


def _modules(root: Path, package: str) -> dict[str, Path]:
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The absolute names ``node`` (in module ``name`` at ``path``) imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph(root: Path, package: str = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(internal, external)``: for each module of ``package`` under ``root``, the modules of the
    package it imports, and every other module name it imports."""
    modules = _modules(root, package)
    internal: dict[str, set[str]] = {m: set() for m in modules}
    external: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, path, node, modules):
                if target.split(".")[0] != package:
                    external[name].add(target)
                    continue
                while target not in modules and "." in target:  # an attribute of a module
                    target = target.rsplit(".", 1)[0]
                if target != name and not name.startswith(target + "."):
                    internal[name].add(target)
    return internal, external


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(internal: dict[str, set[str]], external: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in sorted(internal.items()):
        allowed = MAY_IMPORT.get(_package_of(module))
        if allowed is None:
            continue
        for dep in sorted(deps):
            pkg = _package_of(dep)
            if pkg != _package_of(module) and pkg not in allowed:
                bad.append(f"{module} imports {dep} "
                           f"({_package_of(module)}/ may import only {sorted(allowed) or 'nothing'})")
    for module, deps in sorted(external.items()):
        for dep in sorted(deps):
            for banned in MUST_NOT_IMPORT.get(_package_of(module), ()):
                if dep == banned or dep.startswith(banned + "."):
                    bad.append(f"{module} imports {dep}")
    return bad


GRAPH = import_graph(ROOT)


def test_packages_import_only_the_layers_below_them():
    bad = layering_violations(*GRAPH)
    assert not bad, "\n".join(bad)


def test_models_reach_the_runtime_only_through_the_protocol():
    internal, _ = GRAPH
    edges = [(m, d) for m, deps in internal.items() for d in deps
             if _package_of(m) == "models" and _package_of(d) == "runtime"]
    assert edges == []
    assert any(_package_of(d) == "protocol" for m, deps in internal.items() if _package_of(m) == "models" for d in deps)


def test_no_import_cycle():
    cycle = find_cycle(GRAPH[0])
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_strategy_helpers_do_not_import_the_strategy():
    internal, _ = GRAPH
    for helper in STRATEGY_HELPERS:
        assert f"{PACKAGE}.strategy.strategy" not in internal[f"{PACKAGE}.strategy.{helper}"], helper


def test_no_module_over_600_lines():
    """A smell alarm, not a design rule: a module this long probably holds two things."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules(ROOT, PACKAGE).items()}
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


# ---- the checks can fail: a planted violation of each rule is reported -------------------------
def _plant(tmp_path: Path, files: dict[str, str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    for rel, text in files.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in [p for p in (tmp_path / PACKAGE).rglob("*") if p.is_dir()] + [tmp_path / PACKAGE]:
        (d / "__init__.py").touch()
    return import_graph(tmp_path)


@pytest.mark.parametrize("files, expected", [
    ({"models/gpt/model.py": "def f():\n    from ...runtime.engine import Engine\n", "runtime/engine.py": ""},
     "lightning_dynmo.models.gpt.model imports lightning_dynmo.runtime.engine"),
    ({"plan/policy.py": "import torch.distributed as dist\n"}, "lightning_dynmo.plan.policy imports torch.distributed"),
    ({"plan/policy.py": "from lightning.pytorch import Trainer\n"},
     "lightning_dynmo.plan.policy imports lightning.pytorch"),
    ({"protocol/module.py": "from lightning_dynmo.strategy import DynMoStrategy\n", "strategy/__init__.py": ""},
     "lightning_dynmo.protocol.module imports lightning_dynmo.strategy"),
])
def test_a_planted_layering_violation_is_reported(tmp_path, files, expected):
    assert any(v.startswith(expected) for v in layering_violations(*_plant(tmp_path, files)))


def test_a_planted_cycle_is_found_also_through_type_checking_imports(tmp_path):
    internal, _ = _plant(tmp_path, {
        "models/gpt/config.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .model import GPT\n",
        "models/gpt/model.py": "from lightning_dynmo.models.gpt.config import GPTConfig\n",
    })
    assert find_cycle(internal) == ["lightning_dynmo.models.gpt.config", "lightning_dynmo.models.gpt.model",
                                    "lightning_dynmo.models.gpt.config"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
