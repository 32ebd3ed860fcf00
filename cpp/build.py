"""Extension list for setup.py: the sparse kernels as two modules,
`lightning_dynmo.sparse._C_cpu` (op schemas + CPU kernels, g++ only) and
`lightning_dynmo.sparse._C_cuda` (CUDA kernels, registered on the schemas of _C_cpu).

Why two: a failed or skipped CUDA build must never cost the CPU kernels (issue 32); each
module builds, and may fail, on its own.  Why the care: the build must never break
`pip install -e .`.  If torch is missing no module is built (the package falls back to a
pure-torch path).  CUDA sources are compiled only with a CUDA torch and nvcc present
(FORCE_CUDA=1 / TORCH_CUDA_ARCH_LIST honoured, as in torchvision).  Flags stay portable: -O3 + OpenMP, no -march=native;
wider ISAs come from per-file `#pragma GCC target` plus run-time dispatch.
"""
from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
CPU_EXT = "lightning_dynmo.sparse._C_cpu"
CUDA_EXT = "lightning_dynmo.sparse._C_cuda"
CPU_SOURCES = ["module_cpu.cpp", "ops.cpp", "sparse_cpu.cpp", "cpu_kernels_default.cpp", "cpu_kernels_avx2.cpp",
               "cpu_kernels_avx512.cpp",
               # block-sparse causal attention (issue 12)
               "attention_cpu.cpp", "attention_kernels_default.cpp", "attention_kernels_avx2.cpp",
               "attention_kernels_avx512.cpp"]
# nvcc compiles only the torch-free kernels (*.cu, one per kernel family, direction and dtype, so
# ninja runs them in parallel); the torch bindings are host-compiled .cpp (nvcc compiling ATen
# headers was most of the build time, issue 32).
CUDA_SOURCES = ["cuda/module_cuda.cpp", "cuda/sparse_binding.cpp", "cuda/attention_binding.cpp",
                "cuda/sparse_kernels.cu", "cuda/attention_fwd_f32.cu", "cuda/attention_fwd_bf16.cu",
                "cuda/attention_bwd_f32.cu", "cuda/attention_bwd_bf16.cu"]
CXX_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr"]


def _rel(name: str) -> str:
    # setuptools wants paths relative to setup.py's directory.
    return os.path.relpath(CSRC / name, Path.cwd())


def want_cuda() -> bool:
    """CUDA kernels need a CUDA build of torch and nvcc; a GPU is needed unless forced."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return False
    forced = os.environ.get("FORCE_CUDA", "0") == "1" or bool(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if torch.version.cuda is None or CUDA_HOME is None:
        if forced:
            warnings.warn("FORCE_CUDA/TORCH_CUDA_ARCH_LIST set but torch or nvcc lacks CUDA; "
                          "building the CPU kernels only")
        return False
    return forced or torch.cuda.is_available()


def extension_modules() -> list:
    try:
        from torch.utils.cpp_extension import CppExtension, CUDAExtension
    except ImportError:  # no torch at metadata time: package installs, extension is absent
        return []
    include = [str(CSRC)]
    mods = [CppExtension(
        CPU_EXT, [_rel(s) for s in CPU_SOURCES], include_dirs=include,
        extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=["-fopenmp"])]
    if want_cuda():
        mods.append(CUDAExtension(
            CUDA_EXT, [_rel(s) for s in CUDA_SOURCES], include_dirs=include,
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS}))
    return mods


def build_ext_cmdclass() -> dict:
    try:
        from torch.utils.cpp_extension import BuildExtension
    except ImportError:
        return {}

    class OptionalBuildExtension(BuildExtension):
        """A failed kernel build warns instead of failing the install: the package then runs
        its (slower) reference path.  LDSPARSE_STRICT_BUILD=1 makes the failure fatal."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # CompileError, ninja's CalledProcessError, ...
                if os.environ.get("LDSPARSE_STRICT_BUILD", "0") == "1":
                    raise
                what = ("the CUDA kernels (CUDA tensors take the slow reference path; the CPU "
                        "kernels are unaffected)" if ext.name == CUDA_EXT else
                        "the CPU kernels (lightning_dynmo.sparse uses its slow pure-torch reference path)")
                msg = f"building {ext.name} failed, so {what}: {exc}"
                # pip hides warnings of a successful build; stderr lines with this prefix show
                # in its output with -v and in the build log.
                print(f"lightning_dynmo: WARNING: {msg}", file=sys.stderr, flush=True)
                warnings.warn(msg)

    return {"build_ext": OptionalBuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}
