"""Where ``torch.distributed.pipelining`` behaves differently across the torch releases we
support (``setup.py``), made to behave the same, in one place.

Three generations of ``PipelineStage``: torch 2.10/2.11 (no metadata inference: every received
input has a gradient slot), 2.12 (metadata inference as in 2.13, but a stricter gradient send),
and 2.13/2.14. The differences made 2.11 fail on one rank while its peers waited, and
2.12 fail at the first step of every run:

* **Gradient slots of inputs that need none.** torch 2.13 derives per-input gradient metadata:
  a stage input that does not require a gradient (early exit's ``flag``, a padding mask) has no
  gradient slot, and its producer posts no receive for it; where a slot exists but autograd
  produced no gradient it sends zeros. torch 2.10/2.11 post a gradient receive for *every* tensor
  a stage sends, and their sender raises ``"[1] for chunk 0 has gradients None and is expecting
  to send gradients to stage 0"`` when autograd produced none. We send zeros there: the
  producer's ``stage_backward`` skips outputs that need no gradient, so the zeros never reach a
  parameter, and the math is that of torch 2.13. torch 2.12 has 2.13's receive side (no receive
  without gradient metadata) but 2.11's send side (it raises on a missing gradient, and would
  send into a receive nobody posted); its sends are made 2.13's.
* **Receive buffers of integer activations.** torch 2.10/2.11 mark every receive buffer as
  needing a gradient, which an integer tensor cannot (targets carried to a chunked LM head, a
  padding mask): "only Tensors of floating point dtype can require gradients". Only
  floating-point buffers are marked there (also where a V schedule hands an activation to the
  next stage on the same rank); integer ones get the zero gradient of the first point. torch
  2.12 takes ``requires_grad`` from the inferred metadata, as 2.13 does.
* **Warm-up sends to one's own rank.** Before its first step a schedule exchanges a dummy tensor
  with each neighbouring stage. Under a V schedule (``zbv``) two neighbouring stages live on one
  rank; torch 2.10/2.11 send that dummy to itself, which gloo refuses ("Pair is not connected").
  Stages on one rank pass activations by function call anyway, so the warm-up skips them.
* **The first stage's inputs** are a ``_RootArgPlaceholder`` on 2.10/2.11 and a ``_RecvInfo``
  with ``is_root_arg`` set and no buffer from 2.12: neither is received.

* **Split backward through a custom ``autograd.Function``, or of outputs that need no gradient.**
  Zero-bubble schedules split each backward into an input pass (I) and a weight pass (W). torch
  <= 2.12's weight pass reads ``node._input_metadata`` of every node between the stage's output
  and its weights, which a custom ``autograd.Function`` node (the MoE/MoD aux-loss scaler) does
  not have, and its input pass hands every stage output to ``autograd.grad``, which refuses one
  that needs no gradient (targets carried to a chunked head, early exit's flag). For such a
  chunk, I runs the whole backward and W has nothing left to do: the gradients are the same,
  that chunk's weight pass just does not fill a bubble.

* **Evaluation under a V schedule** (every release): ``eval()`` walks the training actions with
  backward turned off. Each backward returns at once, but where the previous stage lives on the
  same rank (``zbv``, ``dualpipev``: stages p-1 and p; any multi-stage schedule on one rank) the
  runtime then hands that stage the input gradient by function call, and torch's stage raises
  "can't steal_bwd_input if this stage doesn't have backward": ``trainer.validate`` and the
  validation inside ``fit`` failed on the rank holding both. Without backward that hand-off
  carries nothing.

All are detected by capability, not by version string, so a backport or a nightly is handled
by what it does.
"""
from __future__ import annotations

import torch
from torch.autograd.function import BackwardCFunction
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import stage as _stage
from torch.distributed.pipelining.stage import _RecvInfo

#: torch <= 2.12: a stage's gradient sends follow its inputs, not gradient metadata.
GRADIENT_SLOT_PER_INPUT = not hasattr(PipelineStage, "_get_grad_send_meta")
#: torch 2.10/2.11: no metadata inference; every receive buffer is marked as needing a gradient.
LEGACY_STAGE = hasattr(_stage, "_RootArgPlaceholder")
#: torch 2.12: 2.13's metadata and receives, 2.11's strict gradient sends.
STRICT_GRADIENT_SEND = GRADIENT_SLOT_PER_INPUT and not LEGACY_STAGE


def _receives(info) -> bool:
    """Whether ``info`` describes an activation received from another stage (with a buffer)."""
    return isinstance(info, _RecvInfo) and not getattr(info, "is_root_arg", False) and info.buffer is not None


def _peer_of(op) -> int | None:
    peer = getattr(op, "group_peer", None)
    return peer if peer is not None else getattr(op, "peer", None)


class PortablePipelineStage(PipelineStage):
    """A ``PipelineStage`` that behaves like torch 2.13's on every supported torch."""

    def _get_init_p2p_neighbors_ops(self):
        ops = super()._get_init_p2p_neighbors_ops()
        return [op for op in ops if _peer_of(op) != self.group_rank]

    def _prepare_forward_infra(self, *args, **kwargs):
        if not LEGACY_STAGE:
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
                    if _receives(info) and info.buffer.is_floating_point():
                        info.buffer.requires_grad_(True)
        return out

    def set_local_fwd_input(self, prev_stage_outputs, mb_index: int) -> None:
        if not LEGACY_STAGE:
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
        if LEGACY_STAGE:
            self._zero_missing_input_grads(bwd_chunk_id)
        return out

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        if not STRICT_GRADIENT_SEND or not self.has_backward or self.is_first:
            return super().get_bwd_send_ops(bwd_chunk_id)
        # torch 2.12: send what torch 2.13 sends (see the module docstring)
        if self.grad_send_info is None:
            self.grad_send_info = self._create_grad_send_info(self.args_recv_info[0])
        planned = self.grad_send_info
        grads, sends = [], []
        for idx, (grad, dest) in enumerate(zip(self.bwd_cache[bwd_chunk_id], planned)):
            meta = self._grad_send_meta(idx) if dest is not None else None
            if meta is None:  # the producer posted no receive for it
                if grad is not None and dest is not None:  # what torch 2.13 raises (dropping it would be silent)
                    raise RuntimeError(f"Stage {self.stage_index} chunk {bwd_chunk_id} input {idx}: backward produced "
                                       "a gradient, but the stage's gradient metadata has none for this input, so "
                                       "the previous stage posted no receive for it")
                grads.append(None)
                sends.append(None)
            else:
                grads.append(grad if grad is not None else _stage._make_tensor_from_meta(meta, self.device).zero_())
                sends.append(dest)
        self.bwd_cache[bwd_chunk_id] = tuple(grads)
        self.grad_send_info = sends
        try:
            return super().get_bwd_send_ops(bwd_chunk_id)
        finally:
            self.grad_send_info = planned

    def get_local_bwd_output(self, mb_index: int):
        if not self.has_backward:  # eval() under a V schedule (the module docstring)
            return ()
        return super().get_local_bwd_output(mb_index)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if not self.has_backward:
            return None
        if STRICT_GRADIENT_SEND:  # torch 2.12 keeps the previous micro-batch's gradient for a None; 2.13 zeroes it
            for info, grad in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs):
                if grad is None and getattr(info, "buffer", None) is not None:
                    info.buffer.zero_()
        return super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def _grad_send_meta(self, idx: int):
        """torch 2.13's ``_get_grad_send_meta``: the gradient metadata of input ``idx``, which is
        what the producer allocated a receive for."""
        input_grads = self._stage_meta.input_grads
        if input_grads is not None and idx < len(input_grads):
            return input_grads[idx]
        inputs = self._stage_meta.inputs
        if inputs is not None and idx < len(inputs) and inputs[idx] is not None:
            return _stage._derive_grad_metas((inputs[idx],))[0]
        return None

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
        tensors = ([outputs] if isinstance(outputs, torch.Tensor)
                   else [t for t in outputs if isinstance(t, torch.Tensor)])
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
            torch.zeros_like(info.buffer) if g is None and _receives(info) else g
            for g, info in zip(grads, infos))
