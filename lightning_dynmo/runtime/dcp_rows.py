"""``torch.distributed.checkpoint`` planners for a tensor that a rank holds as row slices.

A model may keep one logical parameter in pieces on several pipeline layers (``checkpoint_merges()``,
the vocabulary-chunked LM head), so which rows a rank holds depends on the chunk count and the
layout. DCP already stores a tensor as chunks with offsets (a DTensor's shards) and reads any
chunks back into any other: these planners only say that the rank's pieces are chunks of one
tensor. A :class:`RowPieces` (the whole tensor's size, and each piece with its first row; a value
of the state dict to save, a constructor argument of the load planner) is written as one chunk
per piece, or per DTensor shard of a piece (offsets shifted by the piece's first row), and read
back the same way into the pieces of another split; every other value goes through DCP's default
planners unchanged. Nothing is concatenated or gathered, so the
checkpoint holds one tensor under the merged name whatever the split, and DCP's deduplication
(replicas of a piece) and coverage check (every row written once) apply as to any tensor. The
helpers at the end turn a model's ``checkpoint_merges()`` pieces into :class:`RowPieces` and back.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from ..protocol.merges import Merges, piece_rows

__all__ = ["RowPieces", "RowPiecesSavePlanner", "RowPiecesLoadPlanner", "merged_row_pieces", "merged_optimizer_rows",
           "pieces_by_name"]


@dataclass
class RowPieces:
    """Row slices ``(first row, tensor)`` of one tensor of shape ``size`` that this rank holds
    (plain tensors or DTensors: a DTensor contributes its local shard)."""

    size: torch.Size
    pieces: list[tuple[int, torch.Tensor]]

    def chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """This rank's ``(offsets in the whole tensor, local tensor)`` pairs."""
        out = []
        for start, t in self.pieces:
            if isinstance(t, DTensor):
                (chunk,) = t.__create_chunk_list__()
                offsets, local = tuple(chunk.offsets), t.to_local()
            else:
                offsets, local = (0,) * t.dim(), t
            out.append(((offsets[0] + start, *offsets[1:]), local))
        return out


class RowPiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner; :class:`RowPieces` values are written as chunks of one tensor."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)  # flat; the mappings keep RowPieces' paths
        self._rows = {k: v for k, v in self.state_dict.items() if isinstance(v, RowPieces)}
        self.state_dict = {k: v for k, v in self.state_dict.items() if k not in self._rows}
        self._chunks: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for fqn, rows in self._rows.items():
            for offsets, local in rows.chunks():
                self._chunks[(fqn, offsets)] = local
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), local.size()),
                                                properties=TensorProperties.create_from_tensor(local),
                                                size=torch.Size(rows.size))))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.offset is not None and (index.fqn, tuple(index.offset)) in self._chunks:
            return self._chunks[(index.fqn, tuple(index.offset))]
        return super().lookup_object(index)


class RowPiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner; the pieces of ``rows`` (flat DCP keys, not in the state dict:
    DCP's load set-up drops values that are not tensors) are filled with their rows of the saved
    tensor, whatever chunks saved it."""

    def __init__(self, rows: Mapping[str, RowPieces], **kwargs) -> None:
        super().__init__(**kwargs)
        self._rows = dict(rows)
        self._chunks: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self):
        # the default plan of the other values (the state dict holds only keys the checkpoint has)
        plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        items = []
        for fqn, rows in self._rows.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(rows.size):
                raise ValueError(f"{fqn}: the checkpoint holds {getattr(md, 'size', 'no tensor')}, the pieces are "
                                 f"rows of {list(rows.size)}")
            local = []
            for offsets, t in rows.chunks():
                self._chunks[(fqn, offsets)] = t
                local.append(ChunkStorageMetadata(torch.Size(offsets), t.size()))
            items += create_read_items_for_chunk_list(fqn, md, local)
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and (index.fqn, tuple(index.offset)) in self._chunks:
            return self._chunks[(index.fqn, tuple(index.offset))]
        return super().lookup_tensor(index)


# ------------------------------------------------- checkpoint_merges() pieces <-> RowPieces
def merged_row_pieces(entries: dict[str, Any], merges: Merges) -> dict[str, Any]:
    """``entries`` (by state-dict key) with the local pieces of each merged parameter as one
    :class:`RowPieces` under the merged name: its rows, written where they live."""
    rows = piece_rows(merges)
    out: dict[str, Any] = {}
    for key, v in entries.items():
        if key not in rows:
            out[key] = v
            continue
        merged, start, total = rows[key]
        if not isinstance(out.get(merged), RowPieces):
            out[merged] = RowPieces(torch.Size((total, *v.shape[1:])), [])
        out[merged].pieces.append((start, v))
    return out


def merged_optimizer_rows(state: dict[str, dict], merges: Merges) -> dict[str, dict]:
    """Per-parameter optimizer ``state`` in the merged naming: a piece's per-row tensors (Adam's
    moments) as :class:`RowPieces` of the merged entry, the rest (Adam's ``step``) the first piece's,
    as :func:`~lightning_dynmo.protocol.merges.merge_optimizer_state` has it."""
    rows = piece_rows(merges)
    out: dict[str, dict] = {}
    for key, st in state.items():
        if key not in rows:
            out[key] = st
            continue
        merged, start, total = rows[key]
        piece = dict(merges[merged])[key]
        into = out.setdefault(merged, {})
        for entry, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == piece:
                if not isinstance(into.get(entry), RowPieces):
                    into[entry] = RowPieces(torch.Size((total, *v.shape[1:])), [])
                into[entry].pieces.append((start, v))
            elif start == 0:
                into[entry] = v
    return out


def pieces_by_name(rows: Mapping[str, RowPieces], merges: Merges, prefix: str) -> dict[str, Any]:
    """The pieces read into ``rows`` (by flat DCP key: ``<prefix><merged>`` for the model,
    ``optimizer_<o>.state.<merged>.<entry>``), by piece name: ``{"state_dict": {piece: tensor},
    "optimizer_states": {o: {piece: {entry: tensor}}}}``."""
    piece_at = {(merged, start): name for name, (merged, start, _) in piece_rows(merges).items()}
    model: dict[str, Any] = {}
    optim: dict[int, dict[str, dict]] = {}
    for k, v in rows.items():
        if k.startswith(prefix):
            model.update({piece_at[(k[len(prefix):], start)]: t for start, t in v.pieces})
            continue
        head, _, rest = k.partition(".")
        merged, _, entry = rest[len("state."):].rpartition(".")
        per = optim.setdefault(int(head[len("optimizer_"):]), {})
        for start, t in v.pieces:
            per.setdefault(piece_at[(merged, start)], {})[entry] = t
    return {"state_dict": model, "optimizer_states": optim}
