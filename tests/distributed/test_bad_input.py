"""Bad input fails early with a message that names the fix, on every rank, never a hang."""
from __future__ import annotations

import json
import re
import sys

import pytest

from tests.support.multiproc import ROOT, launch, run, torchrun

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "bad_input_worker.py"

# case -> a pattern the error of *every* rank must match (each rank raises it itself)
EXPECTED = {
    "too_many_stages": r"ValueError: cannot split 5 layers into 6 pipeline stages",
    "batch_not_divisible": r"batch size 6 is not divisible by microbatches=4",
    "no_protocol": r"PipelineProtocolError: .*does not define pipeline_layers and pipeline_loss",
    "partition_does_not_fit": r"ValueError: partition \(0, 2, 4\) does not split 5 layers into 2 stages",
    "predict_hook_raises": r"RuntimeError: RaisingGPT.pipeline_predict raised ValueError: no prediction for batch 0",
    "eval_hook_raises": r"RuntimeError: EvalStepGPT.pipeline_eval_step raised ValueError: no metric for batch 0",
    "eval_metric_mean_state": r"ValueError: pipeline_eval_step's metrics cannot be synchronised exactly .*odd_metric "
                              r"\(MeanStateMetric\) reduces its state 'value' by 'dim_zero_mean'",
    "eval_metric_sync_on_step": r"ValueError: odd_metric \(MeanMetric\) has dist_sync_on_step=True",
    "manual_optimisation": r"PipelineProtocolError: .*needs automatic optimisation",
    "parameter_outside_layers": r"PipelineProtocolError: .*parameters outside pipeline_layers\(\): \['temperature'\]",
    "different_batches": r"PipelineBatchMismatchError: rank {rank}: the ranks of one pipeline received different "
                         r"batches \(step 0\)",
    "checkpoint_two_optimizers": r"checkpoint has 2 optimizers, the module configures 1",
    # the activation protocol (protocol/activations.py): at shape discovery, or mid-step after it
    "layer_returns_dict": r"PipelineProtocolError: pipeline layer 1 \(Misbehaving\) returned a dict; "
                          r".*tuple of tensors",
    "layer_returns_non_tensor": r"PipelineProtocolError: pipeline layer 1 \(Misbehaving\) returned a tuple of 2 "
                                r"\(\[2, 16, 32\], int\)",
    "layer_changes_arity": r"PipelineProtocolError: pipeline layer 1 \(Misbehaving\) returned 2 tensor\(s\) where "
                           r"the pipeline discovered 1",
    "layer_data_dependent_shape": r"PipelineProtocolError: pipeline layer 1 \(Misbehaving\) returned tensor 0 of "
                                  r"shape \[2, 15, 32\] .* where the pipeline discovered \[2, 16, 32\]",
    "fsdp_half_precision": r"ValueError: dp_sharding='fsdp' cannot be combined with precision='16-true'",
    "ema_callback": r"ValueError: rank {rank}: DynMoStrategy cannot train with EMAWeightAveraging: .*not supported yet",
    "swa_callback": r"ValueError: rank {rank}: DynMoStrategy cannot train with StochasticWeightAveraging: "
                    r".*not supported",
    "model_pruning_callback": r"ValueError: rank {rank}: DynMoStrategy cannot train with ModelPruning: .*Use "
                              r"lightning_dynmo.callbacks.GradualPruning",
    "lbfgs": r"ValueError: rank {rank}: torch.optim.LBFGS evaluates the training closure .* several times per step",
    "closure_twice": r"ClosureReevaluatedError: rank {rank}: TwiceClosureSGD.step called the training closure twice "
                     r"in step 0; .*runs once per optimizer step",
}
# a damaged checkpoint lacks an entry of rank 0's layers and one of rank 1's
MISSING_KEY = {0: "layers.0.wte.weight", 1: "layers.4.lm_head.weight"}


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    cases = [*EXPECTED, "checkpoint_missing_keys"]
    proc = launch(torchrun(2, WORKER, ",".join(cases), str(tmp / "errors")), timeout=300, log=tmp / "worker.log")
    assert proc.returncode == 0, proc.output[-4000:]  # every case failed cleanly; the job itself ends well
    return {rank: json.loads((tmp / f"errors.rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_input_fails_on_every_rank(errors, case):
    for rank in (0, 1):
        message = errors[rank][case]
        assert message is not None, f"{case}: rank {rank} trained on"
        assert re.search(EXPECTED[case].format(rank=rank), message), (rank, message)


def test_a_checkpoint_missing_entries_fails_on_every_rank_naming_them(errors):
    for rank in (0, 1):
        message = errors[rank]["checkpoint_missing_keys"]
        assert message is not None and all(key in message for key in MISSING_KEY.values()), (rank, message)


KILLED_RANK = {"die"}  # cases whose rank exits by itself mid-job (the warm launcher covers exceptions and stalls)


def _launch(case: str, tmp_path) -> tuple[str, str]:
    """(torchrun's output, the exception rank 0 reported itself)."""
    # a long monitor interval: the agent must not stop rank 0 before rank 0 fails on its own
    cmd = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "5", "--nproc-per-node", "2",
           "--standalone", str(WORKER), case, str(tmp_path / "seen")]
    # a hang fails here (process group killed); a rank that kills itself stays on the command line
    proc = (run if case in KILLED_RANK else launch)(cmd, timeout=180, log=tmp_path / "worker.log")
    assert proc.returncode != 0
    seen = tmp_path / "seen.rank0.txt"
    assert seen.exists(), f"rank 0 reported no exception of its own\n{proc.output[-3000:]}"
    return proc.output, seen.read_text()


def _exitcode_of(rank: int, output: str) -> int:
    """Exit code of ``rank`` in torchrun's failure summary."""
    m = re.search(rf"rank\s*:\s*{rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*:\s*(-?\d+)", output)
    assert m, output[-3000:]
    return int(m.group(1))


def test_a_dead_rank_makes_the_others_fail_not_hang(tmp_path):
    out, seen = _launch("die", tmp_path)
    assert _exitcode_of(1, out) == 3  # the rank that died
    # rank 0 fails by itself in its pending collective, naming the rank that did not answer
    assert re.match(r"RankFailedError: rank 0 stopped in .*: its collective timed out or lost its peer, and no rank "
                    r"reported an error\. rank\(s\) 1 did not answer: the process is gone", seen), seen
    assert re.search(r"Connection (closed|reset) by peer", seen), seen  # gloo's own words follow


def test_a_stuck_rank_times_out_with_a_message(tmp_path):
    out, seen = _launch("stall", tmp_path)
    # rank 0's own collective times out after the strategy's timeout (8 s), names where rank 1 is
    # (running a callback, not waiting in a collective) and ends rank 0
    assert re.match(r"RankFailedError: rank 0 stopped in .*: its collective timed out", seen), seen
    assert re.search(r"rank 1 is running outside the pipeline step .* not waiting in a collective, at "
                     r".*bad_input_worker\.py:\d+ in on_train_batch_start", seen), seen
    assert "Timed out waiting 8000ms" in seen, seen
    assert _exitcode_of(0, out) == 1, out[-3000:]


def test_a_rank_stalled_in_a_layer_is_the_one_named_not_its_waiting_peer(tmp_path):
    """An independent check found the healthy rank blamed: rank 0's timeout went on the board as
    rank 0's failure, and the stalled rank 1 printed "rank 0 failed ... waiting for that rank"."""
    out, seen = _launch("stall_in_layer", tmp_path)
    assert re.match(r"RankFailedError: rank 0 stopped in training step 2: its collective timed out", seen), seen
    assert re.search(r"rank 1 is running in training step 2 for [\d.]+ s, not waiting in a collective, at "
                     r".*bad_input_worker\.py:\d+ in forward: the job stalled there", seen), seen
    # rank 1 says it is the one, with its stacks, before the launcher stops it
    assert re.search(r"while rank 1 has been running in training step 2 .* the job stalled here", out), out[-4000:]
    assert "rank 0 failed" not in out, out[-4000:]


def test_a_layer_that_raises_in_validation_on_one_rank_is_named_by_its_peer(tmp_path):
    out, seen = _launch("val_raises", tmp_path)
    assert re.match(r"RankFailedError: rank 0 stopped in validation batch 0: rank 1 failed in validation batch 0: "
                    r"RuntimeError: a layer failed in validation on rank 1", seen), seen


def test_a_callback_that_raises_on_one_rank_is_named_by_its_peer(tmp_path):
    """An error outside the pipeline step (a callback on rank 1 only) used to reach rank 0 as gloo's
    "Connection closed by peer"; the failing rank now publishes it (``on_exception``), so rank 0's
    next collective names rank 1, where it failed and the cause."""
    out, seen = _launch("callback_raises", tmp_path)
    assert re.match(r"RankFailedError: rank 0 stopped in .*: rank 1 failed in step 2, outside the pipeline step "
                    r"\(a hook or callback\): RuntimeError: a user callback failed on rank 1", seen), seen
    own = tmp_path / "seen.rank1.txt"
    assert own.exists() and own.read_text() == "RuntimeError: a user callback failed on rank 1", own


def test_save_checkpoint_on_rank_0_only_fails_at_once_saying_every_rank_must_call_it(tmp_path):
    """Issue 26 item 7: the gather of a save made under ``if trainer.is_global_zero`` used to time
    out with torch's bare message; since issue 31 the ranks agree on each call first, so both
    fail at once naming the two calls (rank 0's save, rank 1's next step) and the fix."""
    out, seen = _launch("save_on_rank0", tmp_path)
    assert seen.startswith("CollectiveMismatchError"), seen
    assert "rank 0: save_checkpoint (model state)" in seen and "rank 1: next training batch" in seen, seen
    assert "trainer.save_checkpoint" in seen and "on every rank" in seen, seen
    other = tmp_path / "seen.rank1.txt"
    assert other.exists() and other.read_text() == seen, other
