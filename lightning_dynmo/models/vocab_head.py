"""A vocabulary-chunked LM head with a streaming (online-softmax) cross-entropy.

``GPTConfig(head_chunks=k)`` replaces the one LM head layer (``[B,T,C] -> logits [B,T,V]``,
cross-entropy in ``pipeline_loss``) by ``k`` pipeline layers over vocabulary slices, so the
head's work and memory can be spread over stages (Vocabulary Parallelism, Yeung et al. 2025,
here sequential along the pipeline) and the loss's compute belongs to layers the profiler times.
Each chunk carries, per token, the running max ``m`` of the logits seen so far, the sum
``s = sum exp(logit - m)`` and the target's logit ``tl``:

    (h, targets) -> chunk 0 -> (h, m, s, tl, targets) -> ... -> chunk k-1 -> nll = m + log s - tl

and ``pipeline_loss`` only averages ``nll``. A chunk's logits exist only inside its own forward
and backward (:class:`StreamingCrossEntropy` recomputes them from ``h`` and its weight slice,
like a fused linear cross-entropy), so the head's activation memory falls with ``k`` even on one
stage: the full ``tokens x vocab`` logits never exist. ``m`` is a stabiliser, not a function
the loss depends on (``m + log sum exp(l - m)`` is the same for every ``m``), so it carries no
gradient; losses and gradients equal the unchunked head's within fp32 rounding.

Parameters: chunk ``j`` is its own layer with its own ``lm_head.weight`` rows, so it migrates
alone. Initialisation draws the whole ``[V, C]`` matrix from the head layer's seed and keeps the
slice, so a chunked model starts from the unchunked model's weights. Checkpoints carry one
``layers.<head>.lm_head.weight`` whatever ``k`` (``GPT.checkpoint_merges`` and
``runtime/merged_parameters.py``: model and optimizer state), so a run resumes under another ``k``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HeadChunk", "StreamingCrossEntropy", "chunk_bounds", "head_logits"]


def chunk_bounds(vocab_size: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous vocabulary slices, sizes differing by at most one (larger first)."""
    if not 1 <= chunks <= vocab_size:
        raise ValueError(f"head_chunks must be between 1 and vocab_size={vocab_size}, got {chunks}")
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
        """Draw the whole ``[V, C]`` head matrix from ``generator`` and keep this chunk's rows
        (the unchunked head's initial values)."""
        full = torch.empty(self.vocab_size, self.lm_head.in_features).normal_(0.0, std, generator=generator)
        self.lm_head.weight.copy_(full[self.start:self.stop])

    def extra_repr(self) -> str:
        return f"vocab=[{self.start}, {self.stop}) of {self.vocab_size}, first={self.first}, last={self.last}"


def head_logits(chunks, h: torch.Tensor) -> torch.Tensor:
    """Full logits from the chunks (sampling and inspection only; training never builds them)."""
    return torch.cat([F.linear(h, c.lm_head.weight) for c in chunks], dim=-1)
