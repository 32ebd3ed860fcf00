"""The sparse kernels' build layout and what the package says when a module is missing.

CPU and CUDA kernels are separate modules (_C_cpu, _C_cuda), so a failed or skipped CUDA build
keeps the CPU kernels; the import messages name the real cause (not built / stale build / a real
circular import) instead of Python's "circular import" guess; CUDA tensors on a CPU-only build
warn once, naming the layer and the fix.  All of it runs on the CPU.
"""
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from cpp import build
from lightning_dynmo.sparse import _ops

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_and_cuda_are_separate_modules(monkeypatch):
    import torch.utils.cpp_extension as cx

    def fake_cuda_extension(name, sources, **kwargs):  # the real one needs CUDA_HOME
        return cx.CppExtension(name, sources, **{k: v for k, v in kwargs.items() if k != "extra_compile_args"})
    monkeypatch.setattr(cx, "CUDAExtension", fake_cuda_extension)
    monkeypatch.setattr(build, "want_cuda", lambda: True)
    mods = {m.name: m for m in build.extension_modules()}
    assert set(mods) == {"lightning_dynmo.sparse._C_cpu", "lightning_dynmo.sparse._C_cuda"}
    assert not any(s.endswith(".cu") for s in mods["lightning_dynmo.sparse._C_cpu"].sources)
    assert not any("cpu" in Path(s).name for s in mods["lightning_dynmo.sparse._C_cuda"].sources)
    monkeypatch.setattr(build, "want_cuda", lambda: False)
    assert [m.name for m in build.extension_modules()] == ["lightning_dynmo.sparse._C_cpu"]


def _builder(cls, tmp_path):
    """The build command as setuptools drives it, writing into tmp_path (no real compiler)."""
    inst = object.__new__(cls)
    inst.get_ext_fullpath = lambda name: str(tmp_path / (name.replace(".", "/") + ".so"))
    return inst


def test_failed_cuda_build_keeps_cpu_and_says_so(monkeypatch, capsys, tmp_path):
    from torch.utils.cpp_extension import BuildExtension
    cls = build.build_ext_cmdclass()["build_ext"]

    def boom(self, ext):
        raise RuntimeError("nvcc exploded")
    monkeypatch.setattr(BuildExtension, "build_extension", boom)
    monkeypatch.delenv("LDSPARSE_STRICT_BUILD", raising=False)
    ext = type("Ext", (), {"name": build.CUDA_EXT})()
    with pytest.warns(UserWarning, match="CPU kernels are unaffected"):
        cls.build_extension(_builder(cls, tmp_path), ext)
    err = capsys.readouterr().err
    assert "lightning_dynmo: WARNING: building lightning_dynmo.sparse._C_cuda failed" in err
    assert "nvcc exploded" in err
    # pip hides that line on a successful install: the record beside the modules keeps it
    pkg = tmp_path / "lightning_dynmo" / "sparse"
    record = json.loads((pkg / build.BUILD_RECORD).read_text())
    assert record["_C_cuda"] == {"built": False, "why": "the build failed: RuntimeError: nvcc exploded",
                                 "torch": torch.__version__}
    monkeypatch.setattr(_ops, "_PKG_DIR", pkg)
    cause = _ops.import_failure_cause("_C_cuda", ImportError("No module named '_C_cuda'"))
    assert "the install says the build failed: RuntimeError: nvcc exploded" in cause
    monkeypatch.setenv("LDSPARSE_STRICT_BUILD", "1")
    with pytest.raises(RuntimeError, match="nvcc exploded"):
        cls.build_extension(_builder(cls, tmp_path), ext)


def test_skipped_cuda_build_is_recorded_with_its_reason(monkeypatch, tmp_path):
    """A CPU build (CPU torch, no nvcc or no GPU) records why the CUDA kernels were not built,
    so a later `import lightning_dynmo.sparse` on a GPU host says why, not just "missing"."""
    from torch.utils.cpp_extension import BuildExtension
    cls = build.build_ext_cmdclass()["build_ext"]
    monkeypatch.setattr(BuildExtension, "build_extension", lambda self, ext: None)
    monkeypatch.setattr(build, "cuda_decision", lambda: (False, "torch 2.13.0+cpu is a CPU-only build"))
    cls.build_extension(_builder(cls, tmp_path), type("Ext", (), {"name": build.CPU_EXT})())
    pkg = tmp_path / "lightning_dynmo" / "sparse"
    record = json.loads((pkg / build.BUILD_RECORD).read_text())
    assert record == {"_C_cpu": {"built": True, "why": "built", "torch": torch.__version__},
                      "_C_cuda": {"built": False, "why": "not built: torch 2.13.0+cpu is a CPU-only build",
                                  "torch": torch.__version__}}
    monkeypatch.setattr(_ops, "_PKG_DIR", pkg)
    cause = _ops.import_failure_cause("_C_cuda", ImportError("No module named '_C_cuda'"))
    assert "the install says not built: torch 2.13.0+cpu is a CPU-only build" in cause


def test_import_failure_cause_names_the_real_cause(tmp_path, monkeypatch):
    monkeypatch.setattr(_ops, "_PKG_DIR", tmp_path)
    circular = ImportError("cannot import name '_C' from partially initialized module "
                           "'lightning_dynmo.sparse' (most likely due to a circular import)")
    missing = _ops.import_failure_cause("_C_cuda", circular)
    assert "_C_cuda is not built" in missing and "circular" not in missing
    assert "pip install --no-build-isolation -e ." in missing and "FORCE_CUDA=1" in missing
    (tmp_path / "_C_cuda.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    stale = _ops.import_failure_cause("_C_cuda", ImportError("/x/_C_cuda.so: undefined symbol: _ZN3c10"))
    assert "stale build" in stale and "undefined symbol" in stale
    real = _ops.import_failure_cause("_C_cuda", circular)
    assert "real circular import" in real


def test_a_module_built_for_another_torch_is_not_loaded(tmp_path, monkeypatch):
    """A module built against torch 2.13 loaded into 2.12 without an error and registered its
    kernels under other dispatch keys (every op then failed at its first call); the build record
    names the torch it was built for, and another torch takes the reference path, saying why."""
    (tmp_path / "_C_cpu.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    record = {"_C_cpu": {"built": True, "why": "built", "torch": "2.12.1+cu130"}}
    (tmp_path / build.BUILD_RECORD).write_text(json.dumps(record))
    monkeypatch.setattr(_ops, "_PKG_DIR", tmp_path)
    module, err = _ops._load("_C_cpu")
    assert module is None and isinstance(err, _ops.BuiltForAnotherTorch)
    cause = _ops.import_failure_cause("_C_cpu", err)
    assert f"against torch 2.12.1+cu130, but this process runs torch {torch.__version__}" in cause, cause
    assert "pip install --no-build-isolation -e ." in cause
    record["_C_cpu"]["torch"] = torch.__version__  # built for this torch: loaded (the installed module)
    (tmp_path / build.BUILD_RECORD).write_text(json.dumps(record))
    module, err = _ops._load("_C_cpu")
    assert (module is not None) == _ops.extension_available(), err


def test_reference_path_on_cuda_warns_once_with_cause_and_fix(monkeypatch):
    monkeypatch.setattr(_ops, "_WARNED", set())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _ops.warn_reference_on_cuda("SparseLinear(in_features=8, out_features=4, nnz=5)")
        _ops.warn_reference_on_cuda("SparseLinear(in_features=8, out_features=4, nnz=5)")
    assert len(w) == 1
    msg = str(w[0].message)
    assert "SparseLinear(in_features=8" in msg and "densifying reference path" in msg
    if not _ops.cuda_kernels_available():  # a CPU-only build (always on a machine without nvcc)
        assert "_C_cuda is not built" in msg or "_C_cpu" in msg
        assert "pip install --no-build-isolation -e ." in msg


def test_missing_cpu_module_message_names_it_not_a_circular_import():
    code = (
        "import sys, importlib.abc, warnings\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'lightning_dynmo.sparse._C_cpu': raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from lightning_dynmo import sparse\n"
        "msgs = [str(x.message) for x in w if 'compiled kernels unavailable' in str(x.message)]\n"
        "assert len(msgs) == 1 and 'circular' not in msgs[0] and '_C_cpu' in msgs[0], msgs\n"
        "assert not sparse.cuda_kernels_available()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
