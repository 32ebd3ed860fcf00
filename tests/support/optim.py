"""How a single-process optimizer numbers its parameters, what a checkpoint's state is keyed by."""
from __future__ import annotations


def state_index(model) -> dict[str, int]:
    """Parameter name -> its key in the state dict of ``model.configure_optimizers()``'s optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [p for g in model.configure_optimizers()["optimizer"].param_groups for p in g["params"]]
    return {names[id(p)]: i for i, p in enumerate(order)}
