"""``compile=True``: the option is checked early, and only layers without a compiled entry point
are compiled (a layer that arrives by migration is a copy, which torch leaves uncompiled)."""
from __future__ import annotations

import copy
import pickle

import pytest
from torch import nn

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.runtime.compile import compile_local_layers, is_compiled


def test_compile_option_must_be_a_bool():
    with pytest.raises(ValueError, match="compile must be True or False"):
        DynMoStrategy(pipeline_parallel=2, compile="yes")
    assert DynMoStrategy(pipeline_parallel=2, compile=True).options.compile is True


def test_only_uncompiled_layers_are_compiled_and_keys_stay():
    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
    keys = list(layers.state_dict())
    assert compile_local_layers(layers, [1, 2]) == [1, 2]
    entry = layers[1]._compiled_call_impl
    assert [is_compiled(x) for x in layers] == [False, True, True, False]
    assert list(layers.state_dict()) == keys  # in place: no _orig_mod prefix
    # what migration does with a layer: a deep copy (the skeleton) or a pickle travels, uncompiled
    layers[2] = copy.deepcopy(layers[2])
    layers[3] = pickle.loads(pickle.dumps(layers[1]))
    assert not is_compiled(layers[2]) and not is_compiled(layers[3])
    assert compile_local_layers(layers, [1, 2, 3]) == [2, 3]
    assert layers[1]._compiled_call_impl is entry  # the layer that stayed is not recompiled
