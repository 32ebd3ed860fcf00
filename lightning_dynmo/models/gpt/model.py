"""nanoGPT-style pre-LN decoder laid out as an ordered list of single-tensor layers.

The dynmo strategy splits ``pipeline_layers()`` into contiguous stages; every layer here maps one
tensor to one tensor:

    [Embedding(tok+pos)] + [Block] * n_layer + [FinalNorm] + [Head]      (L = n_layer + 3)

With ``GPTConfig(head_chunks=k)`` the head is ``k`` ``HeadChunk`` layers (models/vocab_head.py,
``L = n_layer + 2 + k``) and the targets enter the pipeline with the tokens (``pipeline_inputs``),
passing through the other layers untouched (protocol/activations.py).

Pipeline protocol (what the strategy relies on):

* ``pipeline_layers()`` returns the registered ``self.layers`` ModuleList (same object each call).
  The model keeps no other reference to a layer (no aliases, no weight tying), so the strategy
  may swap entries it does not own for placeholders.
* ``pipeline_loss(output, target)``: mean token cross-entropy, a scalar (with a chunked head: the
  mean of the last chunk's per-token loss); targets equal to -100 are ignored either way.
* Batches are ``(inputs, targets)`` int64 ``[B, T]`` tuples.
* ``configure_optimizers()`` only looks at ``self.parameters()`` (trainable ones), so it works on
  any subset of layers; decay/no-decay membership is a rule on the parameter (``ndim >= 2``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...protocol import layer_seed, run_layers
from .._init_draws import normal_from_
from .._lm import CausalLMModule
from ..vocab_head import (
    HeadChunk, head_chunk_layers, head_merges, logits_through, merge_head_hook, split_head_hook, streaming_nll_mean)
from .config import GPTConfig
from .granularity import apply_granularity, skip_draws, state_dict_key
from .hash_attention import HashSparseSelfAttention, SparseAttentionBlock, set_hash_step
from .layers import MLP, Block, CausalSelfAttention, Embedding, FinalNorm, Head

__all__ = ["GPT"]


class GPT(CausalLMModule):
    """Byte/token-level GPT exposing the dynmo pipeline protocol (see module docstring); training,
    evaluation and optimizer hooks from :class:`CausalLMModule`."""

    _head_chunks_supported = True  # subclasses that rebuild the last layers set False

    def __init__(
        self,
        config: GPTConfig | dict | str | None = None,
        lr: float = 6e-4,
        min_lr: float = 6e-5,
        warmup_steps: int = 10,
        max_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        seed: int | None = None,
    ):
        super().__init__()
        cfg = GPTConfig.from_any(config)
        config = cfg.to_dict()  # noqa: F841  -- save_hyperparameters reads this local (a dict)
        betas = tuple(float(b) for b in betas)
        self.save_hyperparameters()
        self.config = cfg

        # Each layer is initialised from its own generator seeded by (seed, layer index), so a rank
        # that builds only its own layers gets the single-process values (init_pipeline_layer).
        # seed=None: the base seed is drawn from the global RNG (seed_everything fixes it).
        self._init_seed = int(seed) if seed is not None else int(torch.randint(0, 2**62, (), device="cpu"))
        # fork_rng: layer constructors (e.g. nn.Linear's default init) must not move the caller's RNG
        with torch.random.fork_rng(devices=[]):
            layers: list[nn.Module] = [Embedding(cfg)]
            layers += [
                SparseAttentionBlock(cfg, cfg.block_mlp_ratio(i), layer_index=i)
                if cfg.layer_attention(i) == "hash_sparse" else Block(cfg, cfg.block_mlp_ratio(i))
                for i in range(cfg.n_layer)
            ]
            layers += [FinalNorm(cfg)]
            if cfg.head_chunks == 1:
                layers.append(Head(cfg))
            else:
                if not self._head_chunks_supported:
                    raise ValueError(f"{type(self).__name__} does not support head_chunks > 1 yet; "
                                     "use GPT, or head_chunks=1")
                layers += head_chunk_layers(cfg.n_embd, cfg.vocab_size, cfg.head_chunks)
            self.layers = nn.ModuleList(layers)
        self._init_weights()
        if cfg.head_chunks > 1:  # checkpoints name the head as one matrix, whatever head_chunks is
            # (loading splits it before a sublayer model maps block keys to pipeline indices; saving
            # merges it after that mapping, so the merge hook is registered in _layers_built)
            self._register_load_state_dict_pre_hook(split_head_hook, with_module=True)
        if cfg.tie_embeddings:  # after init: the embedding's values win (the head's draw is dropped)
            self.layers[-1].lm_head.weight = self.layers[0].wte.weight

        self._init_eval_metric(self.config.vocab_size)
        self._layers_built(GPT)

    def _layers_built(self, cls: type) -> None:
        """The end of ``cls.__init__``: at sublayer granularity the outermost model class (the
        last to change the blocks) cuts them into pipeline layers; a subclass whose ``__init__``
        changes blocks ends it with ``self._layers_built(<its class>)``."""
        if type(self).__init__ is cls.__init__ or self.config.pipeline_granularity == "block":
            apply_granularity(self)
            if self.config.head_chunks > 1 and not getattr(self, "_head_merge_hooked", False):
                self._register_state_dict_hook(merge_head_hook)  # after apply_granularity's key mapping
                self._head_merge_hooked = True

    # ------------------------------------------------------------------ init
    def _init_weights(self) -> None:
        """Initialise every layer (:meth:`init_pipeline_layer`). Layers built on the meta device
        (``trainer.init_module(empty_init=True)`` under DynMoStrategy) are left to the strategy,
        which initialises only those the rank owns, with the same values."""
        for i, layer in enumerate(self.layers):
            if not any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
                self.init_pipeline_layer(i, layer)

    #: :meth:`init_pipeline_layer` also fills a layer whose parameters are FSDP row shards, so
    #: meta-device init under ``dp_sharding="fsdp"`` allocates only the shards
    #: (:class:`~lightning_dynmo.protocol.InitializesPipelineLayers`)
    initializes_shards = True

    @torch.no_grad()
    def init_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        """Initialise pipeline layer ``index`` in place from a generator seeded by ``(seed, index)``
        alone (GPT-2 / nanoGPT scheme): Linear and Embedding weights N(0, 0.02), the residual
        projections (``attn.proj``, ``mlp.proj``) N(0, 0.02 / sqrt(2 n_layer)), biases 0,
        LayerNorm (1, 0), hash-attention buffers from their own seed. Values are drawn in fp32 on
        the CPU and copied, so they do not depend on the layer's dtype or device: a single-process
        model, a model converted to bf16 and a rank materialising only this layer all agree. A
        layer of FSDP shards (``Shard(0)`` DTensors, meta-device init under ``dp_sharding="fsdp"``:
        :attr:`initializes_shards`) gets its rows of the same draws, drawn without the whole
        tensors (``models/_init_draws.py``)."""
        if isinstance(layer, HeadChunk):  # the unchunked head's draw (its seed, its index), this chunk's rows
            layer.reset_parameters_from(torch.Generator().manual_seed(layer_seed(self._init_seed, self.head_index)))
            return
        # a piece of a split block draws from its block's stream, after the pieces before it
        units = getattr(self, "layer_units", None)
        gen = torch.Generator().manual_seed(layer_seed(self._init_seed, index if units is None else units[index]))
        skip_draws(gen, layer)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        residual = {id(m.proj) for m in layer.modules() if isinstance(m, (CausalSelfAttention, MLP))}
        residual |= {id(m) for piece in layer.modules() if hasattr(piece, "residual_projections")
                     for m in piece.residual_projections()}  # fine pieces hold a block's projections

        for m in layer.modules():
            if isinstance(m, nn.Linear):
                normal_from_(m.weight, resid_std if id(m) in residual else 0.02, gen)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                normal_from_(m.weight, 0.02, gen)
            elif isinstance(m, nn.LayerNorm):
                if m.weight is not None:
                    m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, HashSparseSelfAttention):
                m.reset_buffers()

    # ------------------------------------------------------------------ protocol
    def pipeline_layers(self) -> nn.ModuleList:
        if getattr(self, "layer_units", None) is None:
            raise RuntimeError(
                f"{type(self).__name__}.__init__ did not finish its layers: a GPT subclass whose __init__ "
                f"changes blocks must end it with self._layers_built({type(self).__name__})"
            )
        return self.layers

    def pipeline_inputs(self, idx: torch.Tensor, targets: torch.Tensor):
        """What enters the first layer: the tokens, and with a chunked head also the targets
        (carried past the blocks to the head chunks, see protocol/activations.py)."""
        return idx if self.config.head_chunks == 1 else (idx, targets)

    def pipeline_layer_units(self) -> tuple[int, ...]:
        """For each pipeline layer, the block-granularity layer it is part of (identity at block
        granularity); freezing treats the pieces of one unit as one."""
        return self.layer_units

    def state_dict_key(self, name: str) -> str:
        """The ``state_dict()`` key of the parameter or buffer ``name`` (``named_parameters()``):
        the block model's key whatever the granularity."""
        return state_dict_key(self, name)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.config.head_chunks > 1:  # the last chunk's per-token NLL: only the mean is left
            return streaming_nll_mean(output, target)
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def checkpoint_merges(self) -> dict[str, list[tuple[str, int]]]:
        """The chunked head's rows as one ``layers.<head>.lm_head.weight`` in checkpoints
        (protocol/merges.py), so a run resumes under another ``head_chunks``."""
        return head_merges(self.head_index, self.config.vocab_size, self.config.head_chunks)

    @property
    def head_index(self) -> int:
        """Block-granularity index of the (first) LM head layer: its seed and its checkpoint key."""
        return self.config.n_layer + 2

    def lm_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.config.head_chunks == 1:
            return super().lm_loss(idx, targets)
        return self.pipeline_loss(run_layers(self.layers, self.pipeline_inputs(idx, targets)), targets)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` (with a chunked head built from its slices: for sampling)."""
        return logits_through(self.layers, self.config.head_chunks, idx)  # fine pieces pass tuples

    # ------------------------------------------------------------------ lightning hooks
    def on_train_batch_start(self, batch, batch_idx) -> None:
        # before the strategy's hook (which may migrate layers): every rank sets its own layers
        set_hash_step(self, self.global_step)

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Autoregressive sampling; single-process only (needs every layer present).

        ``idx``: int64 ``[B, T]`` prompt; the context is cropped to ``block_size``.
        ``temperature <= 0`` means greedy decoding. Returns ``[B, T + max_new_tokens]``.
        """
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                ctx = idx[:, -self.config.block_size :]
                logits = self(ctx)[:, -1, :].float()
                if temperature <= 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        k = min(int(top_k), logits.size(-1))
                        kth = torch.topk(logits, k).values[:, [-1]]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx
