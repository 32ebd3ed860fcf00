"""docs/layout.md is generated from the modules' docstrings (scripts/layout_doc.py): it fails on a
drift and says how to fix it, and on a module without a docstring."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def layout_doc():
    spec = importlib.util.spec_from_file_location("layout_doc", ROOT / "scripts" / "layout_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_layout_md_is_generated_from_the_package_tree():
    page = (ROOT / "docs" / "layout.md").read_text()
    assert page == layout_doc().markdown(), "docs/layout.md is stale: python scripts/layout_doc.py > docs/layout.md"


def test_every_module_is_listed_once():
    page = (ROOT / "docs" / "layout.md").read_text()
    modules = [p for p in (ROOT / "lightning_dynmo").rglob("*.py") if p.name != "__init__.py"]
    assert sum(page.count(f"| `{p.name}` |") for p in {p.name: p for p in modules}.values()) >= len(
        {p.name for p in modules})
    for pkg in {p.parent for p in modules}:
        assert f"## `{pkg.relative_to(ROOT).as_posix()}/`" in page


@pytest.mark.parametrize("doc, first", [
    ("One thing. Another thing.", "One thing."),
    ("Uses e.g. a list. Then more.", "Uses e.g. a list."),
    ("A :class:`~a.b.Name` and ``code``.\n\nSecond paragraph.", "A `Name` and `code`."),
    ("No full stop at all", "No full stop at all"),
    ("A | pipe.", "A &#124; pipe."),
])
def test_first_sentence(doc, first):
    assert layout_doc().first_sentence(doc) == first


def test_a_module_without_a_docstring_is_refused(tmp_path):
    bare = tmp_path / "bare.py"
    bare.write_text("x = 1\n")
    mod = layout_doc()
    mod.ROOT = tmp_path
    with pytest.raises(ValueError, match="bare.py has no module docstring"):
        mod.docstring(bare)
