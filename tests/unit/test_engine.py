"""The pipeline engine in one process: a one-rank world holds every stage, so the schedule runs
each stage's chunks (forward, backward, zero-bubble weight passes) for real, and the result is
held against the same layers run by hand, one micro-batch at a time, mean loss backward. The
multi-rank equivalence with single-process Lightning is tests/distributed/test_equivalence.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.schedules import available_schedules, get_schedule
from lightning_dynmo.protocol import PipelineProtocolError
from lightning_dynmo.runtime.engine import EngineCache, TensorSpec
from lightning_dynmo.runtime.placement import Placement
from lightning_dynmo.runtime.profiler import PipelineProfiler

from tests.support.grads import param_grads

CPU = torch.device("cpu")
M = 4  # micro-batches


def mse(output, target):
    return ((output - target) ** 2).mean()


def tied_layers(n: int = 4, width: int = 6) -> nn.ModuleList:
    """``n`` small blocks; the first and last share one weight (an embedding and its LM head), so
    with two stages on the rank the shared gradient comes from both."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n))
    layers[-1][0].weight = layers[0][0].weight
    return layers


def placement(layers: nn.ModuleList, schedule: str) -> Placement:
    spec = get_schedule(schedule)
    stages = spec.virtual_stages(None)
    n = len(layers)
    sizes = [n // stages + (1 if s < n % stages else 0) for s in range(stages)]
    return Placement(layers, Partition.from_sizes(sizes), spec, 0, 1, None, CPU)


def by_hand(layers: nn.ModuleList, inputs, targets) -> list[torch.Tensor]:
    """Each micro-batch through every layer, its loss over ``M`` backward: the per-micro-batch
    losses, gradients summed as the engine's mean over micro-batches has them."""
    losses = []
    for x, y in zip(inputs.chunk(M), targets.chunk(M)):
        for layer in layers:
            x = layer(x)
        loss = mse(x, y)
        (loss / M).backward()
        losses.append(loss.detach())
    return losses


def inputs_and_targets():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


@pytest.mark.parametrize("schedule", available_schedules())
def test_chunks_equal_a_hand_run_forward_and_backward(world_of_one, schedule):
    layers = tied_layers()
    reference = copy.deepcopy(layers)  # (deepcopy keeps the tie)
    place = placement(layers, schedule)
    profiler = PipelineProfiler(CPU)
    inputs, targets = inputs_and_targets()
    engine = EngineCache(profiler).get(place, inputs, M, True, mse, targets)
    losses = engine.run(inputs, targets)
    expected = by_hand(reference, inputs, targets)
    torch.testing.assert_close(torch.stack([loss.detach() for loss in losses]), torch.stack(expected),
                               rtol=1e-6, atol=0)
    got, want = param_grads(layers), param_grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    # every local stage ran every micro-batch's forward once, and its backward
    stages = place.partition.num_stages
    forwards = sorted((e.stage, e.microbatch) for e in profiler.events if e.kind == "F")
    assert forwards == [(s, m) for s in range(stages) for m in range(M)]
    backwards = {(e.stage, e.microbatch) for e in profiler.events if e.kind == "B"}
    assert backwards == {(s, m) for s in range(stages) for m in range(M)}


def test_evaluation_and_predict_leave_no_gradient_and_equal_the_forward(world_of_one):
    layers = tied_layers()
    place = placement(layers, "1f1b")
    inputs, targets = inputs_and_targets()
    cache = EngineCache(PipelineProfiler(CPU))
    with torch.no_grad():
        outputs = [layers[3](layers[2](layers[1](layers[0](x)))) for x in inputs.chunk(M)]
    expected = [mse(o, y) for o, y in zip(outputs, targets.chunk(M))]
    engine = cache.get(place, inputs, M, False, mse, targets)
    losses = engine.run(inputs, targets, train=False, keep_output=True)
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(engine.output, torch.cat(outputs), rtol=1e-6, atol=0)
    predicted = cache.get(place, inputs, M, False, None).predict(inputs)
    torch.testing.assert_close(predicted, torch.cat(outputs), rtol=1e-6, atol=0)
    assert all(p.grad is None for p in layers.parameters())


def test_engines_are_cached_by_shape_and_the_specs_survive_dropping_them(world_of_one):
    layers = tied_layers()
    place = placement(layers, "gpipe")
    cache = EngineCache(PipelineProfiler(CPU))
    inputs, targets = inputs_and_targets()
    first = cache.get(place, inputs, M, True, mse, targets)
    assert cache.get(place, inputs, M, True, mse, targets) is first
    assert cache.get(place, inputs, 2, True, mse, targets) is not first  # another micro-batch count
    specs = cache.layer_specs()
    assert specs == [(TensorSpec((2, 6), torch.float32, True),)] * 4
    assert cache.activation_bytes() == [2 * 6 * 4.0] * 4
    cache.clear_engines()  # layers moved: engines go, the specs stay
    assert cache.layer_specs() == specs and cache.get(place, inputs, M, True, mse, targets) is not first
    cache.clear()
    assert cache.layer_specs() is None


class Widens(nn.Module):
    """Returns a wider output on its second call than the first: the discovered spec no longer holds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.lin(x)
        return out if self.calls == 1 else torch.cat([out, out], dim=-1)


def test_a_layer_that_breaks_its_spec_is_reported_not_run_on(world_of_one):
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(6, 6), Widens(), nn.Linear(6, 6)])
    place = Placement(layers, Partition.from_sizes([3]), get_schedule("gpipe"), 0, 1, None, CPU)
    inputs, targets = inputs_and_targets()
    engine = EngineCache(PipelineProfiler(CPU)).get(place, inputs, M, True, mse, targets)
    engine.run(inputs, targets)
    assert engine.problem is not None and "1" in engine.problem and "Widens" in engine.problem
    assert len(engine.problems) == M  # one per micro-batch; zeros of the discovered shape ran on


def test_a_loss_that_is_not_a_scalar_is_refused_before_any_step(world_of_one):
    layers = tied_layers()
    place = placement(layers, "1f1b")
    inputs, targets = inputs_and_targets()
    with pytest.raises(PipelineProtocolError, match="scalar"):
        EngineCache(PipelineProfiler(CPU)).get(place, inputs, M, True, lambda o, t: (o - t) ** 2, targets)
