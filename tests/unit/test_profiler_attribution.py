"""The profiler gives every busy second of a stage to one of its layers: a forward
chunk's hand-offs (input in, output out) and the loss that torch's schedules compute after the
last stage's forward chunk (its forward and its backward) included. The 2-rank version under
every kind of schedule: tests/distributed/test_loss_attribution.py."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from lightning_dynmo.runtime.profiler import PipelineProfiler


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(0.02)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.02)
        return grad


def test_the_loss_and_the_chunk_hand_offs_belong_to_layers():
    prof = PipelineProfiler(torch.device("cpu"))
    prof.register_stage(0, range(0, 2))
    layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    prof.start_layer_profiling(layers, [0, 1])
    loss_fn = prof.timed_loss(lambda out, target: Sleep.apply(out.sum()), 0)
    x = torch.randn(2, 4, requires_grad=True)
    prof.begin_step()
    with prof.chunk(0, "F", 0):
        time.sleep(0.01)  # receiving the input: the first layer's
        y = layers[1](layers[0](x))
        time.sleep(0.01)  # handing the output on: the last layer's
    loss = loss_fn(y, None)
    with prof.chunk(0, "B", 0):
        loss.backward()
    busy, attributed = prof.attribution()
    assert attributed == pytest.approx(busy, rel=1e-9, abs=0)
    assert busy == pytest.approx(sum(e.end - e.start for e in prof.events), rel=1e-9, abs=0)
    assert [e.kind for e in prof.events] == ["F", "B"]  # the loss is part of the forward chunk
    assert prof.events[0].end - prof.events[0].start >= 0.04
    (f0, _), (f1, b1) = prof.layer_times()[0], prof.layer_times()[1]
    assert f0 >= 0.01 and f1 >= 0.03 and b1 >= 0.02  # the loss's forward and backward are the head's
