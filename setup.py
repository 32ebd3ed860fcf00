"""Build script: the Python package plus the optional sparse-kernel extension (cpp/).

Install with ``pip install torch==2.13.0 && pip install --no-build-isolation -e .[dev]`` so the
extension compiles against the torch already installed (never a freshly downloaded one).
"""
import os
from setuptools import find_packages, setup

from cpp.build import extension_modules, build_ext_cmdclass  # noqa: E402  (owned by cpp/)

HF_REQUIRES = ["transformers>=5.0", "safetensors>=0.4"]  # neither pulls torch
# LightningCLI (recipes/cli_gpt.py); the range of lightning 2.6's own extra, pulls no torch
CLI_REQUIRES = ["jsonargparse[signatures]>=4.39.0,<5.0"]

setup(
    name="lightning_dynmo",
    version="0.1.0",
    description="Pipeline-parallel Lightning strategy that rebalances dynamic models while they train",
    packages=find_packages(include=["lightning_dynmo", "lightning_dynmo.*"]),
    package_data={"lightning_dynmo.sim.scenarios": ["profiles/*.json"]},  # the measured per-layer profile
    python_requires=">=3.11",
    install_requires=[
        # the lowest torch is tested by scripts/test_lowest_torch.sh (CI); install torch==2.13.0
        # first (the local CPU wheel): a satisfied range pulls nothing
        "torch>=2.10",
        "lightning>=2.6,<2.7",
        "torchmetrics>=1.4",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "tensorboard>=2.15",
        "matplotlib>=3.8",
    ],
    extras_require={
        # lightning_dynmo.models.hf (Hugging Face GPT-2 / Llama / Mistral); tested with transformers 5.24
        "hf": HF_REQUIRES,
        # Lightning's own command line, LightningCLI (its `jsonargparse[signatures]` requirement)
        "cli": CLI_REQUIRES,
        # the test suite runs the Hugging Face and LightningCLI tests too, so a clean clone skips only CUDA tests
        # and the linter and type checker .ci/run runs first (ruff.toml, mypy.ini); neither pulls torch
        "dev": ["pytest>=8", "hypothesis>=6", "pybind11>=2.12", "ninja", "ruff>=0.17,<0.18", "mypy>=2.4,<2.5",
                *HF_REQUIRES, *CLI_REQUIRES],
    },
    # DYNMO_SKIP_EXTENSION=1: no kernels (scripts/test_lowest_torch.sh's second environment, whose
    # torch must not rebuild the in-tree module the main environment imports)
    ext_modules=[] if os.environ.get("DYNMO_SKIP_EXTENSION") == "1" else extension_modules(),
    cmdclass=build_ext_cmdclass(),
    zip_safe=False,
)
