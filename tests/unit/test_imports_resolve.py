"""Every ``from lightning_dynmo... import name`` in the scripts around the package (benchmarks,
recipes, scripts, test workers and helpers) names something that exists, including imports
inside functions that only a full benchmark run reaches: a refactor that moves a name breaks
this test, not a benchmark nobody ran."""
import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for d in ("benchmarks", "recipes", "scripts", "tests") for p in (ROOT / d).rglob("*.py"))


def package_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightning_dynmo"):
            for alias in node.names:
                yield node.lineno, node.module, alias.name


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_package_imports_resolve(path):
    missing = []
    for line, module, name in package_imports(path):
        mod = importlib.import_module(module)
        if name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"line {line}: from {module} import {name}")
    assert not missing, f"{path.relative_to(ROOT)} imports names the package does not have: {missing}"
