"""Checkpoints in single-process format: any partition, rank count or schedule can load them.

Saving gathers replica 0's pipeline ranks onto global rank 0; loading lets every rank pick the
entries of the layers it holds (global layer indices in the keys, global parameter positions in
the optimizer state).

Loading is strict and safe, and every rank runs the same checks on the same file, so a bad file
fails on every rank with the same message before any collective:

* the file is read with ``weights_only=True`` (tensors and plain containers only), and a file that
  is not a torch checkpoint at all is called that, not answered with unpickling advice;
* every entry of the archive must match the CRC-32 the zip format stores for it (``torch.load``
  does not check it, so flipped bytes inside a tensor would load silently); the error names the
  damaged entry;
* every floating-point tensor of the model and optimizer state must be finite;
* with ``strict=True`` the keys must be exactly the whole model's (the error names the missing and
  unexpected keys, as ``nn.Module.load_state_dict`` does), and shapes must always match;
* the optimizer state must come from the module's optimizer type (its param groups' settings,
  e.g. SGD's ``momentum`` where Adam has ``betas``) and have its groups, parameter counts and, for
  every per-parameter tensor, its parameter's shape.

Expert parallelism: a rank holds one shard of each expert parameter (dim 0 split over its expert
peers). Saving gathers the shards (and their optimizer state) into whole tensors over the peers
first; loading slices each whole tensor to the rank's shard. The file is the same as without
expert parallelism, so a run resumes under any ``expert_parallel`` or ``pipeline_parallel``.

The functions get this rank's pipeline as a value (:class:`~lightning_dynmo.strategy.state.RankPipeline`),
not the strategy: they read it and load into the module and optimizers, nothing else.
"""
from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from lightning.fabric.utilities.optimizer import _optimizers_to_device

from ..protocol import state_dict_key
from ..protocol.merges import merge_optimizer_state, merge_state, merges_of, split_optimizer_state, split_state
from ..runtime.fsdp import is_sharded, shard_like, whole
from ..runtime.optimizer_layout import OptimizerLayout
from .collectives import explain_timeout
from .state import RankPipeline

_MAX_LISTED = 30
LOCAL_PIECES = "dynmo_local_pieces"  # a DCP load's pieces of merged parameters, by piece name (dcp_checkpoint.py)
SAVE_ON_EVERY_RANK = (
    "Saving gathers every pipeline rank's layers onto rank 0, and a rank did not join (if none stopped, see "
    "its log): trainer.save_checkpoint (and the strategy's "
    "lightning_module_state_dict / optimizer_state) must be called on every rank, not under "
    "`if trainer.is_global_zero:` (ModelCheckpoint already calls it on every rank)"
)


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be, or must not be, loaded into this run."""


def _listed(keys: list[str]) -> str:
    shown = ", ".join(f'"{k}"' for k in keys[:_MAX_LISTED])
    return shown + (f", ... ({len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def read_checkpoint(checkpoint_io, path, weights_only: bool | None = None) -> dict[str, Any]:
    """Read ``path`` with ``weights_only=True`` (unless the caller explicitly passed ``False``)
    and check that it is a Lightning checkpoint whose tensors are all finite."""
    weights_only = True if weights_only is None else weights_only
    local = isinstance(path, (str, os.PathLike)) and os.path.isfile(path)
    if local and not zipfile.is_zipfile(path):
        with open(path, "rb") as fh:
            head = fh.read(4)
        if head == b"PK\x03\x04":  # a zip archive's first entry, but no readable end: cut short
            raise CheckpointError(f"{path} is truncated or damaged: it starts as a torch.save archive but its end (the "
                                  f"archive's directory) is missing or unreadable ({os.path.getsize(path)} bytes; an "
                                  "interrupted copy or save?). Resume from another checkpoint")
        if not head.startswith(b"\x80"):  # neither torch.save's zip archive nor a (legacy) pickle
            what = "an empty file" if not head else "not a torch.save archive"
            raise CheckpointError(f"{path} is not a checkpoint: it is {what}")
    if local and zipfile.is_zipfile(path):
        check_archive(path)
    try:
        ckpt = checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as err:
        detail = next((line.strip() for line in str(err).splitlines() if "WeightsUnpickler error" in line
                       or "Unsupported global" in line), "")
        if local and zipfile.is_zipfile(path):
            detail = detail or "objects that are not tensors or plain containers"
            raise CheckpointError(
                f"{path} holds Python objects that a weights_only=True load refuses ({detail}). A Lightning "
                "checkpoint needs none; if you trust the file and need them, pass weights_only=False to trainer.fit"
            ) from None
        raise CheckpointError(
            f"{path} is not a checkpoint: torch.load cannot read it ({detail or type(err).__name__})") from None
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} is not a checkpoint: torch.load cannot read it ({first})") from None
    if not isinstance(ckpt, Mapping) or "state_dict" not in ckpt:
        raise CheckpointError(
            f"{path} is not a Lightning checkpoint: it holds a {type(ckpt).__name__} without a 'state_dict' entry"
        )
    check_finite(ckpt, path)
    return ckpt


def check_archive(path) -> None:
    """Every entry of the ``torch.save`` zip archive ``path`` against its stored CRC-32."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as err:  # a damaged header, a short read
        raise CheckpointError(f"{path} is damaged: its archive cannot be read ({err}). Resume from another "
                              "checkpoint") from None
    if bad is not None:
        what = ("a tensor's storage" if "/data/" in bad else "the pickled structure" if bad.endswith(".pkl")
                else "an entry")
        raise CheckpointError(
            f"{path} is damaged: archive entry {bad!r} ({what}) does not match its CRC-32 checksum, so the file "
            "changed after it was written (disk, copy or transfer error). Resume from another checkpoint"
        )


def _nonfinite(t) -> bool:
    """NaN/Inf in ``t`` (a DTensor shard: in this rank's piece, no collective)."""
    t = t.to_local() if is_sharded(t) else t
    return torch.is_tensor(t) and t.is_floating_point() and t.numel() > 0 and not bool(torch.isfinite(t).all())


def check_finite(ckpt: Mapping, path="checkpoint") -> None:
    """Refuse NaN/Inf in the model state and the optimizer states, naming the tensor."""
    bad = [f"state_dict[{k!r}]" for k, v in ckpt["state_dict"].items() if _nonfinite(v)]
    for o, sd in enumerate(ckpt.get("optimizer_states") or []):
        for index, state in ((sd or {}).get("state") or {}).items():
            for key, v in (state.items() if isinstance(state, Mapping) else ()):
                if _nonfinite(v):
                    bad.append(f"optimizer_states[{o}]['state'][{index!r}][{key!r}]")
    if bad:
        raise CheckpointError(
            f"{path} holds non-finite values (NaN or Inf) in {', '.join(bad[:_MAX_LISTED])}"
            + (f" and {len(bad) - _MAX_LISTED} more tensors" if len(bad) > _MAX_LISTED else "")
            + "; training from it would only produce NaN losses. Resume from an earlier checkpoint"
        )


_WHOLE_SHAPES_ATTR = "_dynmo_whole_state_shapes"


def whole_model_state_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The whole model's state-dict shapes, what checkpoints are checked against on every rank.

    Taken from the module the first time a strategy sets it up, while it still holds every layer
    (and every expert), and kept on it: setup replaces the layers other ranks own with
    placeholders and cuts experts to this rank's shard, so a later trainer stage with the same
    module (``trainer.validate(model, ckpt_path="best")`` after ``fit``, or another Trainer) would
    otherwise see only this rank's layers and refuse every whole-model checkpoint ("Unexpected
    key(s)"). A module changed by hand after a fit keeps the first record."""
    shapes = getattr(module, _WHOLE_SHAPES_ATTR, None)
    if shapes is None:
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        object.__setattr__(module, _WHOLE_SHAPES_ATTR, shapes)  # a plain attribute, not module state
    return dict(shapes)


def check_model_state(expected: Mapping[str, tuple[int, ...]], state: Mapping[str, Any], strict: bool,
                      name: str) -> None:
    """Compare a checkpoint's ``state_dict`` with the whole model's keys and shapes (not only
    this rank's), so every rank reaches the same verdict."""
    errors = []
    if strict:
        unexpected = [k for k in state if k not in expected]
        missing = [k for k in expected if k not in state]
        if unexpected:
            errors.append(f"Unexpected key(s) in state_dict: {_listed(unexpected)}.")
        if missing:
            errors.append(f"Missing key(s) in state_dict: {_listed(missing)}.")
    mismatched = [
        f"size mismatch for {k}: copying a param with shape {list(v.shape)} from checkpoint, the shape in current "
        f"model is {list(expected[k])}."
        for k, v in state.items() if k in expected and torch.is_tensor(v) and tuple(v.shape) != tuple(expected[k])
    ]
    errors += mismatched[:_MAX_LISTED]
    if errors:
        raise CheckpointError(
            f"Error(s) in loading state_dict for {name}:\n\t" + "\n\t".join(errors)
            + "\n(the checkpoint was saved from a different model; load it into the model it was saved from"
            + (", or pass strict=False to ignore missing/unexpected keys)" if strict else ")")
        )


def gather_to_zero(pipe: RankPipeline, obj: Any) -> list[Any] | None:
    """Gather ``obj`` from replica 0's pipeline ranks onto global rank 0 (None elsewhere)."""
    if pipe.layout.dp_rank != 0 or pipe.layout.released:
        return None
    if pipe.layout.pp_size == 1:
        return [obj]
    out = [None] * pipe.layout.pp_size if pipe.global_rank == 0 else None
    with explain_timeout(SAVE_ON_EVERY_RANK):
        dist.gather_object(obj, out, dst=0, group=pipe.groups.replicas[0])
    return out


def _whole_experts(pipe: RankPipeline, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` with every expert shard among them replaced by the whole tensor (collective
    over the expert peers; without expert parallelism ``tensors`` as they are)."""
    ep = pipe.expert_parallel
    if ep is None:
        return tensors
    sharded = _sharded_keys(pipe)
    return {**tensors, **ep.gather({k: v for k, v in tensors.items() if k in sharded}, pipe.device)}


def _sharded_keys(pipe: RankPipeline) -> set[str]:
    """The state-dict keys of the expert parameters (see :func:`~lightning_dynmo.protocol.state_dict_key`)."""
    module = pipe.module
    return {state_dict_key(module, name) for name in pipe.expert_parallel.sharded_parameters(module)}


def _own_shards(pipe: RankPipeline, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (whole tensors by parameter name) with expert parameters cut to this rank's shard."""
    ep = pipe.expert_parallel
    if ep is None:
        return state
    sharded = _sharded_keys(pipe)
    return {k: (ep.shard.take(v) if k in sharded else v) for k, v in state.items()}


def _own_optimizer_shards(pipe: RankPipeline, o: int, sd: dict) -> dict:
    """Optimizer ``o``'s single-process state dict with the per-parameter tensors of expert
    parameters cut to this rank's shard (the file's dict is left as it is)."""
    ep = pipe.expert_parallel
    if ep is None:
        return sd
    layout, shapes = pipe.optimizer_layout, pipe.full_state_shapes
    state = dict(sd["state"])
    for name in ep.sharded_parameters(pipe.module):
        slot = layout.slot(name)
        if slot is None or slot.optimizer != o or slot.index not in state:
            continue
        whole = tuple(shapes[state_dict_key(pipe.module, name)])
        state[slot.index] = {k: (ep.shard.take(v).clone() if torch.is_tensor(v) and tuple(v.shape) == whole else v)
                             for k, v in state[slot.index].items()}
    return {**sd, "state": state}


def full_model_state_dict(pipe: RankPipeline) -> dict[str, Any]:
    """The whole model's state dict on rank 0; empty elsewhere. Collective."""
    local = {k: whole(v).detach().cpu() for k, v in pipe.module.state_dict().items()}  # fsdp shards made whole
    local = _whole_experts(pipe, local)
    parts = gather_to_zero(pipe, local)
    full: dict[str, Any] = {}
    for part in parts or []:
        full.update(part)
    return merge_state(full, merges_of(pipe.module)) if full else full


def full_optimizer_state(pipe: RankPipeline, optimizer) -> dict[str, Any]:
    """``optimizer``'s state in single-process format on rank 0; empty elsewhere. Collective."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    o = OptimizerLayout.index_of(pipe.optimizers, opt)
    layout = pipe.optimizer_layout
    states = layout.local_states(pipe.module, pipe.optimizers, o)
    ep = pipe.expert_parallel
    if ep is not None:  # the per-parameter tensors (Adam's moments) of expert shards, made whole
        sharded = set(ep.sharded_parameters(pipe.module))
        shards = {(name, key): v for name, st in states.items() if name in sharded
                  for key, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
        for (name, key), v in ep.gather(shards, pipe.device).items():
            states[name][key] = v
    parts = gather_to_zero(pipe, states)
    if not parts:
        return {}
    merged: dict[str, dict] = {}
    for part in parts:
        merged.update(part)
    sd = layout.global_state_dict(opt, o, merged)
    return merge_optimizer_state(sd, _keys_by_index(pipe, o), merges_of(pipe.module))


def _keys_by_index(pipe: RankPipeline, o: int) -> dict[int, str]:
    """``{single-process index: state-dict key}`` of optimizer ``o``'s parameters (the names that
    checkpoint merges use, whatever the model's pipeline granularity)."""
    module = pipe.module
    return {i: state_dict_key(module, n) for i, n in pipe.optimizer_layout.names_by_index(o).items()}


def load_local_model_state(pipe: RankPipeline, checkpoint: dict, strict: bool = True) -> None:
    """Check the checkpoint against the whole model, then load the entries of the layers this rank holds."""
    module = pipe.module
    check_model_state(pipe.full_state_shapes, checkpoint["state_dict"], strict, type(module).__name__)
    merges = merges_of(module)  # parameters kept in pieces (e.g. a chunked LM head) load from their merged entry
    own = set(split_state(module.state_dict(), merges))
    state = _own_shards(pipe, {k: v for k, v in split_state(checkpoint["state_dict"], merges).items() if k in own})
    state.update(checkpoint.get(LOCAL_PIECES, {}).get("state_dict", {}))  # read as pieces (DCP): not cut from a whole
    current = module.state_dict()  # dp_sharding="fsdp": each whole tensor cut to this rank's shard
    state = {k: (shard_like(v, current[k]) if is_sharded(current.get(k)) else v) for k, v in state.items()}
    module.load_state_dict(state, strict=False)


def optimizer_type_problems(o: int, optimizer, sd: Any) -> list[str]:
    """A state dict saved by another optimizer type: its param groups carry settings the module's
    optimizer does not have *and* lack some it has (one side alone is a torch version adding or
    dropping a setting). torch would load it and fail at the first step (``KeyError: 'step'``)."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    groups = sd.get("param_groups") if isinstance(sd, Mapping) else None
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], Mapping) or not opt.param_groups:
        return []
    saved, own = set(groups[0]) - {"params"}, set(opt.param_groups[0]) - {"params"}
    if not (saved - own and own - saved):
        return []
    return [f"optimizer_states[{o}] was saved by another optimizer type than the module's {type(opt).__name__}: its "
            f"param groups have {sorted(saved - own)} where {type(opt).__name__}'s have {sorted(own - saved)}. Resume "
            "with the optimizer it was saved with, or load only the weights (the checkpoint's 'state_dict' into "
            "the module) and start the optimizer afresh"]


def load_local_optimizer_state(pipe: RankPipeline, checkpoint: dict) -> None:
    """Load the optimizer state of this rank's parameters from a single-process state dict."""
    states = checkpoint["optimizer_states"]
    optimizers = pipe.optimizers
    if len(states) != len(optimizers):
        raise CheckpointError(f"checkpoint has {len(states)} optimizers, the module configures {len(optimizers)}")
    problems = [p for o, (opt, sd) in enumerate(zip(optimizers, states)) for p in optimizer_type_problems(o, opt, sd)]
    if not problems:  # the same optimizer type: do the shapes fit (merged parameters split into their pieces)?
        module, layout = pipe.module, pipe.optimizer_layout
        merges = merges_of(module)  # state-dict keys, like full_state_shapes
        full = dict(pipe.full_state_shapes)
        for merged, pieces in merges.items():  # each piece: its rows of the merged parameter
            full.update({key: (rows, *full.get(merged, (0,))[1:]) for key, rows in pieces})
        # the layout names parameters as named_parameters() does (e.g. a sublayer GPT's pipeline indices)
        shapes = {name: full[key] for name in layout.slots if (key := state_dict_key(module, name)) in full}
        states = [split_optimizer_state(sd, _keys_by_index(pipe, o), layout.group_indices[o], merges)
                  if isinstance(sd, dict) and "param_groups" in sd else sd for o, sd in enumerate(states)]
        problems = [p for o, sd in enumerate(states) for p in layout.problems(o, sd, shapes)]
        for o, pieces in checkpoint.get(LOCAL_PIECES, {}).get("optimizer_states", {}).items():
            index = {n: i for i, n in _keys_by_index(pipe, o).items()}  # read as pieces (DCP): not cut from a whole
            for name, entries in pieces.items():
                states[o]["state"].setdefault(index[name], {}).update(entries)
    if problems:
        raise CheckpointError(
            "the checkpoint's optimizer state does not fit the module's optimizer: " + "; ".join(problems[:_MAX_LISTED])
            + (f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else "")
            + " (was it saved from a different model or configure_optimizers()?)"
        )
    for o, (opt, sd) in enumerate(zip(optimizers, states)):
        pipe.optimizer_layout.load_local(pipe.module, opt, o, _own_optimizer_shards(pipe, o, sd))
    _optimizers_to_device(optimizers, pipe.device)
    for opt in optimizers:  # dp_sharding="fsdp": state of a sharded parameter cut to this rank's shard
        for p, st in getattr(opt, "_optimizer", opt).state.items():
            if is_sharded(p):
                for k, v in st.items():
                    if torch.is_tensor(v) and not is_sharded(v) and tuple(v.shape) == tuple(p.shape):
                        st[k] = shard_like(v.to(p.dtype), p)
