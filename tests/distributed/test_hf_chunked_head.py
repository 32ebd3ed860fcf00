"""A Hugging Face Llama with a vocabulary-chunked LM head (``HFCausalLM(head_chunks=3)``: the
targets and the online-softmax statistics ride the pipeline as tuple activations) on a 2-rank
pipeline, built on the meta device with each rank reading its own layers (each chunk its rows of
``lm_head.weight``) and a layer migration before every step, equals single-process Lightning;
the checkpoint names the head as one matrix. Harness and references as in test_real_models.py."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.test_real_models import MIGRATE, STEPS, WORKER, assert_losses, base, reference
from tests.support.multiproc import run_worker

pytestmark = pytest.mark.slow


def tiny_llama(path) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_chunked_hugging_face_llama_with_migrations_equals_single_process(tmp_path):
    cfg = base(hf=tiny_llama(tmp_path / "llama"), hf_kwargs={"head_chunks": 3}, meta=True, **MIGRATE)
    (tmp_path / "run").mkdir()
    (res,) = run_worker(tmp_path / "run", 2, [cfg], worker=WORKER)
    assert res["applied"] == STEPS - 1  # a migration before every step after the first
    layers = [r["layers"] for r in res["per_rank"]]
    assert sorted(sum(layers, [])) == list(range(7)) and all(layers)  # embedding, 2 decoders, norm, 3 chunks
    ref = reference(cfg)
    assert_losses(res["losses"], ref["losses"], 1e-5, "HF Llama, 3 head chunks")
    from lightning_dynmo.models.hf import HFCausalLM

    head = "layers.4.lm_head.weight"  # one matrix, as the unchunked model names it
    init, single = torch.load(res["init"]), HFCausalLM.from_pretrained(cfg["hf"], head_chunks=3).state_dict()
    assert init.keys() == single.keys() == HFCausalLM.from_pretrained(cfg["hf"]).state_dict().keys()
    assert all(torch.equal(v, single[k]) for k, v in init.items()), "initial weights (each rank read its own rows)"
    state = torch.load(res["state"])
    assert state.keys() == ref["state"].keys() and state[head].shape == (64, 32)
    for k, v in ref["state"].items():
        assert torch.allclose(state[k], v, rtol=1e-4, atol=1e-6), f"weight {k}: pipeline vs single process"


def test_padded_hugging_face_llama_with_migrations_equals_single_process(tmp_path):
    """``pad_token_id``: the padding mask rides beside the hidden state through both stages (and
    past the migrating layers); the data's random tokens hold that id here and there."""
    cfg = base(hf=tiny_llama(tmp_path / "llama"), hf_kwargs={"head_chunks": 2, "pad_token_id": 7}, meta=True,
               **MIGRATE)
    (tmp_path / "run").mkdir()
    (res,) = run_worker(tmp_path / "run", 2, [cfg], worker=WORKER)
    assert res["applied"] == STEPS - 1
    ref = reference(cfg)
    assert all(loss == loss for loss in ref["losses"])  # finite: rows starting with padding included
    assert_losses(res["losses"], ref["losses"], 1e-5, "HF Llama, padding mask + 2 head chunks")
