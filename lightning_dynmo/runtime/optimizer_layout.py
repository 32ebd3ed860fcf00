"""Where every parameter sits in the user's optimizers, independent of the partition.

The strategy calls the module's ``configure_optimizers`` once on the full model, records for each
parameter (by its fully-qualified name, which carries the global layer index) the optimizer, the
group and its position in a single-process ``state_dict``, and then keeps only the local
parameters. Because of this record:

* a migrated parameter rejoins the same group with the same hyper-parameters on its new rank;
* a checkpoint's optimizer state has exactly the format a single-process run would write, so it
  resumes on any number of stages (or without the pipeline at all).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer


@dataclass(frozen=True)
class ParamSlot:
    optimizer: int
    group: int
    index: int  # position in the single-process optimizer state_dict of that optimizer


class OptimizerLayout:
    def __init__(self, slots: dict[str, ParamSlot], group_indices: list[list[list[int]]]) -> None:
        self.slots = slots
        self.group_indices = group_indices  # [optimizer][group] -> global indices, original order
        self._fqn_of_index = [
            {s.index: fqn for fqn, s in slots.items() if s.optimizer == o} for o in range(len(group_indices))
        ]

    @classmethod
    def record(cls, module: nn.Module, optimizers: list[Optimizer]) -> "OptimizerLayout":
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
        return cls(slots, group_indices)

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
        slot = self.slots.get(fqn)
        if slot is None:
            return None
        opt = optimizers[slot.optimizer]
        group = opt.param_groups[slot.group]
        group["params"] = [p for p in group["params"] if p is not param]
        return opt.state.pop(param, {})

    def attach_param(
        self, optimizers: list[Optimizer], module: nn.Module, fqn: str, param: torch.Tensor, state: dict | None
    ) -> None:
        """Insert ``param`` (already a parameter of ``module``) into its recorded group, in
        single-process order, with its migrated ``state``."""
        slot = self.slots.get(fqn)
        if slot is None:
            return
        opt = optimizers[slot.optimizer]
        group = opt.param_groups[slot.group]
        names = {id(p): n for n, p in module.named_parameters()}
        params = [p for p in group["params"] if p is not param] + [param]
        params.sort(key=lambda p: self.slots[names[id(p)]].index)
        group["params"] = params
        if state:
            opt.state[param] = state

    # -- checkpoint format ---------------------------------------------------------------------
    def local_states(self, module: nn.Module, optimizers: list[Optimizer], o: int) -> dict[str, dict]:
        """``{fqn: state}`` of this rank's parameters in optimizer ``o``, tensors on CPU."""
        opt = optimizers[o]
        out = {}
        for fqn, p in module.named_parameters():
            slot = self.slots.get(fqn)
            if slot is None or slot.optimizer != o or p not in opt.state:
                continue
            out[fqn] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in opt.state[p].items()}
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
                gi = self.slots[fqn_of[id(p)]].index
                if gi in global_sd["state"]:
                    local_state[k] = global_sd["state"][gi]
                ids.append(k)
                k += 1
            hp["params"] = ids
            local_groups.append(hp)
        optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})

    @staticmethod
    def index_of(optimizers: list[Optimizer], optimizer) -> int:
        """Position of ``optimizer`` (or the optimizer a Lightning wrapper holds) in ``optimizers``."""
        opt = getattr(optimizer, "_optimizer", optimizer)
        return next(i for i, x in enumerate(optimizers) if getattr(x, "_optimizer", x) is opt)

    def positions(self, module: nn.Module, optimizers: list[Optimizer], optimizer) -> tuple[list[tuple[int, nn.Parameter]], int]:
        """This rank's parameters of ``optimizer`` with their single-process positions, and the
        optimizer's total parameter count (what global-norm clipping needs)."""
        o = self.index_of(optimizers, optimizer)
        local = [(self.slots[n].index, p) for n, p in module.named_parameters()
                 if n in self.slots and self.slots[n].optimizer == o]
        return sorted(local, key=lambda t: t[0]), sum(len(g) for g in self.group_indices[o])
