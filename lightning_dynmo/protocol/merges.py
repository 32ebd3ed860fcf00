"""Checkpoint names for parameters that the pipeline keeps in pieces.

A model may split one logical parameter over several pipeline layers so that each piece can
migrate alone (the vocabulary-chunked LM head: one ``lm_head.weight`` row slice per chunk). Its
checkpoints should not depend on the split, so a run saved with one split resumes with another.
Such a model declares the split with an optional method

    ``checkpoint_merges() -> {merged_name: [(piece_name, rows), ...]}``

(pieces in order, concatenated along dim 0). This module translates between the two namings:
model state dicts (:func:`merge_state`, :func:`split_state`) and single-process optimizer state
dicts (:func:`merge_optimizer_state`, :func:`split_optimizer_state`: per-parameter tensors shaped
like the parameter are cut or joined by rows, the rest, such as Adam's ``step``, is the first
piece's; parameter indices are renumbered as if the pieces were one parameter).

A model's own ``state_dict()`` names a complete set of pieces by its merged name (a state-dict
hook); :func:`state_in_pieces` asks it for the pieces under their own names instead, for sharded
checkpoints that write each piece where it lives (``strategy/dcp_checkpoint.py``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch

Merges = Mapping[str, list[tuple[str, int]]]
State = dict[Any, Any]  # a state dict, or an optimizer's

__all__ = ["merges_of", "merge_state", "split_state", "merge_optimizer_state", "split_optimizer_state",
           "state_in_pieces", "merging_state", "piece_rows", "merged_names", "merged_indices"]
_IN_PIECES = "_dynmo_state_in_pieces"


def merges_of(module: object) -> dict[str, list[tuple[str, int]]]:
    fn = getattr(module, "checkpoint_merges", None)
    return dict(fn()) if callable(fn) else {}


@contextmanager
def state_in_pieces(module: object) -> Iterator[None]:
    """Within: ``module.state_dict()`` keeps the pieces under their own names (no merge)."""
    object.__setattr__(module, _IN_PIECES, True)
    try:
        yield
    finally:
        object.__setattr__(module, _IN_PIECES, False)


def merging_state(module: object) -> bool:
    """Whether a model's merge hook should merge now (not inside :func:`state_in_pieces`)."""
    return not getattr(module, _IN_PIECES, False)


def piece_rows(merges: Merges) -> dict[str, tuple[str, int, int]]:
    """``{piece: (merged name, first row, merged rows)}``."""
    out = {}
    for merged, pieces in merges.items():
        start, total = 0, sum(r for _, r in pieces)
        for name, rows in pieces:
            out[name] = (merged, start, total)
            start += rows
    return out


def merged_names(names: list[str], merges: Merges) -> list[str]:
    """``names`` (a param group's, in order) in the merged naming: each set of pieces once, as its merged name."""
    return list(dict.fromkeys(_merged_name(n, merges) for n in names))


def merged_indices(fqn_of_index: Mapping[int, str], merges: Merges) -> dict[str, int]:
    """``{name: index}`` of a single-process optimizer state dict in the merged naming (what
    :func:`split_optimizer_state` takes); without merges, ``fqn_of_index`` inverted."""
    if not merges:
        return {n: i for i, n in fqn_of_index.items()}
    return _canonical_order(fqn_of_index, merges)[0]


def merge_state(state: State, merges: Merges) -> State:
    """``state`` with every complete set of pieces replaced, in place of the first, by its merged
    entry (incomplete sets stay as they are: a rank's partial view)."""
    for merged, pieces in merges.items():
        names = [n for n, _ in pieces]
        if not all(n in state for n in names):
            continue
        whole = torch.cat([state[n] for n in names], dim=0)
        out = type(state)()
        for k, v in state.items():
            if k == names[0]:
                out[merged] = whole
            elif k not in names:
                out[k] = v
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata  # type: ignore[attr-defined]  # a state_dict()'s OrderedDict
        state = out
    return state


def split_state(state: State, merges: Merges) -> State:
    """``state`` with every merged entry replaced by its pieces (row slices)."""
    for merged, pieces in merges.items():
        whole = state.get(merged)
        if not torch.is_tensor(whole) or whole.shape[0] != sum(r for _, r in pieces) or len(pieces) == 1:
            continue  # absent, or already a piece (the first piece may carry the merged name)
        out = type(state)()
        for k, v in state.items():
            if k == merged:
                start = 0
                for name, rows in pieces:
                    out[name] = v[start:start + rows].clone()
                    start += rows
            else:
                out[k] = v
        if hasattr(state, "_metadata"):
            out._metadata = state._metadata  # type: ignore[attr-defined]  # a state_dict()'s OrderedDict
        state = out
    return state


def _canonical_order(fqn_of_index: Mapping[int, str], merges: Merges) -> tuple[dict[str, int], set[int]]:
    """Merged-naming index of every name (pieces map to their merged name's index) and the
    indices of the pieces after the first, which the merged naming drops."""
    piece_of = {n: m for m, pieces in merges.items() for n, _ in pieces}
    firsts = {pieces[0][0] for pieces in merges.values()}
    index_of: dict[str, int] = {}
    dropped: set[int] = set()
    c = 0
    for i in sorted(fqn_of_index):
        name = fqn_of_index[i]
        if name in piece_of and name not in firsts:
            dropped.add(i)
            continue
        index_of[piece_of.get(name, name)] = c
        c += 1
    return index_of, dropped


def _join(states: list[State]) -> State:
    out: State = {}
    for key, v in states[0].items():
        if torch.is_tensor(v) and v.dim() > 0:
            out[key] = torch.cat([s[key] for s in states], dim=0)
        else:
            out[key] = v
    return out


def merge_optimizer_state(sd: State, fqn_of_index: Mapping[int, str], merges: Merges) -> State:
    """A single-process optimizer ``state_dict`` over the pieces, in the merged naming."""
    if not merges or not any(n in fqn_of_index.values() for p in merges.values() for n, _ in p):
        return sd
    index_of, dropped = _canonical_order(fqn_of_index, merges)
    by_name = {fqn_of_index[i]: st for i, st in sd["state"].items() if i in fqn_of_index}
    state = {}
    for i in sorted(fqn_of_index):
        name = fqn_of_index[i]
        if i in dropped:
            continue
        merged = next((m for m, pieces in merges.items() if pieces[0][0] == name), None)
        if merged is not None:
            parts = [by_name[n] for n, _ in merges[merged] if n in by_name]
            if len(parts) == len(merges[merged]):
                state[index_of[merged]] = _join(parts)
        elif name in by_name:
            state[index_of[name]] = by_name[name]
    groups = []
    for group in sd["param_groups"]:
        g = dict(group)
        g["params"] = [index_of[_merged_name(fqn_of_index[i], merges)] for i in group["params"] if i not in dropped]
        groups.append(g)
    return {"state": state, "param_groups": groups}


def _merged_name(name: str, merges: Merges) -> str:
    return next((m for m, pieces in merges.items() if name in {n for n, _ in pieces}), name)


def split_optimizer_state(sd: State, fqn_of_index: Mapping[int, str], group_indices: list[list[int]],
                          merges: Merges) -> State:
    """A merged-naming optimizer ``state_dict`` in the pieces' naming (``fqn_of_index`` and
    ``group_indices``: the module's own single-process layout). A ``state_dict`` that already has
    the module's parameter count is returned as it is."""
    count = sum(len(g.get("params", [])) for g in sd.get("param_groups", []))
    if not merges or count == len(fqn_of_index):
        return sd
    index_of, _ = _canonical_order(fqn_of_index, merges)
    if count != len(index_of):
        return sd  # neither layout: OptimizerLayout.problems names what does not fit
    rows = {n: (m, r) for m, pieces in merges.items() for n, r in pieces}
    state = {}
    for i in sorted(fqn_of_index):
        name = fqn_of_index[i]
        if name not in rows:
            if index_of[name] in sd["state"]:
                state[i] = sd["state"][index_of[name]]
            continue
        merged, _ = rows[name]
        whole = sd["state"].get(index_of[merged])
        if whole is None:
            continue
        start = 0
        for n, r in merges[merged]:
            if n == name:
                break
            start += r
        total = sum(r for _, r in merges[merged])
        # every piece its own tensors: optimizers update state in place (Adam's step += 1)
        state[i] = {k: (v[start:start + rows[name][1]].clone() if v.dim() > 0 and v.shape[0] == total else v.clone())
                    if torch.is_tensor(v) else v for k, v in whole.items()}
    groups = []
    for group, ids in zip(sd["param_groups"], group_indices):
        g = dict(group)
        g["params"] = list(ids)
        groups.append(g)
    return {"state": state, "param_groups": groups}
