"""Activations between pipeline layers: one tensor or a fixed-arity tuple of tensors.

A layer is called with the activation unpacked (``layer(*acts)``, as torch's ``PipelineStage``
calls a stage) and returns a tensor or a tuple of tensors. A layer consumes as many leading
tensors as its ``forward`` has required positional parameters (all of them with ``*args``);
the tensors it does not consume pass through after its outputs unchanged. So a model can carry
something a late layer needs (the targets of a chunked LM head) past layers that know nothing of
it: ``(idx, targets) -> Embedding -> (x, targets) -> Block -> (x, targets) -> ...``.

What a layer returns is checked against the spec discovered for it: a dict, a non-tensor, an
arity or a shape that differs from the discovered one is a :class:`PipelineProtocolError` that
names the layer (the runtime makes every rank raise it, see ``runtime/engine.py``).
"""
from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from .module import PipelineProtocolError

__all__ = ["as_acts", "buffers_kept", "call_layer", "consumed", "describe", "output_problem", "run_layers",
           "unpack"]

_ARITY: dict[type, int | None] = {}
_OPTIONAL: dict[type, tuple[str, ...]] = {}  # a class's positional parameters that have a default
_WARNED: set[type] = set()


def consumed(layer: nn.Module, available: int) -> int:
    """How many leading tensors of ``available`` ``layer`` takes (the rest pass through).

    A positional parameter with a default is not given a tensor: passing the carried tensors
    into whatever optional slot a layer has would feed e.g. a chunked head's targets to an
    ``attn_mask=None``. When tensors do pass such a layer, one warning names the parameter, since
    a ``forward(h, skip=None)`` that a module's own ``forward`` calls with ``skip`` would
    otherwise train silently without it under the pipeline."""
    cls = type(layer)
    if cls not in _ARITY:
        n: int | None = 0
        optional: list[str] = []
        params: Iterable[inspect.Parameter]
        try:
            params = inspect.signature(layer.forward).parameters.values()
        except (TypeError, ValueError):
            params = ()
            n = None
        for p in params:
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                n = None
                break
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                if p.default is p.empty:
                    assert n is not None  # None only after *args, which ends the loop
                    n += 1
                else:
                    optional.append(p.name)
        _ARITY[cls] = n
        # with no required parameter the first one takes the first tensor (a layer takes at least one)
        _OPTIONAL[cls] = () if n is None else tuple(optional[1:] if n == 0 else optional)
    n = _ARITY[cls]
    if n is None:
        return available
    n = min(max(n, 1), available)
    if n < available and _OPTIONAL[cls] and cls not in _WARNED:
        _WARNED.add(cls)
        _warn_optional(cls, n, available - n)
    return n


def _warn_optional(cls: type, n: int, passing: int) -> None:
    names = ", ".join(repr(name) for name in _OPTIONAL[cls])
    warnings.warn(
        f"pipeline layer {cls.__name__}.forward has optional positional parameter(s) {names} and {passing} "
        f"more tensor(s) reach it; the pipeline passes a layer only its required positional parameters ({n}), "
        f"so {names} keep(s) the default and the tensor(s) pass through to the next layer. Make the parameter "
        "required to receive the tensor, or keyword-only (`*, name=None`) to keep the default and silence this "
        "(docs/model_protocol.md)", UserWarning, stacklevel=3)


def describe(out: object) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {list(out.shape)} ({out.dtype})"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} (" + ", ".join(
            f"{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in out) + ")"
    return f"a {type(out).__name__}"


def as_acts(out: object) -> tuple[torch.Tensor, ...] | None:
    """``out`` as a tuple of tensors, or None when it is not a tensor or a tuple/list of tensors."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and len(out) > 0 and all(isinstance(t, torch.Tensor) for t in out):
        return tuple(out)
    return None


def unpack(acts: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A one-tensor activation as the tensor itself (what single-tensor models see), else the tuple."""
    return acts[0] if len(acts) == 1 else acts


def output_problem(index: int, layer: nn.Module, out: object, expected: Sequence[Any] | None = None) -> str | None:
    """Why ``out`` (layer ``index``'s output with pass-through applied) breaks the protocol, or None.
    ``expected``: the discovered specs (``shape``, ``dtype`` per tensor) it must match."""
    name = f"pipeline layer {index} ({type(layer).__name__})"
    acts = as_acts(out)
    if acts is None:
        return (f"{name} returned {describe(out)}; a pipeline layer must return a tensor or a tuple of tensors "
                "(a fixed number of them): return the values the next layers need as a tuple, in a fixed order")
    if expected is None:
        return None
    if len(acts) != len(expected):
        return (f"{name} returned {len(acts)} tensor(s) where the pipeline discovered {len(expected)}: the "
                "number of tensors a layer passes on must not change between steps")
    for k, (t, sp) in enumerate(zip(acts, expected)):
        if tuple(t.shape) != tuple(sp.shape) or t.dtype != sp.dtype:
            return (f"{name} returned tensor {k} of shape {list(t.shape)} ({t.dtype}) where the pipeline discovered "
                    f"{list(sp.shape)} ({sp.dtype}): a layer's output shape must depend only on its input's shape "
                    "(no data-dependent shapes; pad to a fixed size and carry a mask instead)")
    return None


def call_layer(layer: nn.Module, acts: tuple[torch.Tensor, ...], fn: Callable[..., Any] | None = None) -> Any:
    """Run ``layer`` (through ``fn`` if given, e.g. a checkpointing wrapper) on the tensors it
    consumes; returns its raw output with the tensors it did not consume appended (a tuple), or
    the raw output itself when nothing passes through."""
    n = consumed(layer, len(acts))
    out = (fn or layer)(*acts[:n])
    if n == len(acts):
        return out
    head = as_acts(out)
    if head is None:
        return out  # reported by output_problem
    return head + tuple(acts[n:])


def run_layers(layers: Sequence[nn.Module], x: Any) -> Any:
    """Single-process forward through ``layers`` with the pipeline's calling convention."""
    acts = as_acts(x)
    if acts is None:
        raise TypeError(f"the first pipeline layer's input must be a tensor or a tuple of tensors, got {describe(x)}")
    for i, layer in enumerate(layers):
        out = call_layer(layer, acts)
        problem = output_problem(i, layer, out)
        if problem:
            raise PipelineProtocolError(problem)
        acts = as_acts(out)
        assert acts is not None  # output_problem names any output that is not tensors
    return unpack(acts)


@contextmanager
def buffers_kept(layers: Iterable[nn.Module]) -> Iterator[None]:
    """Every buffer of ``layers`` holds its values from before the block again after it: a
    forward that is not a training step (the shape discovery, a memory measurement) must leave no
    mark (BatchNorm's running statistics and ``num_batches_tracked``, a layer's step counter),
    or the pipeline's state would drift from one process's. Restored by name, so a forward that
    re-assigns a buffer instead of writing it in place is undone as well."""
    layers = list(layers)
    saved = [[(name, b.detach().clone()) for name, b in layer.named_buffers()] for layer in layers]
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, named in zip(layers, saved):
                for name, value in named:
                    layer.get_buffer(name).copy_(value)
