"""Sub-layer granularity in the simulator's GPT snapshots: the pieces conserve the blocks' work,
each dynamism acts on the half it concerns, the finer cuts' bytes are counted, and a finer cut
never makes the best partition's bottleneck worse."""
import math

import pytest

from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
from lightning_dynmo.plan.cost_model import CostModel
from lightning_dynmo.sim.scenarios import (
    CASES, dense, freezing, load_profile, megatron_gpt_layout, moe, sparse_attention)
from lightning_dynmo.sim.scenarios.snapshot import STATS_BYTES_PER_TOKEN, TARGET_BYTES_PER_TOKEN, gpt_snapshot

SUB = {"granularity": "sublayer", "head_chunks": 1}


def _kw(case):
    return {} if case == "pruning" else {"snapshots": 3}


def _blocks(costs, layers, per_block):
    """Forward, then backward seconds of each block, summing its pieces."""
    return [math.fsum(getattr(costs, kind)[1 + per_block * i: 1 + per_block * (i + 1)])
            for kind in ("forward", "backward") for i in range(layers)]


def test_dense_sublayer_conserves_work():
    L = 12
    block, sub = dense(L)[0], dense(L, **SUB)[0]
    b, s = block.costs, sub.costs
    assert s.num_layers == 2 * L + 3 and sub.layout == (1, 2, 2) and block.layout == (1, 1, 2)
    assert s.time_sum(0, s.num_layers) == pytest.approx(b.time_sum(0, b.num_layers), rel=1e-12)
    assert _blocks(s, L, 2) == pytest.approx(_blocks(b, L, 1), rel=1e-12)
    assert (s.forward[-2:], s.backward[-2:]) == (b.forward[-2:], b.backward[-2:])  # final norm, head
    assert sum(s.params) == sum(b.params) and sum(sub.stored_activation) == pytest.approx(sum(block.stored_activation))
    assert set(s.activation) == set(b.activation)  # one residual stream crosses every cut


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_case_conserves_work_at_every_granularity(case):
    L = 8
    for block, sub in zip(CASES[case](L, **_kw(case)),
                          CASES[case](L, granularity="sublayer", head_chunks=4, **_kw(case))):
        b, s = block.costs, sub.costs
        assert s.num_layers == 2 * L + 1 + 1 + 4
        assert s.time_sum(0, s.num_layers) == pytest.approx(b.time_sum(0, b.num_layers), rel=1e-12)
        assert _blocks(s, L, 2) == pytest.approx(_blocks(b, L, 1), rel=1e-12, abs=1e-15)
        assert sum(s.params) == sum(b.params)
        assert sum(sub.reduced_params or s.params) == sum(block.reduced_params or b.params)


def test_dynamism_acts_on_the_right_half():
    p = load_profile()
    attn_half = p.block(1.0)[0] - p.mlp(p.tokens)[0]
    for snap in sparse_attention(4, snapshots=3, **SUB):  # attention sparsity: attention halves only
        assert snap.costs.forward[2:9:2] == (p.mlp(p.tokens)[0],) * 4
        assert all(f < attn_half for f in snap.costs.forward[1:9:2])
    for snap in moe(4, snapshots=2, **SUB):  # experts: MLP halves only
        assert snap.costs.forward[1:9:2] == pytest.approx((attn_half,) * 4)
        assert all(f > p.mlp(p.tokens)[0] for f in snap.costs.forward[2:9:2])
    last = freezing(8, snapshots=3, final_frozen=0.5, **SUB)[-1]  # 4 frozen blocks: both halves, all-reduce too
    assert last.costs.backward[1:9] == (0.0,) * 8 and last.costs.backward[9] > 0 and last.reduced_params[:9] == (0,) * 9
    assert last.costs.backward[10] == p.mlp(p.tokens)[1]  # first trainable block: its MLP half still passes dX on
    exits = CASES["early_exit"](8, snapshots=3, **SUB)[-1].costs.forward
    assert exits[15] < exits[1] and exits[16] < exits[2]  # both halves see fewer tokens after an exit


def test_head_chunks_split_the_head_and_count_their_bytes():
    p = load_profile()
    one, four = dense(2, **SUB)[0], dense(2, granularity="sublayer", head_chunks=4)[0]
    assert four.costs.num_layers == one.costs.num_layers + 3
    assert sum(four.costs.time[-4:]) == pytest.approx(one.costs.time[-1])
    assert sum(four.costs.params[-4:]) == one.costs.params[-1]
    edge = p.boundary_bytes + TARGET_BYTES_PER_TOKEN * p.tokens  # targets ride to the chunked head
    assert four.costs.activation[:-4] == (edge,) * (four.costs.num_layers - 4)
    assert four.costs.activation[-4:-1] == (edge + STATS_BYTES_PER_TOKEN * p.tokens,) * 3
    # the cost model charges the wider chunk boundary to the receiving stage
    model = CostModel(8, bandwidth=1e9)
    n = four.costs.num_layers
    assert model.recv_time(four.costs, n - 1) > model.recv_time(four.costs, n - 5) > model.recv_time(one.costs, 5)
    with pytest.raises(TypeError, match="Block"):
        gpt_snapshot(p, [(1.0, 2.0)])
    with pytest.raises(ValueError, match="granularity"):
        dense(2, granularity="expert")


@pytest.mark.parametrize("case", sorted(CASES))
def test_finer_granularity_never_worsens_the_best_bottleneck(case):
    """Every block partition is also a sub-layer partition, so with free transfers the exact
    balancer's bottleneck can only fall; Megatron's layout keeps whole blocks at every cut."""
    L = 12
    block = CASES[case](L, **_kw(case))[0].costs
    for k in (1, 3):
        sub_snap = CASES[case](L, granularity="sublayer", head_chunks=k, **_kw(case))[0]
        sub = sub_snap.costs
        for S in (2, 5, 8):
            model = CostModel(4 * S)
            best = [get_balancer("partition_time")(BalanceProblem(c, S, model)).max_load for c in (block, sub)]
            assert best[1] <= best[0]
            prefix, per_block, suffix = sub_snap.layout
            meg = megatron_gpt_layout(sub.num_layers, S, prefix, suffix, per_block)
            assert all((b - 1) % 2 == 0 for b in meg.boundaries[1:-1])  # stage cuts fall between blocks


FINE = {"granularity": "fine", "head_chunks": 3}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fine_pieces_add_up_to_the_halves(case):
    """Five pieces per block, each half shared out: the attention pieces sum to the attention half,
    the MLP pieces to the MLP half, parameters and stored bytes too."""
    L = 6
    for sub, fine in zip(CASES[case](L, granularity="sublayer", head_chunks=3, **_kw(case)),
                         CASES[case](L, **FINE, **_kw(case))):
        s, f = sub.costs, fine.costs
        assert f.num_layers == 5 * L + 1 + 1 + 3 and fine.layout == (1, 5, 4)
        for kind in ("forward", "backward"):
            a, b = getattr(s, kind), getattr(f, kind)
            for i in range(L):
                assert math.fsum(b[1 + 5 * i: 4 + 5 * i]) == pytest.approx(a[1 + 2 * i], rel=1e-12, abs=1e-15)
                assert math.fsum(b[4 + 5 * i: 6 + 5 * i]) == pytest.approx(a[2 + 2 * i], rel=1e-12, abs=1e-15)
                assert min(b[1 + 5 * i: 6 + 5 * i]) >= 0.0
        for i in range(L):
            assert sum(f.params[1 + 5 * i: 4 + 5 * i]) == s.params[1 + 2 * i]
            assert sum(f.params[4 + 5 * i: 6 + 5 * i]) == s.params[2 + 2 * i]
            assert f.params[2 + 5 * i] == 0  # the attention core holds no parameters
        assert sum(fine.reduced_params or f.params) == sum(sub.reduced_params or s.params)
        assert sum(fine.stored_activation) == pytest.approx(sum(sub.stored_activation))
        assert f.forward[-4:] == s.forward[-4:] and f.activation[-4:] == s.activation[-4:]  # norm, head chunks


def test_fine_cuts_carry_their_real_width():
    """A cut inside a half carries the residual stream and the intermediate (QKV 3h, attention
    output h, GELU output 4h): the simulator and the cost model charge those bytes."""
    p = load_profile()
    snap = dense(2, granularity="fine", head_chunks=1)[0]
    h = p.boundary_bytes
    assert snap.costs.activation[1:6] == pytest.approx((4 * h, 2 * h, h, 5 * h, h))
    assert snap.costs.activation[0] == h and snap.costs.activation[-1] == h
    model = CostModel(8, bandwidth=1e9)
    # a stage starting after MLP-in (4h GELU output + stream) receives 5x what one after MLP-out does
    assert model.recv_time(snap.costs, 5) == pytest.approx(5 * model.recv_time(snap.costs, 6))
    # the pieces are what the FLOPs say: QKV 3x the output projection, fc1 (with LN, GELU) > fc2
    f = snap.costs.forward
    assert f[1] == pytest.approx(3 * f[3]) and f[4] > f[5] > 0 and f[2] > 0


@pytest.mark.parametrize("case", ["freezing", "sparse_attention", "moe"])
def test_fine_never_worsens_the_best_bottleneck_with_free_transfers(case):
    """Every sub-layer partition is a fine one (halves are unions of pieces)."""
    L = 8
    sub = CASES[case](L, granularity="sublayer", head_chunks=2, **_kw(case))[-1].costs
    fine = CASES[case](L, granularity="fine", head_chunks=2, **_kw(case))[-1].costs
    for S in (3, 7):
        model = CostModel(4 * S)
        best = [get_balancer("partition_time")(BalanceProblem(c, S, model)).max_load for c in (sub, fine)]
        assert best[1] <= best[0]
