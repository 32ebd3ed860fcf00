"""``docs/layout.md`` from the package tree itself: every package and module of ``lightning_dynmo/``
with the first sentence of its docstring, so the layout cannot drift from the code;
``tests/unit/test_layout_doc.py`` checks it.

    python scripts/layout_doc.py > docs/layout.md
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_dynmo"

HEADER = """# Package layout

Generated from the modules' docstrings by `python scripts/layout_doc.py > docs/layout.md`; do not
edit by hand (change the docstring). Each line is the first sentence of the module's docstring.
Data flows one way: profile (`runtime/profiler.py`) -> cost model (`plan/cost_model.py`) ->
balancer (`plan/balancers/`, pure) -> decision (`plan/policy.py`) -> migration plan
(`plan/migration_plan.py`) -> executor (`runtime/migration.py`); `docs/architecture.md` says why.
"""


def first_sentence(doc: str) -> str:
    """The docstring's first sentence (its first paragraph up to a full stop that ends a sentence),
    on one line."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    m = re.search(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)(?<!\bvs)\.(?=\s+[A-Z`(*:]|$)", para)
    text = para[: m.start() + 1] if m else para
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda r: f"`{r.group(1).rsplit('.', 1)[-1]}`"
                  if r.group(0).count("~") else f"`{r.group(1)}`", text)  # Sphinx roles as code
    return text.replace("``", "`").replace("|", "&#124;")


def docstring(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise ValueError(f"{path.relative_to(ROOT)} has no module docstring: say in a sentence what it is for")
    return doc


def markdown() -> str:
    out = [HEADER]
    packages = sorted({p.parent for p in PACKAGE.rglob("*.py")}, key=lambda d: d.relative_to(ROOT).parts)
    for pkg in packages:
        rel = pkg.relative_to(ROOT).as_posix()
        init = pkg / "__init__.py"
        out.append(f"\n## `{rel}/`\n")
        if init.exists():
            out.append(first_sentence(docstring(init)) + "\n")
        rows = [f"| `{m.name}` | {first_sentence(docstring(m))} |"
                for m in sorted(pkg.glob("*.py")) if m.name != "__init__.py"]
        if rows:
            out.append("\n| module | what it is for |\n|---|---|\n" + "\n".join(rows) + "\n")
    return "".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown())
