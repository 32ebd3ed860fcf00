"""Hugging Face causal LMs on the pipeline (``pip install -e ".[hf]"``): ``arch`` (supported
architectures and their module names), ``checkpoint`` (reading safetensors layer by layer),
``layers`` (one pipeline layer per stage-able piece), ``model`` (:class:`HFCausalLM`) and
``export`` (back to Hugging Face's format). Importing it works without ``transformers``; building
a model needs it."""
from .arch import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError
from .checkpoint import CheckpointFileError
from .layers import (HFDecoderLayer, HFEmbedding, HFFinalNorm, HFHead, HFPaddedDecoderLayer, HFPaddedEmbedding,
                     HFPaddedFinalNorm, router_balance_loss)
from .model import CheckpointMismatchError, HFCausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointFileError",
    "CheckpointMismatchError",
    "HFCausalLM",
    "HFDecoderLayer",
    "HFEmbedding",
    "HFFinalNorm",
    "HFHead",
    "HFPaddedDecoderLayer",
    "HFPaddedEmbedding",
    "HFPaddedFinalNorm",
    "UnsupportedArchitectureError",
    "router_balance_loss",
]
