"""A vocabulary-chunked LM head with a streaming (online-softmax) cross-entropy.

``GPTConfig(head_chunks=k)`` replaces the one LM head layer (``[B,T,C] -> logits [B,T,V]``,
cross-entropy in ``pipeline_loss``) by ``k`` pipeline layers over vocabulary slices, so the
head's work and memory can be spread over stages (Vocabulary Parallelism, Yeung et al. 2025,
here sequential along the pipeline) and the loss's compute belongs to layers the profiler times.
Each chunk carries, per token, the running max ``m`` of the logits seen so far, the sum
``s = sum exp(logit - m)`` and the target's logit ``tl``:

    (h, targets) -> chunk 0 -> (h, m, s, tl, targets) -> ... -> chunk k-1 -> nll = m + log s - tl

and ``pipeline_loss`` only averages ``nll`` (:func:`streaming_nll_mean`: over the targets that are
not :data:`IGNORE_INDEX` = -100, as the unchunked heads' ``F.cross_entropy`` does by default). A
chunk's logits exist only inside its own forward and backward (:class:`StreamingCrossEntropy`
recomputes them from ``h`` and its weight slice, like a fused linear cross-entropy), so the head's
activation memory falls with ``k`` even on one stage: the full ``tokens x vocab`` logits never
exist. ``m`` is a stabiliser, not a function the loss depends on (``m + log sum exp(l - m)`` is the
same for every ``m``), so it carries no gradient; losses and gradients equal the unchunked head's
within fp32 rounding.

Parameters: chunk ``j`` is its own layer with its own ``lm_head.weight`` rows, so it migrates
alone. Initialisation draws the whole ``[V, C]`` matrix from the head layer's seed and keeps the
slice, so a chunked model starts from the unchunked model's weights. Checkpoints carry one
``layers.<head>.lm_head.weight`` whatever ``k`` (``GPT.checkpoint_merges`` and
``protocol/merges.py``: model and optimizer state), so a run resumes under another ``k``.

Used by :class:`~lightning_dynmo.models.GPT` (``GPTConfig(head_chunks=k)``) and by the Hugging
Face adapter (``HFCausalLM(head_chunks=k)``, whose chunks copy their rows from the model's own
``lm_head.weight``); :func:`head_merges` and the state-dict hooks name the chunks' rows as one
matrix in both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..protocol.activations import run_layers
from ..protocol.granularity import check_head_chunks
from ..protocol.merges import merge_state, merging_state, split_state

__all__ = ["IGNORE_INDEX", "HeadChunk", "StreamingCrossEntropy", "chunk_bounds", "head_chunk_layers", "head_logits",
           "head_merges", "logits_through", "merge_head_hook", "split_head_hook", "streaming_nll_mean"]

IGNORE_INDEX = -100  # F.cross_entropy's default: targets with this value count neither in the sum nor the mean


def chunk_bounds(vocab_size: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous vocabulary slices, sizes differing by at most one (larger first)."""
    check_head_chunks(chunks, vocab_size)
    base, extra = divmod(vocab_size, chunks)
    bounds, start = [], 0
    for j in range(chunks):
        stop = start + base + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class StreamingCrossEntropy(torch.autograd.Function):
    """One vocabulary slice of the online softmax: ``(h, W, m, s, tl, targets, start) ->
    (h', m', s', tl')`` with ``h'`` a copy of ``h`` (the next chunk's input). Saves ``h``, ``W``
    and per-token statistics; backward recomputes the slice's logits (under the forward's
    autocast state) one slice at a time."""

    @staticmethod
    def forward(ctx, h, weight, m, s, tl, targets, start: int):
        ctx.autocast = _autocast_state(h.device.type)
        logits = F.linear(h, weight).float()  # this slice's logits: the one [tokens, V/k] buffer
        m_new = torch.maximum(m, logits.amax(dim=-1))
        local = targets - start
        inside = (local >= 0) & (local < weight.shape[0])
        picked = logits.gather(-1, local.clamp(0, weight.shape[0] - 1).unsqueeze(-1)).squeeze(-1)
        tl_new = tl + torch.where(inside, picked, torch.zeros_like(picked))
        s_new = s * torch.exp(m - m_new) + logits.sub_(m_new.unsqueeze(-1)).exp_().sum(dim=-1)
        del logits
        ctx.save_for_backward(h, weight, m, m_new, local, inside)
        ctx.mark_non_differentiable(m_new)
        return h.clone(), m_new, s_new, tl_new

    @staticmethod
    def backward(ctx, g_h, g_m, g_s, g_tl):
        h, weight, m, m_new, local, inside = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        with torch.no_grad(), torch.autocast(h.device.type, dtype=dtype, enabled=enabled):
            g_logits = F.linear(h, weight).float()  # recomputed, then turned into its gradient in place
        g_s = torch.zeros_like(m_new) if g_s is None else g_s.float()
        g_tl = torch.zeros_like(m_new) if g_tl is None else g_tl.float()
        g_logits.sub_(m_new.unsqueeze(-1)).exp_().mul_(g_s.unsqueeze(-1))  # d s / d logit = exp(logit - m)
        rows = local.clamp(0, weight.shape[0] - 1).unsqueeze(-1)
        g_logits.scatter_add_(-1, rows, (g_tl * inside).unsqueeze(-1))
        g_input = (g_logits @ weight.float()).to(h.dtype)
        if g_h is not None:
            g_input = g_input + g_h
        g_weight = (g_logits.reshape(-1, weight.shape[0]).t() @ h.reshape(-1, h.shape[-1]).float()).to(weight.dtype)
        g_s_in = g_s * torch.exp(m - m_new)
        return g_input, g_weight, None, g_s_in, g_tl, None, None


class HeadChunk(nn.Module):
    """Vocabulary slice ``[start, stop)`` of the LM head as one pipeline layer (see module docstring).
    The first chunk takes ``(h, targets)``, the others ``(h, m, s, tl, targets)``; the last
    returns the per-token negative log-likelihood ``[B, T]`` (fp32), the others
    ``(h, m, s, tl, targets)``."""

    def __init__(self, n_embd: int, start: int, stop: int, vocab_size: int, first: bool, last: bool) -> None:
        super().__init__()
        self.start, self.stop, self.vocab_size = start, stop, vocab_size
        self.first, self.last = first, last
        self.lm_head = nn.Linear(n_embd, stop - start, bias=False)

    def forward(self, h: torch.Tensor, *carry: torch.Tensor):
        if self.first:
            if len(carry) != 1:
                raise TypeError(f"the first head chunk takes (hidden, targets), got {1 + len(carry)} tensors")
            (targets,) = carry
            stats = torch.full(targets.shape, float("-inf"), device=h.device), \
                torch.zeros(targets.shape, device=h.device), torch.zeros(targets.shape, device=h.device)
        else:
            if len(carry) != 4:
                raise TypeError(f"head chunk [{self.start}, {self.stop}) takes (hidden, max, sum_exp, target_logit, "
                                f"targets), got {1 + len(carry)} tensors")
            *stats, targets = carry
        h, m, s, tl = StreamingCrossEntropy.apply(h, self.lm_head.weight, *stats, targets, self.start)
        if self.last:
            return m + torch.log(s) - tl
        return h, m, s, tl, targets

    @torch.no_grad()
    def reset_parameters_from(self, generator: torch.Generator, std: float = 0.02) -> None:
        """This chunk's rows of the whole ``[V, C]`` head matrix drawn from ``generator`` (the
        unchunked head's initial values), drawn without the whole matrix; of an FSDP shard of the
        chunk, its rows."""
        from ._init_draws import normal_from_

        normal_from_(self.lm_head.weight, std, generator, (self.vocab_size, self.lm_head.in_features), self.start)

    @torch.no_grad()
    def copy_rows_from(self, full: torch.Tensor) -> None:
        """Set this chunk's weight to rows ``[start, stop)`` of the whole ``[V, C]`` head matrix."""
        if tuple(full.shape) != (self.vocab_size, self.lm_head.in_features):
            raise ValueError(f"the whole head matrix has shape {list(full.shape)}; chunk {self.extra_repr()} "
                             f"needs [{self.vocab_size}, {self.lm_head.in_features}]")
        self.lm_head.weight.copy_(full[self.start:self.stop])

    def extra_repr(self) -> str:
        return f"vocab=[{self.start}, {self.stop}) of {self.vocab_size}, first={self.first}, last={self.last}"


def head_logits(chunks, h: torch.Tensor) -> torch.Tensor:
    """Full logits from the chunks (sampling and inspection only; training never builds them)."""
    return torch.cat([F.linear(h, c.lm_head.weight) for c in chunks], dim=-1)


def logits_through(layers, chunks: int, x) -> torch.Tensor:
    """Logits ``[B, T, V]`` of ``layers`` whose last ``chunks`` layers are the head (one plain head
    layer for ``chunks == 1``; the chunks' slices concatenated otherwise)."""
    h = run_layers(layers if chunks == 1 else layers[:-chunks], x)
    return h if chunks == 1 else head_logits(layers[-chunks:], h)


def head_chunk_layers(n_embd: int, vocab_size: int, chunks: int, dtype: torch.dtype | None = None) -> list[HeadChunk]:
    """The ``chunks`` head layers over :func:`chunk_bounds` (built on the ambient device)."""
    bounds = chunk_bounds(vocab_size, chunks)
    layers = [HeadChunk(n_embd, a, b, vocab_size, j == 0, j == len(bounds) - 1) for j, (a, b) in enumerate(bounds)]
    return layers if dtype is None else [layer.to(dtype) for layer in layers]


def streaming_nll_mean(nll: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last chunk's per-token loss averaged as ``F.cross_entropy`` averages: over the targets
    that are not :data:`IGNORE_INDEX` (all ignored: NaN, as there)."""
    keep = targets != IGNORE_INDEX
    return torch.where(keep, nll, torch.zeros_like(nll)).sum() / keep.sum()


def head_merges(head_index: int, vocab_size: int, chunks: int) -> dict[str, list[tuple[str, int]]]:
    """``checkpoint_merges()`` of a model whose ``layers[head_index:head_index + chunks]`` are the
    chunks: their rows as one ``layers.<head_index>.lm_head.weight`` (none for one chunk)."""
    if chunks == 1:
        return {}
    bounds = chunk_bounds(vocab_size, chunks)
    return {f"layers.{head_index}.lm_head.weight":
            [(f"layers.{head_index + j}.lm_head.weight", b - a) for j, (a, b) in enumerate(bounds)]}


def _prefixed(module: nn.Module, prefix: str) -> dict:
    return {prefix + k: [(prefix + n, r) for n, r in v] for k, v in module.checkpoint_merges().items()}


def merge_head_hook(module, state_dict, prefix, local_metadata):
    """``state_dict`` hook (``module._register_state_dict_hook``): the chunks' rows as one matrix
    (not inside ``protocol.merges.state_in_pieces``)."""
    if not merging_state(module):
        return
    merged = merge_state(state_dict, _prefixed(module, prefix))
    if merged is not state_dict:
        state_dict.clear()
        state_dict.update(merged)


def split_head_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """``load_state_dict`` pre-hook (``with_module=True``): one head matrix cut into the chunks' rows."""
    split = split_state(state_dict, _prefixed(module, prefix))
    if split is not state_dict:
        state_dict.clear()
        state_dict.update(split)
