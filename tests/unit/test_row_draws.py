"""``normal_rows_`` against the whole draw it streams: every row window of every length class
(shorter than a block, whole blocks, a partial last block) equals the whole draw's rows bit for bit,
and the generator ends where the whole draw leaves it."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynmo.protocol.row_draws import normal_rows_, skip_normal


def _whole(shape, seed: int, std: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    whole = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    return whole, torch.empty(3).normal_(generator=gen)  # what the generator gives next


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), cols=st.integers(1, 37), data=st.data(), chunk=st.sampled_from([16, 48, 1 << 20]))
def test_rows_of_the_whole_draw_bit_for_bit(rows, cols, data, chunk):
    start = data.draw(st.integers(0, rows))
    stop = data.draw(st.integers(start, rows))
    whole, after = _whole((rows, cols), seed=rows * 1000 + cols)
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    out = normal_rows_(torch.empty(stop - start, cols), (rows, cols), start, 0.02, gen, chunk=chunk)
    assert torch.equal(out, whole[start:stop])
    assert torch.equal(torch.empty(3).normal_(generator=gen), after)  # the generator is where the draw left it


@pytest.mark.parametrize("shape", [(5,), (16,), (17,), (4, 4), (3, 100), (1000, 3)])
def test_skip_leaves_the_generator_where_the_draw_does(shape):
    _, after = _whole(shape, seed=7)
    gen = torch.Generator().manual_seed(7)
    skip_normal(gen, shape)
    assert torch.equal(torch.empty(3).normal_(generator=gen), after)


def test_rows_outside_the_draw_are_refused():
    with pytest.raises(ValueError, match="outside a draw"):
        normal_rows_(torch.empty(3, 4), (4, 4), 2, 1.0, torch.Generator())
