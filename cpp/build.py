"""Extension list for setup.py: the sparse kernels as two modules,
`lightning_dynmo.sparse._C_cpu` (op schemas + CPU kernels, g++ only) and
`lightning_dynmo.sparse._C_cuda` (CUDA kernels, registered on the schemas of _C_cpu).

Why two: a failed or skipped CUDA build must never cost the CPU kernels; each
module builds, and may fail, on its own.  Why the care: the build must never break
`pip install -e .`.  If torch is missing no module is built (the package falls back to a
pure-torch path).  CUDA sources are compiled only with a CUDA torch and nvcc present
(FORCE_CUDA=1 / TORCH_CUDA_ARCH_LIST honoured, as in torchvision).  Flags stay portable: -O3 + OpenMP, no -march=native;
wider ISAs come from per-file `#pragma GCC target` plus run-time dispatch.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_EXT = "lightning_dynmo.sparse._C_cpu"
CUDA_EXT = "lightning_dynmo.sparse._C_cuda"
BUILD_RECORD = "_build_record.json"  # beside the modules; read by lightning_dynmo/sparse/_ops.py
CPU_SOURCES = ["module_cpu.cpp", "ops.cpp", "sparse_cpu.cpp", "cpu_kernels_default.cpp", "cpu_kernels_avx2.cpp",
               "cpu_kernels_avx512.cpp",
               # block-sparse causal attention
               "attention_cpu.cpp", "attention_kernels_default.cpp", "attention_kernels_avx2.cpp",
               "attention_kernels_avx512.cpp"]
# nvcc compiles only the torch-free kernels (*.cu, one per kernel family, direction and dtype, so
# ninja runs them in parallel); the torch bindings are host-compiled .cpp (nvcc compiling ATen
# headers was most of the build time).
CUDA_SOURCES = ["cuda/module_cuda.cpp", "cuda/sparse_binding.cpp", "cuda/attention_binding.cpp",
                "cuda/sparse_kernels.cu", "cuda/attention_fwd_f32.cu", "cuda/attention_fwd_bf16.cu",
                "cuda/attention_bwd_f32.cu", "cuda/attention_bwd_bf16.cu"]
CXX_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr"]


def _rel(name: str) -> str:
    # setuptools wants paths relative to setup.py's directory.
    return os.path.relpath(CSRC / name, Path.cwd())


def cuda_decision() -> tuple[bool, str]:
    """(build the CUDA kernels?, why): they need a CUDA build of torch and nvcc; a GPU too,
    unless FORCE_CUDA=1 or TORCH_CUDA_ARCH_LIST says which architectures to build for."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return False, "torch is not installed"
    forced = os.environ.get("FORCE_CUDA", "0") == "1" or bool(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build"
    elif CUDA_HOME is None:
        why = "nvcc (the CUDA toolkit) was not found: set CUDA_HOME"
    elif not (forced or torch.cuda.is_available()):
        why = "no GPU was visible at install time and FORCE_CUDA=1 was not set"
    else:
        return True, "FORCE_CUDA=1" if forced else "a GPU is visible"
    if forced:
        warnings.warn(f"FORCE_CUDA/TORCH_CUDA_ARCH_LIST set but {why}; building the CPU kernels only")
    return False, why


def want_cuda() -> bool:
    return cuda_decision()[0]


def write_build_record(ext_dir: str, name: str, built: bool, why: str) -> None:
    """Record in the installed package why a kernel module was (not) built: pip hides a successful
    build's output, so ``lightning_dynmo.sparse`` reads this and names the cause when it warns."""
    path = Path(ext_dir) / BUILD_RECORD
    try:
        record = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        record = {}
    entry = {"built": built, "why": why}
    try:  # a module built against one torch must not load into another (see lightning_dynmo/sparse/_ops.py)
        import torch
        entry["torch"] = torch.__version__
    except ImportError:
        pass
    record[name.rsplit(".", 1)[-1]] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def extension_modules() -> list:
    try:
        from torch.utils.cpp_extension import CppExtension, CUDAExtension
    except ImportError:  # no torch at metadata time: package installs, extension is absent
        return []
    include = [str(CSRC)]
    # optional: setuptools then skips copying a module whose build failed (in-place/editable);
    # LDSPARSE_STRICT_BUILD=1 turns every failure into a failed install.
    optional = os.environ.get("LDSPARSE_STRICT_BUILD", "0") != "1"
    mods = [CppExtension(
        CPU_EXT, [_rel(s) for s in CPU_SOURCES], include_dirs=include,
        extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=["-fopenmp"], optional=optional)]
    if want_cuda():
        mods.append(CUDAExtension(
            CUDA_EXT, [_rel(s) for s in CUDA_SOURCES], include_dirs=include,
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS}, optional=optional))
    return mods


def build_ext_cmdclass() -> dict:
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return {}

    class OptionalBuildExtension(BuildExtension):
        """A failed kernel build warns instead of failing the install: the package then runs
        its (slower) reference path.  LDSPARSE_STRICT_BUILD=1 makes the failure fatal."""

        def copy_extensions_to_source(self):
            """In-place and editable builds: setuptools copies the modules into the source tree;
            the build record goes with them."""
            super().copy_extensions_to_source()
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions[:1]:
                package = ext.name.rsplit(".", 1)[0]
                src = Path(self.build_lib, *package.split("."), BUILD_RECORD)
                if src.exists():
                    self.copy_file(str(src), os.path.join(build_py.get_package_dir(package), BUILD_RECORD))

        def build_extension(self, ext):
            ext_dir = os.path.dirname(self.get_ext_fullpath(ext.name))

            def record(name, built, why):
                write_build_record(ext_dir, name, built, why)
            if ext.name == CPU_EXT:  # the CUDA module's fate when it is not even attempted
                cuda, why = cuda_decision()
                if not cuda:
                    record(CUDA_EXT, False, f"not built: {why}")
            try:
                super().build_extension(ext)
            except Exception as exc:  # CompileError, ninja's CalledProcessError, ...
                record(ext.name, False, f"the build failed: {type(exc).__name__}: {exc}")
                if os.environ.get("LDSPARSE_STRICT_BUILD", "0") == "1":
                    raise
                what = ("the CUDA kernels (CUDA tensors take the slow reference path; the CPU "
                        "kernels are unaffected)" if ext.name == CUDA_EXT else
                        "the CPU kernels (lightning_dynmo.sparse uses its slow pure-torch reference path)")
                msg = f"building {ext.name} failed, so {what}: {exc}"
                # pip hides the output of a successful install (shown with -v); the build record
                # makes `import lightning_dynmo.sparse` name this cause when it warns.
                print(f"lightning_dynmo: WARNING: {msg}", file=sys.stderr, flush=True)
                warnings.warn(msg)
            else:
                record(ext.name, True, "built")

    return {"build_ext": OptionalBuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}
