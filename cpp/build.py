"""Extension list for setup.py: the sparse-kernel extension `lightning_dynmo.sparse._C`.

Why the care: the build must never break `pip install -e .`.  If torch is missing the
extension is skipped (the package falls back to a pure-torch path).  CUDA sources are
compiled only with a CUDA torch and nvcc present (FORCE_CUDA=1 / TORCH_CUDA_ARCH_LIST
honoured, as in torchvision).  Flags stay portable: -O3 + OpenMP, no -march=native;
wider ISAs come from per-file `#pragma GCC target` plus run-time dispatch.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
EXT_NAME = "lightning_dynmo.sparse._C"
CPU_SOURCES = ["ops.cpp", "sparse_cpu.cpp", "cpu_kernels_default.cpp", "cpu_kernels_avx2.cpp",
               "cpu_kernels_avx512.cpp",
               # block-sparse causal attention (issue 12)
               "attention_cpu.cpp", "attention_kernels_default.cpp", "attention_kernels_avx2.cpp",
               "attention_kernels_avx512.cpp"]
CUDA_SOURCES = ["cuda/sparse_cuda.cu", "cuda/attention_cuda.cu"]
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
    if want_cuda():
        return [CUDAExtension(
            EXT_NAME, [_rel(s) for s in CPU_SOURCES + CUDA_SOURCES], include_dirs=include,
            define_macros=[("LDSPARSE_WITH_CUDA", None)],
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
            extra_link_args=["-fopenmp"])]
    return [CppExtension(
        EXT_NAME, [_rel(s) for s in CPU_SOURCES], include_dirs=include,
        extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=["-fopenmp"])]


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
                warnings.warn(f"building {ext.name} failed ({exc}); lightning_dynmo.sparse will "
                              "use its slow pure-torch reference path")

    return {"build_ext": OptionalBuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}
