r"""``model=hf``: a Hugging Face causal LM from a local directory in the GPT recipe.

    python recipes/train_gpt.py model=hf model.path=/path/to/model   # config.json + model.safetensors

Supported: the ``model_type``\ s of ``lightning_dynmo.models.hf.SUPPORTED_ARCHITECTURES`` (GPT-2,
GPT-NeoX, the Llama family, Gemma, Granite, Cohere, ...; ``pip install -e ".[hf]"``). Under the pipeline strategy the
model is built on the meta device, so each rank reads and holds only the layers it owns. The recipe's data are bytes
(token ids 0..255): fine for trying the pipeline on a real architecture, not for continuing a pretrained model on its
own tokenizer's text.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf

HF_KEYS = ("kind", "path", "config", "untie_embeddings", "router_aux_loss", "head_chunks", "attn_implementation", "lr",
           "min_lr", "warmup_steps", "weight_decay")


def is_hf(cfg: DictConfig) -> bool:
    return cfg.model.get("kind") == "hf"


def check_hf_keys(cfg: DictConfig) -> None:
    unknown = sorted(k for k in cfg.model.keys() if k not in HF_KEYS)
    if unknown:
        raise ValueError(f"unknown model key(s) {unknown}: model=hf takes {', '.join(HF_KEYS)} "
                         "(config: overrides of the checkpoint's config.json, e.g. model.config.resid_pdrop=0.0)")
    if OmegaConf.is_missing(cfg.model, "path") or not cfg.model.path:
        raise ValueError("model=hf needs a local model directory: model.path=/path/to/model "
                         "(config.json + model.safetensors, as save_pretrained writes it)")
    path = Path(to_absolute_path(str(cfg.model.path)))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path} is not a Hugging Face model directory (no config.json)")


def build_hf_model(cfg: DictConfig):
    """``HFCausalLM.from_pretrained(model.path, ...)``; on the meta device under DynMoStrategy."""
    import torch

    from lightning_dynmo.models.hf import HFCausalLM

    check_hf_keys(cfg)
    m = cfg.model
    pipeline = str(cfg.strategy.get("_target_", "")).endswith("DynMoStrategy")
    node = m.get("config")
    overrides = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    with torch.device("meta") if pipeline else contextlib.nullcontext():
        model = HFCausalLM.from_pretrained(
            to_absolute_path(str(m.path)), config=overrides or None, lr=float(m.lr), min_lr=float(m.min_lr),
            warmup_steps=int(m.warmup_steps), weight_decay=float(m.weight_decay), seed=int(cfg.seed),
            untie_embeddings=bool(m.get("untie_embeddings", True)),
            router_aux_loss=m.get("router_aux_loss"),  # Mixtral: None follows config.output_router_logits
            head_chunks=m.head_chunks, attn_implementation=m.get("attn_implementation"),
        )
    hf = model.hf_config
    if hf.vocab_size < 256:
        raise ValueError(f"byte-level data needs vocab_size >= 256, the model has {hf.vocab_size}")
    positions = getattr(hf, "n_positions", None) or getattr(hf, "max_position_embeddings", None)
    if positions is not None and positions < cfg.data.block_size:
        raise ValueError(f"the model takes at most {positions} positions, data.block_size={cfg.data.block_size}; "
                         f"set data.block_size<={positions}")
    return model
