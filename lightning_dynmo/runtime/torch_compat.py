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
* **Receive buffers of integer activations.** torch <= 2.12 marks every receive buffer as needing
  a gradient, which an integer tensor cannot (targets carried to a chunked LM head, a padding
  mask): "only Tensors of floating point dtype can require gradients". Only floating-point
  buffers are marked here (also where a V schedule hands an activation to the next stage on the
  same rank); integer ones get the zero gradient of the first point.
* **Warm-up sends to one's own rank.** Before its first step a schedule exchanges a dummy tensor
  with each neighbouring stage. Under a V schedule (``zbv``) two neighbouring stages live on one
  rank; torch <= 2.12 sends that dummy to itself, which gloo refuses ("Pair is not connected").
  Stages on one rank pass activations by function call anyway, so the warm-up skips them.

* **Split backward through a custom ``autograd.Function``, or of outputs that need no gradient.**
  Zero-bubble schedules split each backward into an input pass (I) and a weight pass (W). torch
  <= 2.12's weight pass reads ``node._input_metadata`` of every node between the stage's output
  and its weights, which a custom ``autograd.Function`` node (the MoE/MoD aux-loss scaler) does
  not have, and its input pass hands every stage output to ``autograd.grad``, which refuses one
  that needs no gradient (targets carried to a chunked head, early exit's flag). For such a
  chunk, I runs the whole backward and W has nothing left to do: the gradients are the same,
  that chunk's weight pass just does not fill a bubble.

All are detected by capability, not by version string, so a backport or a nightly is handled
by what it does.
"""
from __future__ import annotations

import torch
from torch.autograd.function import BackwardCFunction
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

    def _prepare_forward_infra(self, *args, **kwargs):
        if not GRADIENT_SLOT_PER_INPUT:
            return super()._prepare_forward_infra(*args, **kwargs)
        backward = self.has_backward
        self.has_backward = False  # torch <= 2.12 then marks no receive buffer; we mark the floating ones
        try:
            out = super()._prepare_forward_infra(*args, **kwargs)
        finally:
            self.has_backward = backward
        if backward:
            for infos in self.args_recv_info.values():
                for info in infos:
                    if isinstance(info, _RecvInfo) and info.buffer.is_floating_point():
                        info.buffer.requires_grad_(True)
        return out

    def set_local_fwd_input(self, prev_stage_outputs, mb_index: int) -> None:
        if not GRADIENT_SLOT_PER_INPUT:
            return super().set_local_fwd_input(prev_stage_outputs, mb_index)
        outputs = prev_stage_outputs if isinstance(prev_stage_outputs, (tuple, list)) else (prev_stage_outputs,)
        for info, tensor in zip(self.args_recv_info[mb_index], outputs):
            # what torch <= 2.12 does, but an integer tensor cannot require a gradient
            info.buffer = tensor.detach().requires_grad_(tensor.is_floating_point())

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward: bool = False):
        if GRADIENT_SLOT_PER_INPUT and not full_backward and self._split_backward_fails(bwd_chunk_id, loss):
            full_backward = True
            self._whole_backward_chunks.add(bwd_chunk_id)
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        if GRADIENT_SLOT_PER_INPUT:
            self._zero_missing_input_grads(bwd_chunk_id)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        if bwd_chunk_id in self._whole_backward_chunks:
            self._whole_backward_chunks.discard(bwd_chunk_id)  # its I pass computed the weight gradients
            return None
        return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    @property
    def _whole_backward_chunks(self) -> set:
        if "_whole_chunks" not in self.__dict__:
            self._whole_chunks = set()
        return self._whole_chunks

    def _split_backward_fails(self, chunk: int, loss) -> bool:
        """Whether torch <= 2.12's split backward would fail on this chunk (the module docstring)."""
        outputs = loss if self.is_last else self.fwd_cache[chunk][0]
        tensors = [outputs] if isinstance(outputs, torch.Tensor) else [t for t in outputs if isinstance(t, torch.Tensor)]
        if any(not t.requires_grad for t in tensors):
            return True
        seen: set = set()
        stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if isinstance(node, BackwardCFunction):
                return True
            stack.extend(fn for fn, _ in node.next_functions)
        return False

    def _zero_missing_input_grads(self, chunk: int) -> None:
        grads = self.bwd_cache.get(chunk)
        if self.is_first or grads is None:
            return
        infos = self.args_recv_info[chunk]
        self.bwd_cache[chunk] = tuple(
            torch.zeros_like(info.buffer) if g is None and isinstance(info, _RecvInfo) else g
            for g, info in zip(grads, infos))
