"""strategy/token_weights.py: the mean over micro-batches of the weighted micro-batch losses is the
batch's token mean (one replica; the replicas' sum is the distributed tests' part)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynmo.strategy.token_weights import TokenWeights


def count(target):
    return (target != -100).sum()


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 12), cols=st.integers(1, 9), m=st.integers(1, 6))
def test_weighted_micro_batch_mean_is_the_batch_token_mean(seed, rows, cols, m):
    m = min(m, rows)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, cols, 5, generator=g, dtype=torch.float64)
    target = torch.randint(0, 5, (rows, cols), generator=g)
    target[torch.rand(rows, cols, generator=g) < 0.4] = -100  # micro-batches of padding only, too
    target.view(-1)[0] = 1  # at least one counted target in the batch
    weights = TokenWeights(count)
    weights.begin(target, m, group=None, replicas=1)
    fn = weights.weighted(loss_fn)
    parts = [fn(lo, t) for lo, t in zip(torch.tensor_split(logits, m), torch.tensor_split(target, m))]
    mean = torch.stack(parts).sum() / m
    torch.testing.assert_close(mean, loss_fn(logits, target), rtol=1e-12, atol=1e-12)


def test_equal_counts_leave_each_loss_bitwise_unchanged():
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(8, 4, 7, generator=g), torch.randint(0, 7, (8, 4), generator=g)
    weights = TokenWeights(count)
    weights.begin(target, 4, group=None, replicas=1)
    fn = weights.weighted(loss_fn)
    for lo, t in zip(torch.tensor_split(logits, 4), torch.tensor_split(target, 4)):
        assert torch.equal(fn(lo, t), loss_fn(lo, t))


def test_no_count_or_no_counted_target_leaves_the_loss_as_it_is():
    target = torch.full((2, 3), -100)
    weights = TokenWeights(count)
    weights.begin(target, 2, group=None, replicas=1)  # nothing counted: a single process gets NaN too
    logits = torch.randn(2, 3, 4)
    assert torch.equal(weights.weighted(lambda o, t: o.sum())(logits, target), logits.sum())
    plain = TokenWeights(None)
    assert not plain.active and plain.weighted(loss_fn) is loss_fn


def test_a_micro_batch_of_padding_only_adds_zero_not_nan():
    target = torch.tensor([[1, 2], [-100, -100]])
    weights = TokenWeights(count)
    weights.begin(target, 2, group=None, replicas=1)
    logits = torch.randn(2, 2, 3, requires_grad=True)
    fn = weights.weighted(loss_fn)
    padded = fn(logits[1:], target[1:])
    assert padded.item() == 0.0
    padded.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_a_count_that_is_not_one_number_is_named():
    import pytest

    from lightning_dynmo import PipelineProtocolError

    weights = TokenWeights(lambda t: (t != -100).sum(dim=1))  # per row: a mistake
    with pytest.raises(PipelineProtocolError, match=r"must return one number.*shape \[2\]"):
        weights.begin(torch.zeros(2, 3, dtype=torch.long), 1, group=None, replicas=1)
