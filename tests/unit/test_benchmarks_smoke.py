"""Benchmarks that cannot rot: every script in ``benchmarks/`` (each ``*.py`` there whose name does not
start with ``_``: those are the scripts' shared helpers) has a ``--smoke`` form that runs in seconds,
and the last line it prints is one JSON object with the keys the script declares in ``RESULT_KEYS``
(``SKIP_RESULT_KEYS`` when it reports ``"skipped"``, e.g. a GPU benchmark on a machine without CUDA,
which then checks its CPU side). The scripts come from the directory listing, so a new benchmark
without a smoke form, or without its keys, fails here. The smoke runs measure nothing (their
figures are noise): they only keep the scripts running against the package as it is.

The declarations are read from the source (no import: a script may need a GPU or start processes
when imported by mistake); the smoke runs themselves start processes and are marked ``slow``."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
TIMEOUT_S = 300  # one smoke run; each takes 7-30 s on 2 idle cores, up to ~100 s on loaded ones


def _tree(script: Path) -> ast.Module:
    return ast.parse(script.read_text(), filename=str(script))


def declared(script: Path, name: str) -> tuple[str, ...] | None:
    """The literal tuple of strings a script assigns to ``name`` at module level, or None."""
    for node in _tree(script).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple) and value and all(isinstance(k, str) for k in value), \
                f"{script.name}: {name} must be a non-empty tuple of key names, got {value!r}"
            return value
    return None


def _has_smoke_option(script: Path) -> bool:
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr == "add_argument" and node.args
               and isinstance(node.args[0], ast.Constant) and node.args[0].value == "--smoke"
               for node in ast.walk(_tree(script)))


def _sys_path_edits(script: Path) -> list[int]:
    """Lines that change ``sys.path`` (``sys.path.insert(...)``, ``.append``, ``sys.path = ...``)."""
    def is_sys_path(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(_tree(script)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_sys_path(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [node.lineno for t in targets if is_sys_path(t)]
    return lines


def test_the_listing_finds_the_benchmarks():
    names = {p.stem for p in SCRIPTS}
    assert {"dynamism", "rebalance", "sparse_linear", "balancers"} <= names, names
    assert not any(n.startswith("_") for n in names)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_each_benchmark_has_a_smoke_form_and_declares_its_keys(script):
    assert _has_smoke_option(script), f"{script.name} has no --smoke option (a run of seconds that CI can afford)"
    assert declared(script, "RESULT_KEYS"), f"{script.name} declares no RESULT_KEYS (the keys of its JSON line)"
    declared(script, "SKIP_RESULT_KEYS")  # well-formed where present


@pytest.mark.parametrize("script", sorted(BENCHMARKS.glob("*.py")) + sorted(BENCHMARKS.glob("*/*.py")),
                         ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_no_benchmark_edits_sys_path(script):
    """They run against the installed package; ``python benchmarks/x.py`` puts benchmarks/ first on
    the path by itself, which is how they import their helpers."""
    assert _sys_path_edits(script) == [], f"{script.name} edits sys.path at lines {_sys_path_edits(script)}"


def last_json_line(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert lines, "no output"
    result = json.loads(lines[-1])
    assert isinstance(result, dict), f"the last line is not a JSON object: {lines[-1][:200]}"
    return result


def run_smoke(script: Path) -> dict:
    """``python benchmarks/<script> --smoke`` against this checkout: exit code, output, seconds."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(script), "--smoke"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script's torchrun job and ranks with it
        out, err = proc.communicate()
        err += f"\n(killed after {TIMEOUT_S} s)"
    return {"returncode": proc.returncode, "stdout": out, "stderr": err, "seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def smoke_runs(request) -> dict:
    """The smoke runs of every script this session selected, ``SMOKE_JOBS`` at a time (default 2:
    most of a run is one interpreter importing torch and Lightning, one core's work, so two side by
    side halve the wall time on a 2-core CI machine; ``DYNMO_SMOKE_JOBS=1`` runs them one by one)."""
    wanted = [item.callspec.params["script"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_smoke_run_prints_its_keys"]
    jobs = int(os.environ.get("DYNMO_SMOKE_JOBS", "2"))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        runs = dict(zip(wanted, pool.map(run_smoke, wanted)))
    print(f"\n{len(runs)} smoke runs, {jobs} at a time: {time.perf_counter() - start:.1f} s")
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_smoke_run_prints_its_keys(script, smoke_runs):
    run = smoke_runs[script]
    print(f"{script.stem} --smoke: {run['seconds']:.1f} s")
    assert run["returncode"] == 0, f"{script.name} --smoke exited {run['returncode']}:\n{run['stdout'][-2000:]}\n" \
                                   f"{run['stderr'][-4000:]}"
    result = last_json_line(run["stdout"])
    assert result.get("smoke") is True, f"{script.name} --smoke did not say it ran its smoke form: {result}"
    if "skipped" in result:
        keys = declared(script, "SKIP_RESULT_KEYS")
        assert keys, f"{script.name} skipped ({result['skipped']}) but declares no SKIP_RESULT_KEYS"
    else:
        keys = declared(script, "RESULT_KEYS")
    missing = [k for k in keys if k not in result]
    assert not missing, f"{script.name} --smoke: keys {missing} missing from {sorted(result)}"
    assert "error" not in result and not result.get("errors"), f"{script.name} --smoke reported errors: {result}"
