"""Where ``torch.distributed.pipelining`` behaves differently across the torch releases we
support (``setup.py``), made to behave the same, in one place.

Both differences below made torch 2.11 fail on one rank while its peers waited (issue 31):

* **Gradient slots of inputs that need none.** torch 2.13 derives per-input gradient metadata:
  a stage input that does not require a gradient (early exit's ``flag``, a padding mask) has no
  gradient slot, and its producer posts no receive for it. torch <= 2.12 posts a gradient receive
  for *every* tensor a stage sends, and its sender raises ``"[1] for chunk 0 has gradients None
  and is expecting to send gradients to stage 0"`` when autograd produced none. We send zeros
  there: the producer's ``stage_backward`` skips outputs that need no gradient, so the zeros
  never reach a parameter, and the math is that of torch 2.13.
* **Warm-up sends to one's own rank.** Before its first step a schedule exchanges a dummy tensor
  with each neighbouring stage. Under a V schedule (``zbv``) two neighbouring stages live on one
  rank; torch <= 2.12 sends that dummy to itself, which gloo refuses ("Pair is not connected").
  Stages on one rank pass activations by function call anyway, so the warm-up skips them.

Both are detected by capability, not by version string, so a backport or a nightly is handled
by what it does.
"""
from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _RecvInfo

#: torch <= 2.12: every received input has a gradient slot (see the module docstring).
GRADIENT_SLOT_PER_INPUT = not hasattr(PipelineStage, "_get_grad_send_meta")


def _peer_of(op) -> int | None:
    peer = getattr(op, "group_peer", None)
    return peer if peer is not None else getattr(op, "peer", None)


class PortablePipelineStage(PipelineStage):
    """A ``PipelineStage`` that behaves like torch 2.13's on every supported torch."""

    def _get_init_p2p_neighbors_ops(self):
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if _peer_of(op) != self.group_rank]

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        out = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if GRADIENT_SLOT_PER_INPUT:
            self._zero_missing_input_grads(bwd_chunk_id)
        return out

    def _zero_missing_input_grads(self, chunk: int) -> None:
        grads = self.bwd_cache.get(chunk)
        if self.is_first or grads is None:
            return
        infos = self.args_recv_info[chunk]
        self.bwd_cache[chunk] = tuple(
            torch.zeros_like(info.buffer) if g is None and isinstance(info, _RecvInfo) else g
            for g, info in zip(grads, infos))
