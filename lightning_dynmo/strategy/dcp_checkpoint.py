"""Sharded checkpoints with ``torch.distributed.checkpoint`` (``checkpoint_format="dcp"``).

A checkpoint is a directory, laid out as Lightning's own ``ModelParallelStrategy`` writes one:
DCP's ``.metadata`` and ``__<rank>_0.distcp`` shard files, plus ``meta.pt`` (rank 0) with the
small Lightning state (epoch, global step, loops, callbacks, schedulers). Every rank writes the
layers it holds, under the names a plain single-process module has (``state_dict`` keys with
global layer indices, optimizer state keyed by those names as
``torch.distributed.checkpoint.state_dict`` keys it); nothing is gathered onto rank 0, and a
tensor that several ranks hold (data-parallel replicas, a tied parameter's copies) is written
once (DCP's save planner deduplicates equal keys). Under ``dp_sharding="fsdp"`` parameters and
Adam's moments are DTensor shards: DCP writes each rank's piece as a chunk of the whole tensor
(no gather, no whole tensor on any rank) and loading reads into DTensors laid out as this rank's
shards (:func:`_read_target`), so each replica reads only its rows, whatever layout saved them.

Loading reads DCP's metadata on every rank, so the checks that need the whole model (names,
shapes, optimizer count, type and groups) reach the same verdict everywhere before any tensor is
read; then each rank reads only its own layers' entries (``dcp.load`` with a state dict of just
those), checks them for NaN/Inf and agrees with its peers on one verdict, so a bad checkpoint
fails with the same message on every rank. DCP stores no checksums: saving records a CRC-32 of
every file in ``meta.pt`` and loading checks them (each rank a share of the files), naming a
damaged or missing shard. The loaded entries are handed to the single-format loaders of
:mod:`.checkpoint` (the rest of the model appears there as meta tensors with the saved shapes),
so expert-parallel slicing and the optimizer checks are the same code for both formats.

A parameter kept in pieces on several layers (``checkpoint_merges()``, a vocabulary-chunked head)
is written under its merged name, each rank's pieces as row chunks of the one tensor
(:mod:`~lightning_dynmo.runtime.dcp_rows`), and read back as this rank's pieces' rows, whatever
chunk count and layout saved it; the loaders take those pieces as they are
(:data:`.checkpoint.LOCAL_PIECES`), the merged entry staying a meta tensor for the checks.

:func:`consolidate_checkpoint` turns such a directory into one single-process Lightning file
(the format of ``checkpoint_format="single"``), for plain Lightning or HF ``save_pretrained``.
"""
from __future__ import annotations

import os
import pickle
import zlib
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as dtensor_empty

from ..protocol import state_dict_key
from ..protocol.merges import merged_indices, merged_names, merges_of, state_in_pieces
from ..runtime.dcp_rows import (RowPieces, RowPiecesLoadPlanner, RowPiecesSavePlanner, merged_optimizer_rows,
                                merged_row_pieces, pieces_by_name)
from ..runtime.optimizer_layout import OptimizerLayout
from .checkpoint import (LOCAL_PIECES, CheckpointError, _keys_by_index, _listed, _nonfinite, _whole_experts,
                         check_archive, check_model_state)
from .state import RankPipeline

META = _METADATA_FILENAME  # "meta.pt", as Lightning's ModelParallelStrategy names it
DCP_METADATA = ".metadata"
CRC_KEY = "dynmo_dcp_crc32"  # in meta.pt: {file name: CRC-32} of the DCP files of this save
MODEL = "state_dict"
_CHUNK = 1 << 22
LOAD_ON_EVERY_RANK = ("Loading a DCP checkpoint is collective: every rank reads its own layers, and a rank did "
                      "not join (if none stopped, see its log)")


def is_dcp_checkpoint(path) -> bool:
    """A checkpoint directory (DCP files and ``meta.pt``), as Lightning's ``_is_sharded_checkpoint`` tells it."""
    return isinstance(path, (str, os.PathLike)) and Path(path).is_dir() and (Path(path) / META).is_file()


# ---------------------------------------------------------------------------------------- save
def local_model_state(pipe: RankPipeline) -> dict[str, Any]:
    """This rank's layers' state under single-process names (no copies; expert shards made whole
    over their peers, a collective; the pieces of a ``checkpoint_merges()`` parameter as the
    merged name's :class:`RowPieces`)."""
    module = pipe.module
    with state_in_pieces(module):
        state = {k: v.detach() for k, v in module.state_dict().items()}
    return merged_row_pieces(_whole_experts(pipe, state), merges_of(module))


def local_optimizer_state(pipe: RankPipeline, optimizer) -> dict[str, Any]:
    """``optimizer``'s state of this rank's parameters keyed by state-dict name, and every param
    group (hyper-parameters, and the names of all its parameters in single-process order), as
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` writes it."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    o = OptimizerLayout.index_of(pipe.optimizers, opt)
    layout, module = pipe.optimizer_layout, pipe.module
    state: dict[str, dict] = {}
    for name, p in module.named_parameters():
        slot = layout.slot(name)
        if slot is not None and slot.optimizer == o and p in opt.state:
            state[state_dict_key(module, layout.name(name))] = {k: (v.detach() if torch.is_tensor(v) else v)
                                                                for k, v in opt.state[p].items()}
    ep = pipe.expert_parallel
    if ep is not None:  # expert shards' per-parameter tensors (Adam's moments) made whole, as their weights
        sharded = {state_dict_key(module, n) for n in ep.sharded_parameters(module)}
        shards = {(key, k): v for key, st in state.items() if key in sharded
                  for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
        for (key, k), v in ep.gather(shards, pipe.device).items():
            state[key] = {**state[key], k: v}
    names, merges = _keys_by_index(pipe, o), merges_of(module)
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": merged_names([names[i] for i in layout.group_indices[o][g]], merges)}
              for g, group in enumerate(opt.param_groups)]
    return {"state": merged_optimizer_rows(state, merges), "param_groups": groups}


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def save(checkpoint: dict[str, Any], path, global_rank: int) -> None:
    """Write ``checkpoint`` (every rank's local state dicts and rank 0's Lightning state) into the
    directory ``path``. Collective over the default process group."""
    path = Path(path)
    if global_rank == 0:
        if path.is_file():  # a single-format file of the same name (e.g. last.ckpt) is replaced
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        for stale in [*path.glob("*.distcp"), path / DCP_METADATA, path / META]:
            stale.unlink(missing_ok=True)  # a previous save of another world size left other shard files
    dist.barrier()
    state = {MODEL: checkpoint.pop("state_dict")}
    state.update({f"optimizer_{o}": sd for o, sd in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1), planner=RowPiecesSavePlanner())
    del state
    own = {f.name: _crc32(f) for f in sorted(path.glob(f"__{global_rank}_*.distcp"))}
    if global_rank == 0:
        own[DCP_METADATA] = _crc32(path / DCP_METADATA)
    crcs = [None] * dist.get_world_size() if global_rank == 0 else None
    dist.gather_object(own, crcs, dst=0)
    if global_rank == 0:
        checkpoint[CRC_KEY] = {name: crc for part in crcs for name, crc in part.items()}
        torch.save(checkpoint, path / META)
    dist.barrier()  # the directory is complete on every rank's return


# ---------------------------------------------------------------------------------------- load
def _agree(problems: list[str], head: str, collective: bool = True) -> None:
    """Raise one error naming every rank's problems on every rank (none: return); ``collective=False``:
    this process alone (consolidation, which may run on one rank of a job)."""
    if collective and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, problems)
        problems = [p for part in parts for p in part]
    if problems:
        unique = list(dict.fromkeys(problems))
        raise CheckpointError(f"{head}: " + "; ".join(unique[:30])
                              + (f" (and {len(unique) - 30} more)" if len(unique) > 30 else ""))


def read_meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """``meta.pt`` read safely (its archive's CRCs first, ``weights_only=True`` unless told otherwise)."""
    meta = path / META
    check_archive(meta)
    try:
        out = torch.load(meta, weights_only=True if weights_only is None else weights_only, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{meta} holds Python objects that a weights_only=True load refuses ({err}). If you "
                              "trust the checkpoint, pass weights_only=False to trainer.fit") from None
    if not isinstance(out, Mapping):
        raise CheckpointError(f"{meta} is not a Lightning checkpoint's metadata: it holds a {type(out).__name__}")
    return dict(out)


def check_files(path: Path, crcs: Mapping[str, int], rank: int, world: int) -> None:
    """Every DCP file against the CRC-32 recorded at save; rank r checks every world-th file and
    all ranks raise the same error. ``.metadata`` is checked by every rank (each reads it)."""
    def problem(name: str) -> list[str]:
        f = path / name
        if not f.is_file():
            return [f"shard file {str(f)!r} is missing"]
        if _crc32(f) != crcs[name]:
            return [f"shard file {str(f)!r} is damaged: it does not match the CRC-32 recorded when it was saved "
                    "(disk, copy or transfer error)"]
        return []

    head = f"{path} cannot be loaded"
    if DCP_METADATA in crcs and (bad := problem(DCP_METADATA)):
        raise CheckpointError(f"{head}: {bad[0]}. Resume from another checkpoint")
    names = sorted(n for n in crcs if n != DCP_METADATA)
    _agree([p for n in names[rank::world] for p in problem(n)], head, collective=world > 1)


def _meta_tensor(md: TensorStorageMetadata) -> torch.Tensor:
    return torch.empty(md.size, dtype=md.properties.dtype, device="meta")


def _read_target(md: TensorStorageMetadata, like: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
    """What ``dcp.load`` reads the saved tensor ``md`` (or ``rows`` of its rows: a piece) into: a
    DTensor laid out as ``like`` when ``like`` is one of that global shape (``dp_sharding="fsdp"``:
    DCP reads only this rank's rows of whatever chunks were saved), else a whole tensor."""
    size = tuple(md.size) if rows is None else (rows, *md.size[1:])
    if isinstance(like, DTensor) and tuple(like.shape) == size:
        return dtensor_empty(size, dtype=md.properties.dtype, device_mesh=like.device_mesh, placements=like.placements)
    return torch.empty(size, dtype=md.properties.dtype)


def _pieces_target(md: TensorStorageMetadata, local: Mapping[str, torch.Tensor], merges,
                   merged: str) -> RowPieces | None:
    """This rank's pieces of the merged tensor ``md`` (``local``: its pieces by name), or None if it holds none."""
    start, pieces = 0, []
    for name, rows in merges[merged]:
        if name in local:
            pieces.append((start, _read_target(md, local[name], rows)))
        start += rows
    return RowPieces(md.size, pieces) if pieces else None


def load(pipe: RankPipeline, path, weights_only: bool | None, strict: bool) -> dict[str, Any]:
    """The checkpoint directory ``path`` as a single-format checkpoint dict whose ``state_dict``
    and ``optimizer_states`` hold this rank's entries as tensors and everyone else's as meta
    tensors (shapes only), for :func:`.checkpoint.load_local_model_state` and
    :func:`.checkpoint.load_local_optimizer_state`. Collective over the default process group."""
    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = read_meta(path, weights_only)
    check_files(path, ckpt.pop(CRC_KEY, {}), rank, world)
    try:
        md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as err:  # noqa: BLE001 - any unreadable .metadata is named, on every rank alike
        raise CheckpointError(f"{path} cannot be loaded: its DCP metadata {str(path / DCP_METADATA)!r} cannot be "
                              f"read ({type(err).__name__}: {err})") from None
    prefix = MODEL + "."
    saved = {k[len(prefix):]: _meta_tensor(v) for k, v in md.items() if k.startswith(prefix)
             and isinstance(v, TensorStorageMetadata)}
    module = pipe.module
    check_model_state(pipe.full_state_shapes, saved, strict, type(module).__name__)  # the whole model, every rank
    merges = merges_of(module)  # a merged parameter is read as this rank's pieces' rows
    with state_in_pieces(module):
        current = module.state_dict()
    request: dict[str, Any] = {}  # flat DCP keys -> what to read them into
    rows: dict[str, RowPieces] = {}  # flat DCP keys -> this rank's pieces of a merged tensor
    for key in current.keys() & saved.keys() - merges.keys():  # whole tensors or fsdp shards (expert: cut later)
        request[prefix + key] = _read_target(md[prefix + key], current[key])
    for merged in merges.keys() & saved.keys():
        if (pieces := _pieces_target(md[prefix + merged], current, merges, merged)) is not None:
            rows[prefix + merged] = pieces
    optimizers = pipe.optimizers
    opt_keys = sorted({k.split(".", 1)[0] for k in md if k.startswith("optimizer_")})
    if optimizers and opt_keys:
        if len(opt_keys) != len(optimizers):
            raise CheckpointError(f"checkpoint has {len(opt_keys)} optimizers, the module configures {len(optimizers)}")
        local_params = {state_dict_key(module, pipe.optimizer_layout.name(n)): p for n, p in module.named_parameters()}
        for k, m in md.items():
            head, _, rest = k.partition(".")
            if not head.startswith("optimizer_"):
                continue
            # param groups: small values every rank reads (hyper-parameters, parameter names)
            name = rest[len("state."):].rsplit(".", 1)[0] if rest.startswith("state.") else None
            if name in merges:  # per-row tensors as this rank's pieces' rows; the rest (step) whole
                per_row = isinstance(m, TensorStorageMetadata) and len(m.size) > 0 and \
                    m.size[0] == sum(r for _, r in merges[name])
                pieces = _pieces_target(m, local_params, merges, name) if per_row else None
                if pieces is not None:
                    rows[k] = pieces
                elif not per_row and any(n in local_params for n, _ in merges[name]):
                    request[k] = torch.empty(m.size, dtype=m.properties.dtype) \
                        if isinstance(m, TensorStorageMetadata) else None
                continue
            if rest.startswith("param_groups.") or name in local_params:  # moments of an fsdp shard: shards too
                request[k] = _read_target(m, local_params.get(name)) if isinstance(m, TensorStorageMetadata) else None
    try:
        dcp.load(request, storage_reader=dcp.FileSystemReader(path), planner=RowPiecesLoadPlanner(rows))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP gathers every rank's read errors
        raise CheckpointError(f"{path} cannot be loaded: reading its shards failed ({type(err).__name__}: "
                              f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})") from None
    bad = [k for k, v in request.items() if _nonfinite(v)]
    bad += [k for k, v in rows.items() if any(_nonfinite(t) for _, t in v.pieces)]
    _agree([f"{k!r}" for k in bad], f"{path} holds non-finite values (NaN or Inf), so training from it would only "
           "produce NaN losses; resume from an earlier checkpoint. Tensors")
    ckpt["state_dict"] = {**saved, **{k[len(prefix):]: v for k, v in request.items() if k.startswith(prefix)}}
    if optimizers and opt_keys:
        ckpt["optimizer_states"] = [_native_optimizer_state(pipe, o, md, request) for o in range(len(opt_keys))]
    if rows:  # the merged entries stay meta above; the loaders take this rank's pieces from here
        ckpt[LOCAL_PIECES] = pieces_by_name(rows, merges, prefix)
    return ckpt


def _native_optimizer_state(pipe: RankPipeline, o: int, md: Mapping[str, Any], request: Mapping[str, Any]) -> dict:
    """Optimizer ``o``'s single-process ``state_dict`` (parameters by index): this rank's
    entries as read, the others' tensors as meta tensors with their saved shapes."""
    head = f"optimizer_{o}."
    groups: dict[int, dict] = {}
    state: dict[str, dict] = {}
    for k, m in md.items():
        if not k.startswith(head):
            continue
        rest = k[len(head):]
        if rest.startswith("param_groups."):
            g, _, hp = rest[len("param_groups."):].partition(".")
            groups.setdefault(int(g), {})[hp] = request[k]
        elif rest.startswith("state."):
            name, _, entry = rest[len("state."):].rpartition(".")
            value = request[k] if k in request else (_meta_tensor(m) if isinstance(m, TensorStorageMetadata) else 0)
            state.setdefault(name, {})[entry] = value
    param_groups = [groups[g] for g in sorted(groups)]
    index_of = {name: i for i, name in enumerate(n for g in param_groups for n in g.get("params", []))}
    unknown = [n for n in state if n not in index_of]
    if unknown:
        raise CheckpointError(f"optimizer_{o} of the checkpoint has state for parameters its param groups do not "
                              f"list: {_listed(unknown)}")
    names = _keys_by_index(pipe, o)  # the module's single-process index of each name (merged: split by the loader)
    want = merged_indices(names, merges_of(pipe.module))
    missing = [n for n in index_of if n not in want]
    if missing:
        raise CheckpointError(f"optimizer_{o} of the checkpoint optimizes parameters the module's optimizer does not "
                              f"have: {_listed(missing)} (was it saved from a different model?)")
    for g in param_groups:
        g["params"] = [want[n] for n in g.get("params", [])]
    return {"state": {want[n]: st for n, st in state.items()}, "param_groups": param_groups}


# ---------------------------------------------------------------------------------------- export
def consolidate_checkpoint(directory, out_file) -> dict[str, Any]:
    """Write the DCP checkpoint ``directory`` as one single-process Lightning checkpoint file
    ``out_file`` (``state_dict`` and torch's index-keyed ``optimizer_states``: what
    ``checkpoint_format="single"`` writes, what plain Lightning resumes from and what
    ``HFCausalLM.save_pretrained(dir, state_dict=...)`` exports). Runs in one process, without a
    process group, and needs the whole state in memory. Returns the checkpoint dict."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    directory = Path(directory)
    if not is_dcp_checkpoint(directory):
        raise CheckpointError(f"{directory} is not a DCP checkpoint directory (it needs {META} and DCP's files)")
    ckpt = read_meta(directory, None)
    check_files(directory, ckpt.pop(CRC_KEY, {}), 0, 1)
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(directory), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    ckpt["state_dict"] = state.pop(MODEL)
    optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        ckpt["optimizer_states"] = [_index_keyed(state.pop(k)) for k in optimizers]
    bad = [f"state_dict[{k!r}]" for k, v in ckpt["state_dict"].items() if _nonfinite(v)]
    if bad:
        raise CheckpointError(f"{directory} holds non-finite values (NaN or Inf) in {', '.join(bad[:30])}")
    torch.save(ckpt, out_file)
    return ckpt


def _index_keyed(sd: Mapping[str, Any]) -> dict:
    """A name-keyed optimizer state dict as ``Optimizer.state_dict()`` has it: parameters numbered
    in param-group order."""
    groups = [dict(g) for g in sd["param_groups"]]
    index_of = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
    for g in groups:
        g["params"] = [index_of[n] for n in g["params"]]
    return {"state": {index_of[n]: st for n, st in sd.get("state", {}).items()}, "param_groups": groups}
