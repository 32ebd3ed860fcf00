"""Direct tests of the small values everything else is built on: ``Partition``, ``Topology``,
``MigrationPlan`` and the ``RemoteLayer`` placeholder."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from lightning_dynmo.plan import MigrationPlan, Partition, Topology
from lightning_dynmo.protocol import RemoteLayer

sizes = st.lists(st.integers(1, 5), min_size=1, max_size=8)


# ---------------------------------------------------------------- Partition
@pytest.mark.parametrize("bounds,match", [
    ((0,), "at least one stage"),
    ((), "at least one stage"),
    ((1, 3), "must start at 0"),
    ((0, 2, 2, 4), "strictly increasing"),
    ((0, 3, 2), "strictly increasing"),
])
def test_partition_rejects_invalid_boundaries(bounds, match):
    with pytest.raises(ValueError, match=match):
        Partition(bounds)


@given(sizes)
def test_partition_views_agree(sz):
    part = Partition.from_sizes(sz)
    L, S = sum(sz), len(sz)
    assert part.num_layers == L and part.num_stages == S and part.sizes == tuple(sz)
    assert [list(r) for r in part] == [list(part.layers_of(s)) for s in range(S)]
    assert [i for r in part for i in r] == list(range(L))  # contiguous, ordered, each layer once
    owners = part.owner_map()
    assert owners == [part.stage_of(i) for i in range(L)]
    assert owners == [s for s, n in enumerate(sz) for _ in range(n)]
    assert str(part) == "|".join(f"{r.start}-{r.stop - 1}" for r in part)
    assert Partition(tuple(float(b) for b in part.boundaries)) == part  # coerced to ints
    assert all(isinstance(b, int) for b in Partition(tuple(float(b) for b in part.boundaries)).boundaries)
    for bad in (-1, L):
        with pytest.raises(IndexError):
            part.stage_of(bad)


@given(sizes, st.data())
def test_moved_layers_counts_owner_changes(sz, data):
    a = Partition.from_sizes(sz)
    L, S = a.num_layers, a.num_stages
    cuts = data.draw(st.sets(st.integers(1, L - 1), min_size=S - 1, max_size=S - 1)) if L > 1 else set()
    b = Partition((0, *sorted(cuts), L))
    assert a.moved_layers(b) == b.moved_layers(a) == sum(x != y for x, y in zip(a.owner_map(), b.owner_map()))
    assert a.moved_layers(a) == 0
    with pytest.raises(ValueError, match="different layer/stage counts"):
        a.moved_layers(Partition.from_sizes([*sz, 1]))


def test_partition_is_a_hashable_value():
    assert Partition((0, 2, 4)) == Partition.from_sizes([2, 2])
    assert len({Partition((0, 2, 4)), Partition.from_sizes([2, 2])}) == 1
    with pytest.raises(AttributeError):
        Partition((0, 2, 4)).boundaries = (0, 1, 4)  # frozen


# ---------------------------------------------------------------- Topology
@given(st.integers(1, 4), st.integers(1, 4))
def test_topology_groups_cover_every_rank_once(pp, dp):
    topo = Topology(pp * dp, pp)
    assert topo.dp == dp
    pipelines = [topo.pipeline_ranks(d) for d in range(dp)]
    replicas = [topo.replica_ranks(s) for s in range(pp)]
    assert sorted(r for g in pipelines for r in g) == list(range(pp * dp))
    assert sorted(r for g in replicas for r in g) == list(range(pp * dp))
    for rank in range(pp * dp):
        assert rank in pipelines[topo.dp_rank(rank)] and rank in replicas[topo.pp_rank(rank)]
        assert pipelines[topo.dp_rank(rank)][topo.pp_rank(rank)] == rank  # a replica's ranks are adjacent
    for active in range(1, pp + 1):
        kept = [r for d in range(dp) for r in topo.pipeline_ranks(d, active=active)]
        released = topo.released_ranks(active)
        assert sorted(kept + released) == list(range(pp * dp)) and not set(kept) & set(released)
        assert all(topo.pp_rank(r) >= active for r in released)


def test_topology_rejects_bad_sizes():
    with pytest.raises(ValueError, match="pipeline_parallel must be >= 1"):
        Topology(4, 0)
    with pytest.raises(ValueError, match="multiple of pipeline_parallel.*devices=4"):
        Topology(6, 4)


# ---------------------------------------------------------------- MigrationPlan
def test_migration_plan_rebalance_and_repack():
    old, new = Partition((0, 3, 6)), Partition((0, 2, 6))
    plan = MigrationPlan.build(old, new, lambda s: s)
    assert [(m.layer, m.src, m.dst) for m in plan.moves] == [(2, 0, 1)]
    assert plan.moves[0].adjacent and "layer 2: rank 0->1" in plan.describe()
    assert MigrationPlan.build(old, old, lambda s: s).moves == ()
    assert "nothing moves" in MigrationPlan.build(old, old, lambda s: s).describe()
    # re-packing 4 stages onto 2 ranks: stages 2 and 3 hand their layers over, some not to a neighbour
    four, two = Partition((0, 2, 4, 6, 8)), Partition((0, 4, 8))
    plan = MigrationPlan.build(four, two, lambda s: s, lambda s: s)
    assert [(m.layer, m.src, m.dst) for m in plan.moves] == [(2, 1, 0), (3, 1, 0), (4, 2, 1), (5, 2, 1),
                                                             (6, 3, 1), (7, 3, 1)]
    # a layer two stages away is sent straight to its new owner, not relayed
    far = MigrationPlan.build(Partition((0, 3, 4, 5)), Partition((0, 1, 2, 5)), lambda s: s)
    assert [(m.layer, m.src, m.dst, m.adjacent) for m in far.moves] == [(1, 0, 1, True), (2, 0, 2, False),
                                                                       (3, 1, 2, True)]
    assert "layer 2: rank 0->2 (non-adjacent: stage 0->2, sent directly)" in far.describe()
    with pytest.raises(ValueError, match="different layer counts"):
        MigrationPlan.build(Partition((0, 2, 4)), Partition((0, 2, 5)), lambda s: s)


# ---------------------------------------------------------------- RemoteLayer
def test_remote_layer_holds_nothing_and_refuses_to_run():
    layer = RemoteLayer(3, owner=1)
    assert list(layer.parameters()) == [] and list(layer.buffers()) == [] and layer.state_dict() == {}
    assert "index=3, owner=1" in repr(layer)
    with pytest.raises(RuntimeError, match="layer 3 lives on pipeline rank 1, not on this rank"):
        layer(torch.zeros(2))
    # in a ModuleList it contributes no state-dict keys: a rank's state dict names its own layers only
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), RemoteLayer(1, owner=0)])
    assert set(layers.state_dict()) == {"0.weight", "0.bias"}
