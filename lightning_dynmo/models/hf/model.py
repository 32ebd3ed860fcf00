"""Hugging Face causal language models on the pipeline (``pip install -e ".[hf]"``).

:class:`HFCausalLM` turns a ``transformers`` causal LM into the pipeline protocol, one
single-tensor layer per stage-able piece::

    [HFEmbedding] + [HFDecoderLayer] * num_hidden_layers + [HFFinalNorm] + [HFHead]

or, with ``head_chunks=k > 1``, ``... + [HFFinalNorm] + [HeadChunk] * k`` (see "Chunked LM head" below).

* :class:`HFEmbedding`: token embedding (GPT-2: plus learned positions, then dropout).
* :class:`HFDecoderLayer` wraps one of the model's own decoder layers (``GPT2Block``,
  ``LlamaDecoderLayer``, ``MistralDecoderLayer``), which take keyword arguments and (depending on
  the ``transformers`` version) return a tuple. The wrapper maps one hidden-state tensor to the
  next: it builds the position ids (``0..T-1``), the attention mask the model's own forward would
  build (``transformers.masking_utils``: none for SDPA's causal kernel, a sliding-window mask for
  Mistral when the sequence exceeds the window, a 4-D mask for eager attention), and, for
  rotary models, the cos/sin from a copy of the model's rotary embedding it holds itself (so a
  layer runs on any rank, alone).
* :class:`HFFinalNorm` and :class:`HFHead`: the final norm and the LM head.

The submodules are the model's own (same classes, same parameter names below the wrapper), so
the numerics are those of ``AutoModelForCausalLM``'s forward, and the weights map one to one onto
the Hugging Face names (:meth:`HFCausalLM.hf_state_dict`).

**Tied embeddings.** GPT-2 (and some Llama checkpoints) tie the LM head to the token embedding.
The pipeline puts them in different stages, so by default they are *untied*: the head starts as a
copy of the embedding and the two train separately from then on (a warning says so once);
:meth:`HFCausalLM.save_pretrained` then writes ``tie_word_embeddings=False`` and both matrices,
which ``transformers`` loads as an untied model. ``untie_embeddings=False`` keeps them one
parameter, for strategies that synchronise shared parameters (a real-device build only).

**Chunked LM head.** ``HFCausalLM(..., head_chunks=k)`` (default 1: the one ``HFHead`` above,
cross-entropy in ``pipeline_loss``) replaces the LM head and its cross-entropy by ``k`` pipeline
layers over vocabulary slices of the model's ``lm_head.weight``
(:class:`~lightning_dynmo.models.vocab_head.HeadChunk`, as ``GPTConfig(head_chunks=k)``): the
targets enter the pipeline with the token ids (``pipeline_inputs``) and pass the embedding, the
decoder layers and the final norm untouched (the norm runs once, before chunk 0); the chunks carry
an online softmax and the last returns the per-token loss, which ``pipeline_loss`` averages over
the targets that are not -100 (as the unchunked ``F.cross_entropy``). The ``tokens x vocab``
logits never exist in training; loss and gradients equal the unchunked head's within fp32
rounding. Each chunk is initialised with (reads from the checkpoint) its rows of the whole head
matrix, so it starts from the unchunked model's values, and ``state_dict()`` names the rows as one
``layers.<num_hidden_layers + 2>.lm_head.weight`` whatever ``k`` (:meth:`HFCausalLM.checkpoint_merges`):
checkpoints, ``hf_state_dict`` and ``save_pretrained`` are those of the unchunked model, and a run
resumes under another ``k``. A tied head (GPT-2's default) is chunked after untying
(``untie_embeddings=True``, the default); ``untie_embeddings=False`` with ``k > 1`` is refused. An
LM head with a bias is refused (none of the supported architectures has one).

**Padding.** ``HFCausalLM(..., pad_token_id=p)`` treats tokens ``p`` as padding (Megatron derives
its masks from a token id the same way): the embedding layer returns ``(h, keep)`` with
``keep = ids != p`` (:class:`~lightning_dynmo.models.hf.layers.HFPaddedEmbedding`), the pair crosses
stages as a tuple activation, and every decoder layer builds the mask the model's own forward
builds for ``attention_mask=keep`` (left or right padding; positions stay ``0..T-1``, as that
forward's without ``position_ids``). Pick an id that real text does not contain (GPT-2's usual
``pad = eos`` would mask every end-of-text token too). A Mixtral router loss counts padding tokens
(HF's pooled loss drops them).

**Loading.** ``HFCausalLM.from_pretrained(path)`` reads ``config.json`` and the weights
(``model.safetensors``, sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``) from a
local directory; no network access. The model is built on the meta device and each layer reads
only its own tensors (:meth:`HFCausalLM.init_pipeline_layer`), so under
``trainer.init_module(empty_init=True)`` with ``DynMoStrategy`` every rank reads and holds only the
layers it owns. Every checkpoint tensor's shape is checked against the config up front (from the
file headers, on every rank) and a mismatch is reported by name.

Supported architectures: :data:`~lightning_dynmo.models.hf.SUPPORTED_ARCHITECTURES`
(:mod:`~lightning_dynmo.models.hf.arch` says what each adds outside its modules).
Mixtral is Mistral with a sparse MoE block (``MixtralSparseMoeBlock``: top-k router + fused
experts) in every decoder layer; its published files store the experts per expert, which
:mod:`~lightning_dynmo.models.hf.checkpoint` fuses per layer on load and splits on save.

**Mixtral's router loss under the pipeline**: per layer and per sequence, so pipeline training
equals single-process training (:func:`~lightning_dynmo.models.hf.layers.router_balance_loss`
says how it relates to ``MixtralForCausalLM``'s pooled loss).

Mixtral's block is dropless: every token goes through exactly ``k`` experts, so a layer's work
does not change with the routing and its layers do not report a load factor (``ReportsLoad``).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
import torch
import torch.nn.functional as F
from torch import nn

from ...protocol import layer_seed, materialize_layer, run_layers
from .._aux_loss import configure_aux_loss, reset_aux_loss
from .._lm import CausalLMModule
from ..vocab_head import (
    HeadChunk, check_head_chunks, head_chunk_layers, head_merges, logits_through, merge_head_hook, split_head_hook,
    streaming_nll_mean)
from . import export
from .arch import SUPPORTED_ARCHITECTURES, layer_kinds, load_config
from .checkpoint import DISK_LAYOUTS, CheckpointReader
from .layers import (HFDecoderLayer, HFEmbedding, HFFinalNorm, HFHead, HFPaddedDecoderLayer, HFPaddedEmbedding,
                     HFPaddedFinalNorm)

try:  # optional dependency: pip install -e ".[hf]"
    import transformers
    from transformers import AutoModelForCausalLM, PretrainedConfig
except ImportError:  # pragma: no cover - exercised where transformers is missing
    transformers = None
    PretrainedConfig = Any  # type: ignore[misc,assignment]

__all__ = ["CheckpointMismatchError", "HFCausalLM"]


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the shapes its config asks for (or some are missing)."""


def _require_transformers() -> None:
    if transformers is None:
        raise ImportError(
            "lightning_dynmo.models.hf needs the `transformers` package: pip install -e \".[hf]\" "
            "(or pip install transformers)"
        )


def _get(module: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        module = getattr(module, part)
    return module


# ------------------------------------------------------------------ the LightningModule
class HFCausalLM(CausalLMModule):
    """A ``transformers`` causal LM (any of :data:`SUPPORTED_ARCHITECTURES`) exposing the pipeline protocol.

    Args:
        model_path: local directory with ``config.json`` and weights (what ``save_pretrained``
            writes); or ``None`` with ``config`` for a randomly initialised model.
        config: a ``PretrainedConfig`` or a dict of its fields (``model_type`` included) when
            ``model_path`` is ``None``; with it, a dict of overrides of the saved config (e.g.
            ``{"resid_pdrop": 0.0}``).
        seed: random init only: layer ``i`` is drawn from a generator seeded by ``(seed, i)``,
            with the model's own ``_init_weights`` rules.
        untie_embeddings: untie a tied LM head from the token embedding (see module docstring).
        attn_implementation: ``"sdpa"``, ``"eager"``, or any ``transformers`` backend; ``None``
            (default): ``"sdpa"`` where the architecture supports it, else ``"eager"`` (Gemma 2).
        router_aux_loss: MoE models (Mixtral): train with the per-layer router load-balancing loss
            weighted by the config's ``router_aux_loss_coef`` (see the module docstring); ``None``
            follows the config's ``output_router_logits``.
        pad_token_id: tokens with this id are padding: no query attends to them, as in the
            model's own forward with ``attention_mask = ids != pad_token_id`` (see the module
            docstring); ``None`` (default): every token is real. Give padded positions the target
            -100 so they add no loss.
        head_chunks: ``k > 1`` makes the LM head and its loss ``k`` pipeline layers over vocabulary
            slices with a streaming cross-entropy (see the module docstring); 1 (default): one head
            layer. Needs an untied head (``untie_embeddings=True`` or ``tie_word_embeddings=False``).
        lr, min_lr, warmup_steps, max_steps, weight_decay, betas, eps: AdamW with linear warmup
            and cosine decay, as :class:`~lightning_dynmo.models.GPT`.
    """

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        config: PretrainedConfig | Mapping | None = None,
        lr: float = 3e-4,
        min_lr: float | None = None,
        warmup_steps: int = 0,
        max_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        seed: int = 0,
        untie_embeddings: bool = True,
        attn_implementation: str | None = None,
        router_aux_loss: bool | None = None,
        head_chunks: int = 1,
        pad_token_id: int | None = None,
    ):
        _require_transformers()
        super().__init__()
        path = model_path = None if model_path is None else str(model_path)
        overrides = None
        if config is not None and not isinstance(config, Mapping):
            overrides = config.to_dict()
        elif config is not None:
            overrides = dict(config)
        betas = tuple(float(b) for b in betas)  # noqa: F841 - saved by save_hyperparameters
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = overrides
        self.hf_config = load_config(path, overrides, attn_implementation)
        cfg = self.hf_config
        self.arch = arch = SUPPORTED_ARCHITECTURES[cfg.model_type]
        self._init_seed = int(seed)
        self._tied = bool(getattr(cfg, "tie_word_embeddings", False))
        check_head_chunks(head_chunks, cfg.vocab_size)
        self.head_chunks = head_chunks
        if pad_token_id is not None and (isinstance(pad_token_id, bool) or int(pad_token_id) != pad_token_id
                                         or not 0 <= pad_token_id < cfg.vocab_size):
            raise ValueError(f"pad_token_id must be a token id in [0, vocab_size={cfg.vocab_size}) or None, "
                             f"got {pad_token_id!r}")
        padded = pad_token_id is not None
        if self.head_chunks > 1 and self._tied and not untie_embeddings:
            raise ValueError(
                f"head_chunks={self.head_chunks} needs an LM head of its own, but untie_embeddings=False keeps "
                f"{cfg.model_type}'s head tied to the token embedding (a chunked head splits it into one parameter "
                "per vocabulary slice). Pass untie_embeddings=True (the default), set tie_word_embeddings=False "
                "in the config, or use head_chunks=1")
        self._checkpoint = None if path is None else CheckpointReader(
            Path(path), DISK_LAYOUTS.get(cfg.model_type),
            tied_head=(f"{arch.head}.weight", f"{arch.embeddings[0][1]}.weight") if self._tied else None)
        aux_coeff = self._router_aux_coeff(router_aux_loss)

        real = torch.empty(0).device.type != "meta"  # the ambient device (meta under init_module(empty_init=True))
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(cfg)
        rotary = _get(skeleton, arch.rotary) if arch.rotary else None
        rotary_cls = type(rotary) if rotary is not None else None
        embeds = {name: _get(skeleton, p) for name, p in arch.embeddings}
        dropout = float(getattr(cfg, arch.embed_dropout, 0.0) or 0.0) if arch.embed_dropout else 0.0
        max_positions = getattr(cfg, "n_positions", None) if len(embeds) > 1 else None
        scale = arch.embedding_scale(cfg)
        layers: list[nn.Module] = [HFPaddedEmbedding(embeds, dropout, max_positions, pad_token_id, scale) if padded
                                   else HFEmbedding(embeds, dropout, max_positions, scale)]
        decoder = HFPaddedDecoderLayer if padded else HFDecoderLayer
        for block, (layer_type, sliding) in zip(_get(skeleton, arch.layers), layer_kinds(cfg), strict=True):
            with torch.device("meta"):
                rot = rotary_cls(cfg) if rotary_cls is not None else None
            layers.append(decoder(block, cfg, rot, sliding, arch.router, aux_coeff, layer_type))
        layers.append((HFPaddedFinalNorm if padded else HFFinalNorm)(_get(skeleton, arch.norm)))
        head = _get(skeleton, arch.head)
        embedding = layers[0].get_submodule(arch.embeddings[0][0])
        if head.weight is embedding.weight:
            if untie_embeddings:
                head.weight = nn.Parameter(torch.empty_like(head.weight, device="meta"))
                _warn_untied(cfg)
            elif not real:
                raise ValueError("untie_embeddings=False keeps the LM head tied to the embedding, which a meta-device "
                                 "build cannot materialise layer by layer; build the model on a real device")
        scaled_head = HFHead(head, *arch.logit_scales(cfg))
        if self.head_chunks == 1:
            layers.append(scaled_head)
        else:
            if scaled_head.scales_logits:
                raise ValueError(f"head_chunks > 1 does not support {cfg.model_type}'s logit scaling or soft-capping "
                                 "(the chunked cross-entropy takes the head's raw logits); use head_chunks=1")
            if getattr(head, "bias", None) is not None:
                raise ValueError(f"head_chunks > 1 does not support an LM head with a bias ({cfg.model_type}); "
                                 "use head_chunks=1")
            with torch.device("meta"):  # each chunk gets its rows of the head in init_pipeline_layer
                layers += head_chunk_layers(head.in_features, head.out_features, self.head_chunks, head.weight.dtype)
        del skeleton
        self.layers = nn.ModuleList(layers)
        if self.head_chunks > 1:  # checkpoints name the head as one matrix, whatever head_chunks is
            self._register_state_dict_hook(merge_head_hook)
            self._register_load_state_dict_pre_hook(split_head_hook, with_module=True)
        self._init_eval_metric(head.out_features)
        if self._checkpoint is not None:
            self._check_checkpoint()
        if real:  # single process (or a build on a real device): initialise every layer now
            for i, layer in enumerate(self.layers):
                materialize_layer(self, i, layer, "cpu")
            if self._tied and not untie_embeddings:  # head_chunks == 1 (checked above)
                self.layers[-1].lm_head.weight = self.layers[0].get_submodule(arch.embeddings[0][0]).weight

    def _router_aux_coeff(self, enabled: bool | None) -> float:
        """Each MoE layer's weight of its router loss: ``router_aux_loss_coef / num_hidden_layers``
        (the mean over layers), or 0 when off."""
        cfg = self.hf_config
        if self.arch.router is None:
            if enabled:
                raise ValueError(f"router_aux_loss=True needs an MoE model; {cfg.model_type} has no router")
            return 0.0
        on = bool(getattr(cfg, "output_router_logits", False)) if enabled is None else bool(enabled)
        coef = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
        if coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0 (0 turns the router loss off), got {coef}")
        return coef / cfg.num_hidden_layers if on else 0.0

    def on_train_start(self) -> None:
        # Lightning divides the loss by accumulate_grad_batches and multiplies it by the fp16 grad
        # scaler's scale before backward; the router loss enters in backward and must be scaled
        # the same way (see models/_aux_loss.py)
        configure_aux_loss(self.trainer)

    def on_train_end(self) -> None:
        reset_aux_loss()  # the aux-loss scaling is process-wide: leave none behind after fit

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs) -> "HFCausalLM":
        """The model saved in the local directory ``path`` (see :class:`HFCausalLM`)."""
        return cls(model_path=path, **kwargs)

    @property
    def head_index(self) -> int:
        """Index of the (first) LM head layer: its init seed and its ``state_dict`` key."""
        return self.hf_config.num_hidden_layers + 2

    def _hf_key(self, index: int, name: str) -> str:
        """The Hugging Face state-dict key of ``name`` inside pipeline layer ``index`` (every head
        chunk's weight is a slice of ``lm_head.weight``)."""
        attr, _, rest = name.partition(".")
        if index == 0:
            return f"{dict(self.arch.embeddings)[attr]}.{rest}"
        if index == self.head_index - 1:
            return f"{self.arch.norm}.{rest}"
        if index >= self.head_index:
            return f"{self.arch.head}.{rest}"
        return f"{self.arch.layers}.{index - 1}.{rest}"

    def _layer_shapes(self, index: int, layer: nn.Module) -> dict[str, tuple[int, ...]]:
        """``{HF key: shape}`` of the persistent tensors of pipeline layer ``index`` (a head chunk:
        the whole head matrix it takes its rows from)."""
        if isinstance(layer, HeadChunk):
            return {f"{self.arch.head}.weight": (layer.vocab_size, layer.lm_head.in_features)}
        return {self._hf_key(index, name): tuple(t.shape) for name, t in layer.state_dict(keep_vars=True).items()}

    def _check_checkpoint(self) -> None:
        """Every tensor this config needs is in the checkpoint, with the config's shape (read from
        the file headers only)."""
        expected = {k: s for i, layer in enumerate(self.layers) for k, s in self._layer_shapes(i, layer).items()}
        missing, wrong = self._checkpoint.mismatches(expected)
        blocks = self.hf_config.num_hidden_layers
        extra = self._checkpoint.extra_layer_keys(self.arch.layers, blocks)
        if wrong or missing or extra:
            cfg = self.hf_config
            sizes = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "num_local_experts",
                                                   "n_embd", "n_layer", "n_positions") if hasattr(cfg, k)}
            parts = []
            if wrong:
                parts.append(f"{len(wrong)} tensor(s) have other shapes than the config asks for: {wrong[:5]}")
            if missing:
                parts.append(f"{len(missing)} tensor(s) are missing: {missing[:5]}")
            if extra:
                parts.append(f"it holds layers beyond the config's {blocks}, which would be dropped: "
                             f"{extra[:5]}")
            raise CheckpointMismatchError(
                f"the checkpoint in {self._checkpoint.path} does not match its config ({sizes}): " + "; ".join(parts)
                + ". Use the config.json saved with these weights"
            )

    # ------------------------------------------------------------------ layer init (meta-device protocol)
    @torch.no_grad()
    def init_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        """Fill pipeline layer ``index`` from the checkpoint (only its own tensors are read), or,
        without a checkpoint, with the model's ``_init_weights`` from a generator seeded by
        ``(seed, index)``. Rotary buffers are recomputed from the config. A head chunk takes its
        rows of the whole head, initialised as the unchunked head layer (index :attr:`head_index`)."""
        if isinstance(layer, HeadChunk):
            whole = nn.Linear(layer.lm_head.in_features, layer.vocab_size, bias=False, device="meta",
                              dtype=layer.lm_head.weight.dtype).to_empty(device="cpu")  # no draw from the global RNG
            self.init_pipeline_layer(self.head_index, HFHead(whole))
            layer.copy_rows_from(whole.weight)
            return
        if self._checkpoint is not None:
            tensors = self._checkpoint.load(self._layer_shapes(index, layer))
            loaded = layer.state_dict(keep_vars=True)
            for name, t in loaded.items():
                t.copy_(tensors[self._hf_key(index, name)])
            self._init_computed_buffers(layer, loaded.values())
        else:
            host = self._init_host()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(layer_seed(self._init_seed, index))
                for m in layer.modules():
                    if m is not layer and not isinstance(m, (HFEmbedding, HFDecoderLayer, HFFinalNorm, HFHead)):
                        host._init_weights(m)
        if isinstance(layer, HFDecoderLayer) and layer.rotary is not None:
            with torch.device("cpu"):
                fresh = type(layer.rotary)(self.hf_config)
            for name, buf in layer.rotary.named_buffers():
                buf.copy_(fresh.get_buffer(name))

    def _init_computed_buffers(self, layer: nn.Module, loaded) -> None:
        """Fill the tensors a checkpoint does not hold (non-persistent buffers computed from the
        config, e.g. Gemma's embedding scale) as ``transformers``' loading does: the loaded ones are
        flagged ``_is_hf_initialized``, which the model's ``_init_weights`` leaves alone."""
        loaded = list(loaded)
        for t in loaded:
            t._is_hf_initialized = True
        try:
            for m in layer.modules():  # only modules that own such a buffer (never our wrappers)
                if m._non_persistent_buffers_set:
                    self._init_host()._init_weights(m)
        finally:
            for t in loaded:
                del t._is_hf_initialized

    def _init_host(self):
        """A tensor-free model of this config with no decoder layers: its ``_init_weights`` holds
        the architecture's init rules (they read only the config)."""
        host = self.__dict__.get("_hf_init_host")
        if host is None:
            cfg = copy.deepcopy(self.hf_config)
            with torch.device("meta"):
                host = AutoModelForCausalLM.from_config(cfg)
            self.__dict__["_hf_init_host"] = host
        return host

    # ------------------------------------------------------------------ protocol
    def pipeline_layers(self) -> nn.ModuleList:
        return self.layers

    def pipeline_inputs(self, ids: torch.Tensor, targets: torch.Tensor):
        """What enters the first layer: the token ids, and with a chunked head also the targets
        (carried past the other layers to the head chunks, see protocol/activations.py)."""
        return ids if self.head_chunks == 1 else (ids, targets)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy over the targets that are not -100 (with a chunked head: the
        same mean of the last chunk's per-token loss)."""
        if self.head_chunks > 1:
            return streaming_nll_mean(output, target)
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def checkpoint_merges(self) -> dict[str, list[tuple[str, int]]]:
        """The chunked head's rows as one ``layers.<head_index>.lm_head.weight`` in checkpoints
        (protocol/merges.py); none for one head layer."""
        return head_merges(self.head_index, self.hf_config.vocab_size, self.head_chunks)

    def lm_loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.head_chunks == 1:
            return super().lm_loss(ids, targets)
        return self.pipeline_loss(run_layers(self.layers, self.pipeline_inputs(ids, targets)), targets)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` (with a chunked head built from its slices: inspection and sampling)."""
        return logits_through(self.layers, self.head_chunks, ids)

    # ------------------------------------------------------------------ export (models/hf/export.py)
    def hf_state_dict(self, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The weights under their Hugging Face names, from ``state_dict`` (this module's format,
        e.g. ``strategy.lightning_module_state_dict()`` on rank 0 or a Lightning checkpoint's
        ``state_dict``) or from this module, which must then hold every layer."""
        return export.hf_state_dict(self, state_dict)

    def save_pretrained(self, directory: str | os.PathLike,
                        state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the format ``from_pretrained`` (ours and
        ``transformers.AutoModelForCausalLM``'s) reads; Mixtral's experts per expert, as the published
        files and ``transformers``' own ``save_pretrained`` store them. An untied model is saved
        with ``tie_word_embeddings=False``."""
        export.save_pretrained(self, directory, state_dict)


def _warn_untied(cfg) -> None:
    rank_zero_warn(
        f"HFCausalLM: {cfg.model_type} ties its LM head to the token embedding; they are untied for the pipeline "
        "(the head starts as a copy of the embedding and trains separately). save_pretrained writes "
        "tie_word_embeddings=False. Pass untie_embeddings=False to keep them tied on a real-device build.",
        category=UserWarning,
    )
