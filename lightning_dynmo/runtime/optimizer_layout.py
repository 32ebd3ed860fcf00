"""Where every parameter sits in the user's optimizers, independent of the partition.

The strategy calls the module's ``configure_optimizers`` once on the full model, records for each
parameter (by its fully-qualified name, which carries the global layer index) the optimizer, the
group and its position in a single-process ``state_dict``, and then keeps only the local
parameters. Because of this record:

* a migrated parameter rejoins the same group with the same hyper-parameters on its new rank;
* a checkpoint's optimizer state has exactly the format a single-process run would write, so it
  resumes on any number of stages (or without the pipeline at all).

A tied parameter (one object used by several layers, see :mod:`.tied`) has one slot under its
first name; ``aliases`` maps its other names (which a rank sees when the first user is remote)
to that name.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


@dataclass(frozen=True)
class ParamSlot:
    optimizer: int
    group: int
    index: int  # position in the single-process optimizer state_dict of that optimizer


class OptimizerLayout:
    def __init__(self, slots: dict[str, ParamSlot], group_indices: list[list[list[int]]],
                 aliases: dict[str, str] | None = None) -> None:
        self.slots = slots
        self.group_indices = group_indices  # [optimizer][group] -> global indices, original order
        self.aliases = dict(aliases or {})  # tied-parameter name -> its first name (the slot's)
        self._fqn_of_index = [
            {s.index: fqn for fqn, s in slots.items() if s.optimizer == o} for o in range(len(group_indices))
        ]

    def name(self, fqn: str) -> str:
        """The slot name of ``fqn`` (itself, or the first name of a tied parameter)."""
        return self.aliases.get(fqn, fqn)

    def slot(self, fqn: str) -> ParamSlot | None:
        return self.slots.get(self.aliases.get(fqn, fqn))

    def fqn_of_index(self, o: int, index: int) -> str | None:
        return self._fqn_of_index[o].get(index)

    def names_by_index(self, o: int) -> dict[int, str]:
        """``{single-process index: name}`` of optimizer ``o``'s parameters."""
        return dict(self._fqn_of_index[o])

    @classmethod
    def record(cls, module: nn.Module, optimizers: list[Optimizer],
               aliases: dict[str, str] | None = None) -> "OptimizerLayout":
        fqn_of = {id(p): n for n, p in module.named_parameters()}
        slots: dict[str, ParamSlot] = {}
        group_indices: list[list[list[int]]] = []
        for o, opt in enumerate(optimizers):
            idx = 0
            groups = []
            for g, group in enumerate(opt.param_groups):
                ids = []
                for p in group["params"]:
                    fqn = fqn_of.get(id(p))
                    if fqn is None:
                        raise ValueError(
                            "configure_optimizers() returned a parameter that is not a parameter of the "
                            "LightningModule; the pipeline can only place parameters of its layers"
                        )
                    if fqn in slots:
                        raise ValueError(f"parameter {fqn} appears in more than one optimizer group")
                    slots[fqn] = ParamSlot(o, g, idx)
                    ids.append(idx)
                    idx += 1
                groups.append(ids)
            group_indices.append(groups)
        return cls(slots, group_indices, aliases)

    # -- local views ---------------------------------------------------------------------------
    @staticmethod
    def keep_only_local(module: nn.Module, optimizers: list[Optimizer]) -> None:
        """Drop parameters that are no longer attributes of ``module`` from every optimizer group."""
        local = {id(p) for p in module.parameters()}
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in local]
            for p in [p for p in opt.state if id(p) not in local]:
                del opt.state[p]

    def detach_param(self, optimizers: list[Optimizer], fqn: str, param: torch.Tensor) -> dict | None:
        """Remove ``param`` from its optimizer group; return its state (None if not optimized)."""
        slot = self.slot(fqn)
        if slot is None:
            return None
        opt = optimizers[slot.optimizer]
        group = opt.param_groups[slot.group]
        group["params"] = [p for p in group["params"] if p is not param]
        return opt.state.pop(param, {})

    def copy_state(self, optimizers: list[Optimizer], fqn: str, param: torch.Tensor) -> dict | None:
        """A copy of ``param``'s optimizer state, leaving it in place (a tied parameter that
        stays on this rank through another layer; None if not optimized)."""
        slot = self.slot(fqn)
        if slot is None:
            return None
        state = optimizers[slot.optimizer].state.get(param, {})
        return {k: (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in state.items()}

    def attach_param(
        self, optimizers: list[Optimizer], module: nn.Module, fqn: str, param: torch.Tensor, state: dict | None
    ) -> None:
        """Insert ``param`` (already a parameter of ``module``) into its recorded group, in
        single-process order, with its migrated ``state``."""
        slot = self.slot(fqn)
        if slot is None:
            return
        opt = optimizers[slot.optimizer]
        group = opt.param_groups[slot.group]
        names = {id(p): n for n, p in module.named_parameters()}
        params = [p for p in group["params"] if p is not param] + [param]
        params.sort(key=lambda p: self.slot(names[id(p)]).index)
        group["params"] = params
        if state:
            opt.state[param] = state

    # -- checkpoint format ---------------------------------------------------------------------
    def local_states(self, module: nn.Module, optimizers: list[Optimizer], o: int) -> dict[str, dict]:
        """``{fqn: state}`` of this rank's parameters in optimizer ``o``, tensors on CPU."""
        opt = optimizers[o]
        out = {}
        for fqn, p in module.named_parameters():
            slot = self.slot(fqn)
            if slot is None or slot.optimizer != o or p not in opt.state:
                continue
            out[self.name(fqn)] = {k: (_whole(v).detach().cpu().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                                   for k, v in opt.state[p].items()}
        return out

    def global_state_dict(self, optimizer: Optimizer, o: int, states: dict[str, dict]) -> dict:
        """The single-process ``state_dict`` of optimizer ``o`` assembled from every rank's states."""
        groups = []
        for g, group in enumerate(optimizer.param_groups):
            hp = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            hp["params"] = list(self.group_indices[o][g])
            groups.append(hp)
        fqn_of_index = self._fqn_of_index[o]
        state = {i: states[fqn_of_index[i]] for i in sorted(fqn_of_index) if fqn_of_index[i] in states}
        return {"state": state, "param_groups": groups}

    def load_local(self, module: nn.Module, optimizer: Optimizer, o: int, global_sd: dict) -> None:
        """Load the part of a single-process ``state_dict`` that belongs to this rank's parameters."""
        if len(global_sd["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(
                f"checkpoint optimizer {o} has {len(global_sd['param_groups'])} param groups, "
                f"the current one has {len(optimizer.param_groups)}"
            )
        fqn_of = {id(p): n for n, p in module.named_parameters()}
        local_groups, local_state, k = [], {}, 0
        for g, group in enumerate(optimizer.param_groups):
            hp = {key: v for key, v in global_sd["param_groups"][g].items() if key != "params"}
            ids = []
            for p in group["params"]:
                gi = self.slot(fqn_of[id(p)]).index
                if gi in global_sd["state"]:
                    local_state[k] = global_sd["state"][gi]
                ids.append(k)
                k += 1
            hp["params"] = ids
            local_groups.append(hp)
        optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})

    def problems(self, o: int, global_sd: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
        """What makes the single-process ``state_dict`` ``global_sd`` unfit for optimizer ``o``:
        group or parameter counts, unknown parameter indices, state tensors whose shape is not
        their parameter's (``shapes``: parameter name -> shape). Empty when it fits."""
        where = f"optimizer_states[{o}]"
        groups = global_sd.get("param_groups") if isinstance(global_sd, dict) else None
        if not isinstance(groups, list) or not isinstance(global_sd.get("state"), dict):
            return [f"{where} is not an optimizer state_dict (needs 'state' and 'param_groups')"]
        want = self.group_indices[o]
        if len(groups) != len(want):
            return [f"{where} has {len(groups)} param groups, the module's optimizer has {len(want)}"]
        out = []
        for g, (group, ids) in enumerate(zip(groups, want)):
            got = list(group.get("params", []))
            if len(got) != len(ids):
                out.append(f"{where} param group {g} has {len(got)} parameters, the module's optimizer has {len(ids)}")
            elif got != ids:
                out.append(f"{where} param group {g} lists parameters {got[:8]}..., expected {ids[:8]}...")
        known = self._fqn_of_index[o]
        for index, state in global_sd["state"].items():
            fqn = known.get(index)
            if fqn is None:
                out.append(f"{where}['state'] has an entry for parameter {index!r}, "
                           "which the module's optimizer does not have")
                continue
            shape = tuple(shapes.get(fqn, ()))
            for key, value in (state.items() if isinstance(state, dict) else ()):
                if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != shape:
                    out.append(f"{where}['state'][{index}][{key!r}] has shape {list(value.shape)}, but parameter "
                               f"{fqn} has shape {list(shape)}")
        return out

    @staticmethod
    def index_of(optimizers: list[Optimizer], optimizer) -> int:
        """Position of ``optimizer`` (or the optimizer a Lightning wrapper holds) in ``optimizers``."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        return next(i for i, x in enumerate(optimizers) if getattr(x, "_optimizer", x) is opt)

    def positions(self, module: nn.Module, optimizers: list[Optimizer],
                  optimizer) -> tuple[list[tuple[int, nn.Parameter]], int]:
        """This rank's parameters of ``optimizer`` with their single-process positions, and the
        optimizer's total parameter count (what global-norm clipping needs)."""
        o = self.index_of(optimizers, optimizer)
        local = [(self.slot(n).index, p) for n, p in module.named_parameters()
                 if self.slot(n) is not None and self.slot(n).optimizer == o]
        return sorted(local, key=lambda t: t[0]), sum(len(g) for g in self.group_indices[o])

    def replace_param(self, optimizers: list[Optimizer], fqn: str, old: torch.Tensor, new: torch.Tensor,
                      state_map: StateMap | None = None) -> bool:
        """Put ``new`` in place of ``old`` (the parameter named ``fqn``) in its recorded group, at
        the same position, and carry its state through ``state_map`` (see :func:`replace_param`).

        For a parameter that changes shape but not identity-by-name, e.g. a pruned layer whose
        master weight becomes its CSR values: the name, the slot (optimizer, group, single-process
        index) and the group's hyper-parameters stay, so the optimizer is not re-created, LR
        schedulers keep their optimizer, migration and clipping find the parameter by name, and
        checkpoints keep the single-process format. Returns False if ``fqn`` is not optimized."""
        slot = self.slot(fqn)
        if slot is None:
            return False
        return replace_param([optimizers[slot.optimizer]], old, new, state_map)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor shard (``dp_sharding="fsdp"``) all-gathered whole (collective over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


#: maps a tensor shaped like the old parameter (gradient, optimizer moment) to the new one's shape
StateMap = Callable[[torch.Tensor], torch.Tensor]


def replace_param(optimizers: list[Optimizer], old: torch.Tensor, new: torch.Tensor,
                  state_map: StateMap | None = None) -> bool:
    """Swap ``old`` for ``new`` in whichever of ``optimizers`` holds it, in place: the same group,
    the same position in it, its state moved to ``new`` with every tensor shaped like ``old``
    passed through ``state_map`` (e.g. Adam's moments gathered at a pruned layer's kept weights)
    and everything else (``step``) kept as it is. No optimizer is re-created and no group changes,
    so learning-rate schedulers and Lightning's optimizer wrappers stay valid. Returns False when
    no optimizer holds ``old``. Works with any strategy; :meth:`OptimizerLayout.replace_param` is
    the pipeline strategy's entry point by parameter name."""
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for group in opt.param_groups:
            params = group["params"]
            for k, p in enumerate(params):
                if p is old:
                    params[k] = new
                    state = opt.state.pop(old, None)
                    if state:
                        opt.state[new] = {
                            key: (state_map(v) if state_map is not None and torch.is_tensor(v) and v.dim() > 0
                                  and v.shape == old.shape else v)
                            for key, v in state.items()
                        }
                    return True
    return False
