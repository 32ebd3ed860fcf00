"""Real-model features under the pipeline (issue 15), against single-process Lightning:

* meta-device init: each rank materialises only its own layers, with exactly the single-process
  initial values, and trains exactly like a pipeline built on real tensors;
* mixed precision (bf16-mixed, 16-mixed with a grad scaler whose inf checks agree across ranks,
  bf16-true) with a layer migration before every step;
* activation checkpointing (True and "auto"): bitwise the same losses and weights;
* a Hugging Face GPT-2 and a Mixtral (built on the meta device, read from a local directory; the
  Mixtral with its per-layer router loss attached in backward) equal single-process Lightning;
* bad input fails on every rank with a message naming the fix.

One torchrun launch runs every training config; references are ordinary single-process runs.
"""
from __future__ import annotations

import json
import shutil

import lightning as L
import pytest
import torch

from tests.support.multiproc import ROOT, run, torchrun, worker_env, run_named_pairs
from tests.support.workers.common import LossRecorder, make_loader, make_model
from tests.support.workers.real_models_worker import InfGradient, ScaleRecorder, build_model, precision_kwargs

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "real_models_worker.py"
STEPS = 4
# every step migrates a layer (the user balancer "test_cycle" always moves a boundary)
MIGRATE = {"rebalance": "every_n", "balancer": "test_cycle"}


def base(**kw) -> dict:
    return {"pp": 2, "steps": STEPS, "batch": 8, "microbatches": 4, "clip": 1.0, **kw}


def tiny_gpt2(path) -> str:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def tiny_mixtral(path) -> str:
    """Two MoE layers (top-2 of 4 experts), a sliding window shorter than the sequence, and the
    router loss on (output_router_logits) with a weight large enough to move the routers."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=64, max_position_embeddings=32,
                                        sliding_window=6, output_router_logits=True, router_aux_loss_coef=0.5,
                                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(path)
    return str(path)


def tiny_qwen2(path) -> str:
    """Llama's layout with q/k/v biases: a model family not written for, through the same adapter."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                      bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def tiny_phi3(path) -> str:
    """Llama's outer layout with fused q/k/v and gate/up projections and a sliding window (6) shorter
    than the sequence (16): the window's mask must be built inside each decoder layer's wrapper."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=32,
                                     sliding_window=6, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Phi3ForCausalLM(config).save_pretrained(path)
    return str(path)


def tiny_gemma3(path) -> str:
    """What Gemma 3's own forward does outside its modules: a sliding-window layer (window 6 < sequence 16)
    then a full one, a rotary table per layer type, soft-capped logits; its embedding scale is a buffer
    the checkpoint does not hold (filled from the config on each rank)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                           max_position_embeddings=32, sliding_window=6,
                                           layer_types=["sliding_attention", "full_attention"],
                                           final_logit_softcapping=2.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(path)
    return str(path)


RUNS = {
    "meta": base(meta=True, **MIGRATE),
    "real": base(**MIGRATE),
    "checkpointing": base(checkpointing=True, **MIGRATE),
    # stage 0 (embedding + 4 blocks): 0.80 MB of weights, gradients and Adam moments plus 0.24 MB
    # of saved activations per micro-batch, 2 in flight under 1F1B: 1.28 MB, 0.89 MB with every
    # layer recomputed. 1.1 MB makes it recompute 3 of its blocks; stage 1 (0.39 MB) recomputes none
    "checkpointing_auto": base(checkpointing="auto", memory_capacity=1_100_000, partition=[0, 5, 9]),
    "real_static": base(partition=[0, 5, 9]),
    # V-shaped stages and a split backward: the weight pass recomputes a layer once more
    "checkpointing_zbv": base(schedule="zbv", checkpointing=True, **MIGRATE),
    "real_zbv": base(schedule="zbv", **MIGRATE),
    "bf16-mixed": base(precision="bf16-mixed", **MIGRATE),
    "16-mixed": base(precision="16-mixed", inf_at=[2, "layers.0.wte.weight"], **MIGRATE),
    "bf16-true": base(precision="bf16-true", **MIGRATE),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs = dict(RUNS)
    if _has_transformers():
        runs["hf"] = base(hf=tiny_gpt2(tmp_path_factory.mktemp("gpt2")), meta=True, **MIGRATE)
        runs["hf_mixtral"] = base(hf=tiny_mixtral(tmp_path_factory.mktemp("mixtral")), meta=True, **MIGRATE)
        # SFT-style targets (a random tail of each sample is -100): micro-batches weighted by their targets
        runs["hf_qwen2"] = base(hf=tiny_qwen2(tmp_path_factory.mktemp("qwen2")), meta=True, padded=True, **MIGRATE)
        runs["hf_phi3"] = base(hf=tiny_phi3(tmp_path_factory.mktemp("phi3")), meta=True, **MIGRATE)
        runs["hf_gemma3"] = base(hf=tiny_gemma3(tmp_path_factory.mktemp("gemma3")), meta=True, **MIGRATE)
    return run_named_pairs(tmp_path_factory.mktemp("real"), 2, runs, worker=WORKER)


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def reference(cfg: dict) -> dict:
    """Single-process Lightning: same model, data, precision, clipping and injected inf."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec, scales = LossRecorder(), ScaleRecorder()
        callbacks = [rec, scales] + ([InfGradient(*cfg["inf_at"])] if cfg.get("inf_at") else [])
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=cfg["steps"], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, gradient_clip_val=cfg.get("clip"), callbacks=callbacks,
                            **precision_kwargs(cfg))
        model = build_model(cfg)
        trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"], reference=True))
        return {"losses": rec.losses, "scales": scales.scales, "state": model.state_dict()}
    finally:
        torch.set_num_threads(threads)


def assert_losses(got, want, rtol, what):
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rtol * abs(b), f"{what} step {step}: pipeline {a} vs single process {b} (rtol {rtol})"


def assert_states_equal(a: dict, b: dict, what: str):
    assert set(a) == set(b), what
    for k in b:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


# ------------------------------------------------------------------ meta-device init
def test_meta_init_gives_each_rank_the_single_process_values_and_trains_identically(results):
    cfg, res = results["meta"]
    assert res["applied"] == STEPS - 1  # a migration before every step after the first
    single = make_model(cfg).state_dict()
    assert_states_equal(torch.load(res["init"]), single, "initial weights (meta init) vs single-process init")
    assert_losses(res["losses"], reference(cfg)["losses"], 1e-5, "fp32 meta init")
    # the same pipeline built on real tensors: bitwise the same run (optimizer re-bound correctly)
    _, real = results["real"]
    assert res["losses"] == real["losses"]
    assert_states_equal(torch.load(res["state"]), torch.load(real["state"]), "final weights, meta vs real build")
    layers = [r["layers"] for r in res["per_rank"]]
    assert sorted(sum(layers, [])) == list(range(9)) and all(layers)


# ------------------------------------------------------------------ precision
@pytest.mark.parametrize("precision,rtol", [("bf16-mixed", 2e-3), ("16-mixed", 2e-4), ("bf16-true", 1e-2)])
def test_precision_matches_single_process_lightning_with_migrations(results, precision, rtol):
    """Tolerances: bf16 keeps 8 significant bits (eps 3.9e-3), fp16 11 (eps 4.9e-4); the pipeline
    runs per-micro-batch GEMMs and averages micro-batch losses and gradients, so rounding differs
    at that level (bf16-true: the single process's loss is itself a bf16 number). Weights are
    compared per tensor in norm: Adam turns rounding noise in near-zero gradients into full-size
    steps (lr), so single elements differ by ~lr, whereas a rank that skipped or doubled a step
    would be off by ~lr / |w| ~ 15 % on every element of its stages."""
    cfg, res = results[precision]
    assert res["applied"] == STEPS - 1
    ref = reference(cfg)
    assert_losses(res["losses"], ref["losses"], rtol, precision)
    state = torch.load(res["state"])
    for k, v in ref["state"].items():
        assert state[k].dtype == v.dtype, k
        err = ((state[k].double() - v.double()).norm() / v.double().norm()).item()
        assert err <= 0.05, f"{precision}: weight {k} relative error {err:.3g}"


def test_16_mixed_ranks_skip_the_step_together_when_one_stage_overflows(results):
    """An inf in one gradient of rank 0's first layer at step 2: every rank skips that step and
    halves its scale, exactly as the single process does (otherwise the ranks' weights and scales
    would drift apart and the losses would not match)."""
    cfg, res = results["16-mixed"]
    ref = reference(cfg)
    assert res["scales"] == ref["scales"] == [65536.0, 65536.0, 32768.0, 32768.0]
    assert_losses(res["losses"], ref["losses"], 2e-4, "16-mixed with overflow")


# ------------------------------------------------------------------ activation checkpointing
def test_activation_checkpointing_is_exact(results):
    _, real = results["real"]
    _, ckpt = results["checkpointing"]
    assert ckpt["losses"] == real["losses"]
    assert_states_equal(torch.load(ckpt["state"]), torch.load(real["state"]), "checkpointing=True vs False")
    assert [r["recompute"] for r in ckpt["per_rank"]] == [r["layers"] for r in ckpt["per_rank"]]


def test_activation_checkpointing_is_exact_under_zero_bubble_schedules(results):
    _, real = results["real_zbv"]
    _, ckpt = results["checkpointing_zbv"]
    assert ckpt["losses"] == real["losses"]
    assert_states_equal(torch.load(ckpt["state"]), torch.load(real["state"]), "zbv, checkpointing=True vs False")


def test_auto_checkpointing_recomputes_only_where_the_stage_exceeds_capacity(results):
    _, auto = results["checkpointing_auto"]
    _, static = results["real_static"]
    assert auto["losses"] == static["losses"]
    assert_states_equal(torch.load(auto["state"]), torch.load(static["state"]), "checkpointing='auto' vs False")
    first, last = auto["per_rank"]
    assert first["recompute"] == [1, 2, 3], first  # most activation bytes per forward FLOP first
    assert last["recompute"] == [], last


# ------------------------------------------------------------------ Hugging Face
def test_hugging_face_gpt2_pipeline_equals_single_process(results):
    pytest.importorskip("transformers")
    cfg, res = results["hf"]
    assert res["applied"] == STEPS - 1
    from lightning_dynmo.models.hf import HFCausalLM

    single = HFCausalLM.from_pretrained(cfg["hf"]).state_dict()
    assert_states_equal(torch.load(res["init"]), single, "HF initial weights (each rank read its own layers)")
    assert_losses(res["losses"], reference(cfg)["losses"], 1e-5, "HF GPT-2")


# fp32 weights after STEPS AdamW steps at lr 3e-4: Adam turns fp32 rounding noise in a near-zero gradient
# into a step of up to ~lr on that element (1.8e-6 seen on a Mixtral expert, machine-dependent), whereas a
# skipped, doubled or wrong step moves every element of a layer by ~lr = 3e-4
WEIGHT_ATOL = 1e-5


def _hf_run_equals_single_process(results, name: str, what: str, init_note: str) -> tuple[dict, dict, dict]:
    """A Hugging Face run that migrated a layer every step against single-process Lightning: the
    initial weights each rank read, the losses (1e-5) and the final weights (1e-4). Returns
    (cfg, the reference run, the pipeline's final state)."""
    pytest.importorskip("transformers")
    cfg, res = results[name]
    assert res["applied"] == STEPS - 1
    from lightning_dynmo.models.hf import HFCausalLM

    assert_states_equal(torch.load(res["init"]), HFCausalLM.from_pretrained(cfg["hf"]).state_dict(),
                        f"{what} initial weights ({init_note})")
    ref = reference(cfg)
    assert_losses(res["losses"], ref["losses"], 1e-5, f"HF {what}")
    state = torch.load(res["state"])
    assert set(state) == set(ref["state"])
    for k, v in ref["state"].items():
        assert torch.allclose(state[k], v, rtol=1e-4, atol=WEIGHT_ATOL), \
            f"{what} weight {k}: pipeline vs single process"
    return cfg, ref, state


def test_hugging_face_qwen2_pipeline_equals_single_process(results):
    """With padded targets: single-process Lightning's loss is the mean over the batch's counted targets."""
    _, _, state = _hf_run_equals_single_process(results, "hf_qwen2", "Qwen2", "each rank read its own layers")
    assert any(k.endswith("q_proj.bias") for k in state)


def test_hugging_face_phi3_with_a_sliding_window_pipeline_equals_single_process(results):
    _, _, state = _hf_run_equals_single_process(results, "hf_phi3", "Phi-3", "each rank read its own layers")
    assert any(k.endswith("qkv_proj.weight") for k in state)


def test_hugging_face_gemma3_with_per_layer_windows_and_capped_logits_pipeline_equals_single_process(results):
    _, _, state = _hf_run_equals_single_process(results, "hf_gemma3", "Gemma 3", "each rank read its own layers")
    assert any(k.endswith("q_norm.weight") for k in state)


def test_hugging_face_mixtral_with_router_loss_pipeline_equals_single_process(results):
    """Losses and weights after every step migrated a layer; the router loss is in both runs (a
    single process without it ends with other router weights)."""
    cfg, ref, state = _hf_run_equals_single_process(results, "hf_mixtral", "Mixtral",
                                                    "each rank read and fused its own experts")
    router = "layers.1.layer.mlp.gate.weight"
    no_aux = reference({**cfg, "hf_kwargs": {"router_aux_loss": False}})["state"][router]
    assert not torch.allclose(no_aux, v := ref["state"][router], rtol=1e-4, atol=10 * WEIGHT_ATOL), \
        "router loss had no effect"
    assert torch.allclose(state[router], v, rtol=1e-4, atol=WEIGHT_ATOL)


# ------------------------------------------------------------------ bad input
def test_bad_input_fails_on_every_rank_with_a_clear_message(tmp_path):
    env = {}
    if _has_transformers():
        good = tiny_gpt2(tmp_path / "gpt2")
        unknown, mismatch = tmp_path / "unknown", tmp_path / "mismatch"
        for d in (unknown, mismatch):
            shutil.copytree(good, d)
        cfg = json.loads((unknown / "config.json").read_text())
        (unknown / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
        (mismatch / "config.json").write_text(json.dumps({**cfg, "n_embd": 48}))
        env = {"DYNMO_TEST_HF_UNKNOWN": str(unknown), "DYNMO_TEST_HF_MISMATCH": str(mismatch)}
    expected = {
        "precision_unsupported": r"UnsupportedPrecisionError: DynMoStrategy cannot train with precision='bf16-mixed' "
                                 r"\(FSDPPrecision\).*'16-mixed'",
        "checkpointing_without_protocol": r"PipelineProtocolError: activation_checkpointing=True .*pipeline_layers",
        "checkpointing_auto_without_capacity": r"ValueError: activation_checkpointing='auto' .*set memory_capacity",
    }
    if env:
        expected["hf_unknown_architecture"] = (r"UnsupportedArchitectureError: .*model_type='falcon'.*supported: "
                                               r"apertus, arcee, cohere, cohere2, ernie4_5, exaone4, gemma, gemma2, "
                                               r"gemma3_text, glm")
        expected["hf_shape_mismatch"] = (r"CheckpointMismatchError: the checkpoint .* does not match its config .*"
                                         r"transformer.wte.weight: checkpoint \[64, 32\], config \[64, 48\]")
    out = tmp_path / "errors"
    proc = run(torchrun(2, WORKER, "--bad", ",".join(expected), str(out)), 240, tmp_path / "bad.log",
               worker_env(**env))
    assert proc.returncode == 0, proc.output[-3000:]
    import re

    for rank in (0, 1):
        errors = json.loads((tmp_path / f"errors.rank{rank}.json").read_text())
        for case, pattern in expected.items():
            assert errors[case] is not None, f"{case} did not fail on rank {rank}"
            assert re.search(pattern, errors[case], re.S), f"rank {rank} {case}: {errors[case]}"


# ------------------------------------------------------------------ recipe
def test_recipe_trains_a_hugging_face_model_from_a_local_directory(tmp_path):
    """``python recipes/train_gpt.py model=hf model.path=...`` on the default 2-rank pipeline."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    import sys

    args = [f"model.path={tmp_path / 'gpt2'}", "model=hf", "data.block_size=32", "data.batch_size=8",
            "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "trainer.num_sanity_val_steps=0", "trainer.enable_progress_bar=false", "checkpoint.enabled=false",
            "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    env = worker_env(HYDRA_FULL_ERROR="1")
    for k in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "RANK"):
        env.pop(k, None)
    proc = run([sys.executable, str(ROOT / "recipes" / "train_gpt.py"), *args], 240, tmp_path / "recipe.log", env)
    assert proc.returncode == 0, proc.output[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "hf:gpt2" and summary["pipeline_parallel"] == 2
    assert 0 < summary["train_loss"] < 10 and summary["val_ppl"] is not None
