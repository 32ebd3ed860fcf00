"""Writing an :class:`~lightning_dynmo.models.hf.HFCausalLM` back in Hugging Face's format: its
weights under their ``transformers`` names (a chunked head's rows joined into one matrix) and a
``save_pretrained`` directory that ``transformers.AutoModelForCausalLM`` loads. The model comes in
as an argument (``model.py`` calls these), so this module does not import it."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from ...protocol import RemoteLayer
from ...protocol.merges import merge_state
from .checkpoint import DISK_LAYOUTS

__all__ = ["hf_state_dict", "save_pretrained"]


def hf_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """See :meth:`HFCausalLM.hf_state_dict`."""
    if state_dict is None:
        remote = [i for i, layer in enumerate(model.layers) if isinstance(layer, RemoteLayer)]
        if remote:
            raise ValueError(
                f"this rank holds only part of the model (layers {remote} live on other ranks): pass the full "
                "state dict, e.g. trainer.strategy.lightning_module_state_dict() on rank 0, or a checkpoint's "
                "['state_dict']"
            )
        state_dict = model.state_dict()
    state_dict = merge_state(state_dict, model.checkpoint_merges())  # a chunked head's rows: one matrix
    attr = "layers."
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not key.startswith(attr):
            continue
        index, _, name = key[len(attr):].partition(".")
        out[model._hf_key(int(index), name)] = value.detach().cpu().contiguous()
    return out


def save_pretrained(model: nn.Module, directory: str | os.PathLike,
                    state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
    """See :meth:`HFCausalLM.save_pretrained`."""
    from safetensors.torch import save_file

    tensors = hf_state_dict(model, state_dict)
    embed_key = f"{model.arch.embeddings[0][1]}.weight"
    head_key = f"{model.arch.head}.weight"
    head, embed = tensors.get(head_key), tensors.get(embed_key)
    tied = head is not None and embed is not None and head.data_ptr() == embed.data_ptr()
    cfg = copy.deepcopy(model.hf_config)
    cfg.tie_word_embeddings = tied
    if tied:
        del tensors[head_key]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(directory)
    layout = DISK_LAYOUTS.get(cfg.model_type)
    if layout is not None:  # the published format (what transformers' own save_pretrained writes)
        tensors = layout.to_disk(tensors)
    save_file({k: v.clone() for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
