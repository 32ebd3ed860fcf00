"""``runtime/fsdp.py: copy_attributes``: a sharded layer leaves as its copy from before sharding,
with the plain attributes changed since taken from the live layer (what ``replicate``'s migration
carries by copying the live layer), and nothing of FSDP2's."""
from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_dynmo.runtime.fsdp import copy_attributes


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)
        self.capacity = 0.25
        self.counters = {"seen": 0}
        self.register_buffer("threshold", torch.zeros(()))


def test_attributes_changed_since_the_copy_reach_it_and_fsdp_state_does_not():
    live = Block()
    before = copy.deepcopy(live)  # what sharding records
    live.capacity, live.counters["seen"], live.inner.threshold = 1.0, 7, 0.9
    live.training = False
    live._fsdp_state_of_this_torch = object()  # an attribute sharding added: not the layer's
    live.register_forward_hook(lambda *a: None)
    copy_attributes(live, before)
    assert before.capacity == 1.0 and before.counters == {"seen": 7} and not before.training
    assert before.counters is not live.counters  # copied, not shared with the layer that leaves
    assert not hasattr(before.inner, "threshold")  # set after the copy was made: not one of its attributes
    assert not hasattr(before, "_fsdp_state_of_this_torch") and not before._forward_hooks
    assert before.inner.weight is not live.inner.weight and before.threshold is not live.threshold
