"""CUDA-event timing shared by the GPU benchmarks: methods are timed round-robin (one call of
each per round, so clock and thermal drift hit all alike) and the median per method is kept."""
from __future__ import annotations

import statistics

import torch


def cuda_round_robin(fns: dict, rounds: int, warmup: int = 2) -> dict:
    """``{name: median milliseconds}`` of ``fns`` (callables launching CUDA work)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}


def cuda_graph_of(run):
    """``run`` (a callable launching one forward+backward) captured in a CUDA graph; returns the
    graph's ``replay``. Replaying it costs the host one call, so its time is what the GPU needs for
    the work: the figure a model step reaches when captured whole (or with enough work queued ahead
    to hide the host). ``run`` should set the gradients it produces to ``None`` first, so that the
    captured backward allocates them from the graph's pool. Raises where ``run`` cannot be captured
    (a host sync inside, an op that refuses capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture stream, as torch.cuda.graph's docs ask
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def graphed_round_robin(fns: dict, rounds: int, probe=None, tol: float = 2e-2) -> dict:
    """``{"ms": {name: median ms of the graph replay}, "failed": {name: why}}`` for the callables
    ``fns`` (each one forward+backward), each captured with :func:`cuda_graph_of`; a call that cannot
    be captured is named with its error instead of failing the benchmark. ``probe()`` returns a
    tensor the call writes (a gradient): a replay must give what an eager call gives (relative error
    by norm below ``tol``), else the graph is reported under "failed" and not timed."""
    graphs, failed = {}, {}
    for name, run in fns.items():
        try:
            replay = cuda_graph_of(run)
            if probe is not None:
                replay()
                replayed = probe().detach().float().clone()
                run()
                eager = probe().detach().float()
                err = float((replayed - eager).norm() / eager.norm().clamp_min(1e-30))
                if not err < tol:
                    raise RuntimeError(f"the replay differs from an eager call (relative error {err:.3g})")
            graphs[name] = replay
        except Exception as exc:  # noqa: BLE001 -- reported in the JSON; the eager figures stand
            first = str(exc).splitlines()[0][:200] if str(exc) else ""
            failed[name] = f"{type(exc).__name__}: {first}"
            try:
                torch.cuda.synchronize()
            except Exception as late:  # noqa: BLE001 -- the capture's error, seen again
                failed[name] += f" (then {type(late).__name__} at synchronize)"
    ms = cuda_round_robin(graphs, rounds) if graphs else {}
    return {"ms": {name: round(value, 4) for name, value in ms.items()}, "failed": failed}
