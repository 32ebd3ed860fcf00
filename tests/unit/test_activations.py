"""The tuple-activation convention (protocol/activations.py): pass-through, output checks, byte counts."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from lightning_dynmo import PipelineProtocolError, run_layers
from lightning_dynmo.protocol.activations import call_layer, consumed, output_problem
from lightning_dynmo.runtime.tensor_specs import TensorSpec, act_nbytes, act_spec


class Double(nn.Module):
    def forward(self, x):
        return 2 * x


class Pair(nn.Module):
    def forward(self, x, y):
        return x + y, x - y


class ToDict(nn.Module):
    def forward(self, x):
        return {"x": x}


class Anything(nn.Module):
    def forward(self, *xs):
        return tuple(reversed(xs))


def test_a_layer_takes_its_positional_tensors_and_the_rest_pass_through():
    a, b, c = torch.ones(2), torch.full((3,), 2.0), torch.zeros(1, dtype=torch.long)
    assert consumed(Double(), 3) == 1 and consumed(Pair(), 3) == 2 and consumed(Anything(), 3) == 3
    out = call_layer(Double(), (a, b, c))
    assert len(out) == 3 and torch.equal(out[0], 2 * a) and out[1] is b and out[2] is c
    assert call_layer(Double(), (a,)).shape == (2,)  # one tensor in, the layer's own output out
    s, d, t = run_layers([Pair(), Double()], (a, a, c))
    assert torch.equal(s, 4 * a) and torch.equal(d, 0 * a) and t is c


@pytest.mark.parametrize("out, says", [
    ({"x": torch.ones(1)}, "returned a dict"),
    ((torch.ones(1), 3), r"returned a tuple of 2 \(\[1\], int\)"),
    ((), "returned a tuple of 0"),
])
def test_what_is_not_a_tensor_or_a_tuple_of_tensors_is_named(out, says):
    assert re.search(says, output_problem(4, Double(), out))
    assert "pipeline layer 4 (Double)" in output_problem(4, Double(), out)


def test_arity_and_shape_are_checked_against_the_discovered_specs():
    spec = act_spec((torch.ones(2, 3), torch.zeros(2, dtype=torch.long)))
    assert output_problem(1, Pair(), (torch.ones(2, 3), torch.zeros(2, dtype=torch.long)), spec) is None
    assert "returned 1 tensor(s) where the pipeline discovered 2" in output_problem(1, Pair(), torch.ones(2, 3), spec)
    assert "shape [2, 2]" in output_problem(1, Pair(), (torch.ones(2, 2), torch.zeros(2, dtype=torch.long)), spec)
    with pytest.raises(PipelineProtocolError, match=r"pipeline layer 1 \(ToDict\) returned a dict"):
        run_layers([Double(), ToDict()], torch.ones(1))


def test_a_tuple_activation_counts_every_tensor_s_bytes():
    spec = act_spec((torch.ones(4, 8), torch.zeros(4, dtype=torch.long)), (True, False))
    assert act_nbytes(spec) == 4 * 8 * 4 + 4 * 8
    assert spec[0] == TensorSpec((4, 8), torch.float32, True) and not spec[1].requires_grad


def test_a_dict_batch_is_named_with_its_keys_and_the_hook_that_converts_it():
    from lightning_dynmo.protocol import split_batch

    with pytest.raises(PipelineProtocolError, match=r"got dict with keys \['input_ids', 'labels'\].*"
                                                    r"on_before_batch_transfer"):
        split_batch({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2, 3)})


class OptionalSkip(nn.Module):
    def forward(self, h, skip=None):
        return h if skip is None else h + skip


class KeywordOnlySkip(nn.Module):
    def forward(self, h, *, skip=None):
        return h if skip is None else h + skip


def test_an_optional_positional_parameter_gets_no_tensor_and_one_warning_names_it():
    """A ``forward(h, skip=None)`` that a module's own forward calls with ``skip`` would train
    without it under the pipeline: the carried tensor passes through, and the user is told."""
    a, b = torch.ones(2), torch.full((2,), 5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(call_layer(OptionalSkip(), (a,)), a)  # nothing passes it: nothing to say
    with pytest.warns(UserWarning,
                      match=r"OptionalSkip.forward has optional positional parameter\(s\) 'skip'.*keyword-only"):
        out = call_layer(OptionalSkip(), (a, b))
    assert torch.equal(out[0], a) and out[1] is b  # skip kept its default; b passed through
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call_layer(OptionalSkip(), (a, b))  # once per class
        call_layer(KeywordOnlySkip(), (a, b))  # keyword-only: the documented way to keep a default
