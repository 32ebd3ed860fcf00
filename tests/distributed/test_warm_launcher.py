"""The tests' warm launcher (``tests/support/warm_launcher.py``) starts a job as the torchrun
command line does: the same environment and signal handlers in each worker, the worker script as
``__main__`` with its arguments, exit handlers run at its end, a failing rank failing the job, and
a job past its timeout killed whole, after which the launcher still serves the next job. A rank
that crashes in native code under it (a forked worker) gets the job rerun on the command line,
where a crash of the code itself happens again and fails the test with the rank's stack."""
from __future__ import annotations

import json
import time

import pytest

from tests.support.multiproc import ROOT, WARM, alive, launch, run_worker, torchrun, worker_env, write_spec

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "env_worker.py"
PER_JOB = ("MASTER_PORT", "TORCHELASTIC_RUN_ID")  # chosen anew by each job


def test_workers_see_what_the_torchrun_command_line_gives_them(tmp_path):
    runs = [{"case": "env"}]
    (cli,) = run_worker(tmp_path / "cli", 2, runs, worker=WORKER, env=worker_env())  # env given: command line
    (warm,) = run_worker(tmp_path / "warm", 2, runs, worker=WORKER)
    assert WARM.proc is not None and WARM.broken is None, WARM.broken
    for c, w in zip(cli, warm):
        assert w["name"] == c["name"] == "__main__"
        assert w["argv"] == [str(WORKER), str(tmp_path / "warm" / "spec.json")]
        assert w["signals"] == c["signals"]  # a fresh interpreter's, not the agent's
        for key, value in c["env"].items():
            if key in PER_JOB:
                assert w["env"][key] and w["env"][key] != value, key
            else:
                assert w["env"][key] == value, key
    assert len({w["pid"] for w in warm} | {WARM.proc.pid}) == 3  # one process per rank
    for job in ("cli", "warm"):  # exit handlers ran in every rank (Lightning's teardown is one)
        assert all((tmp_path / job / f"result.json.atexit{r}").is_file() for r in (0, 1)), job


@pytest.mark.parametrize("case", ["fail", "exit"])
def test_a_failing_rank_fails_the_job_as_on_the_command_line(tmp_path, case):
    spec, _ = write_spec(tmp_path, [{"case": case}])
    warm = launch(torchrun(2, WORKER, str(spec)), 120)
    assert warm.returncode == 1, warm.output[-3000:]
    assert "ChildFailedError" in warm.output and "env_worker.py FAILED" in warm.output
    if case == "fail":
        assert "RuntimeError: env_worker: rank 1 failed on purpose" in warm.output


def test_a_job_past_its_timeout_is_killed_whole_and_the_next_job_runs(tmp_path):
    spec, out = write_spec(tmp_path / "hang", [{"case": "hang"}])
    with pytest.raises(AssertionError, match="timed out after 15 s"):
        launch(torchrun(2, WORKER, str(spec)), 15)
    pids = [int(out.with_name(f"{out.name}.pid{r}").read_text()) for r in (0, 1)]
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "a rank outlived its job"
    assert WARM.broken is None, WARM.broken
    (env,) = run_worker(tmp_path / "next", 2, [{"case": "env"}], worker=WORKER)
    assert [e["env"]["RANK"] for e in env] == ["0", "1"]


def test_a_native_crash_reruns_on_the_command_line_and_a_repeated_one_fails_with_its_stack(tmp_path):
    spec, out = write_spec(tmp_path / "once", [{"case": "crash_once"}])
    with pytest.warns(UserWarning, match="(?s)rerunning the job on the torchrun command line.*Fatal Python error"):
        done = launch(torchrun(2, WORKER, str(spec)), 120)
    assert done.returncode == 0, done.output[-3000:]
    assert [e["env"]["RANK"] for e in json.loads(out.read_text())["runs"][0]] == ["0", "1"]
    with pytest.warns(UserWarning, match="rerunning"), pytest.raises(AssertionError) as failed:
        run_worker(tmp_path / "always", 2, [{"case": "crash"}], worker=WORKER)
    message = str(failed.value)
    assert "the crashed rank's stack" in message and "Fatal Python error: Segmentation fault" in message
    assert "env_worker.py" in message.split("the crashed rank's stack")[1]  # the frame that crashed
