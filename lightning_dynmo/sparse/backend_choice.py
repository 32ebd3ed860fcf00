"""``backend="auto"`` of block-sparse attention: the faster back end, measured once per shape class.

Which of FlexAttention and our kernel is faster depends on the GPU, the dtype, the sequence length
and the block size (our CUDA kernel ran at 0.07-0.36x of FlexAttention on an H100 in bf16, but it
is the only one for head dims < 16 and with FlexAttention missing). So, like
``sparse/dispatch.py`` for linear layers, the first call of a shape class times every candidate's
forward+backward on that call's own inputs (detached copies) and caches the winner per
``(what, device, dtype, power-of-two sequence bucket, block size, head dim)``.

Every candidate computes the same exact attention (same mask, softmax to fp rounding), so a
choice changes results by rounding only: bf16 outputs and gradients agree to ~1e-2, fp32 to
~1e-4 (``tests/unit/test_sparse_flex.py``, CUDA). Two data-parallel replicas that chose
differently therefore still hold identical parameters (their gradients are averaged before every
update); what differs is the last bits of each replica's local loss. To make the choice the same
everywhere (bit-for-bit runs, or to skip the measurement) set ``LDSPARSE_ATTENTION_BACKEND=flex``
or ``=kernel``; :func:`attention_choices` lists what was chosen.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Dict, Hashable, Mapping, Optional, Tuple

import torch

__all__ = ["ENV_OVERRIDE", "attention_choices", "cached_choice", "clear_attention_choices", "fastest",
           "choice_key", "env_override"]

ENV_OVERRIDE = "LDSPARSE_ATTENTION_BACKEND"
_CHOICES: Dict[Hashable, str] = {}
_TIMES: Dict[Hashable, Dict[str, float]] = {}


def _bucket(n: int) -> int:
    """Next power of two: nearby sequence lengths share one measurement."""
    return 1 << max(0, int(n) - 1).bit_length()


def choice_key(what: str, device: torch.device, dtype: torch.dtype, seq_len: int, block_size: int,
               head_dim: int) -> Tuple:
    device = torch.device(device)
    return (what, device.type, device.index, str(dtype).replace("torch.", ""), _bucket(seq_len), int(block_size),
            int(head_dim))


def env_override(candidates: Tuple[str, ...]) -> Optional[str]:
    """The back end ``LDSPARSE_ATTENTION_BACKEND`` names (None when unset); an unknown or
    unavailable name is an error, not a silent fallback."""
    name = os.environ.get(ENV_OVERRIDE, "").strip()
    if not name:
        return None
    if name not in candidates:
        raise ValueError(f"{ENV_OVERRIDE}={name!r} is not available here: backend='auto' can pick "
                         f"{', '.join(candidates)} for this call")
    return name


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median wall milliseconds of ``run`` after one warm-up call (device-synchronised): the
    measurement behind every measured kernel choice (attention here, linear layers in dispatch)."""
    run()  # warm-up (and compilation)
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def fastest(key: Hashable, trials: Mapping[str, Callable[[], Callable[[], None]]], device: torch.device,
            repeats: int = 5) -> str:
    """The name in ``trials`` whose run is fastest, measured on the first request for ``key`` and
    cached. ``trials[name]()`` prepares a run (allocations outside the timing) and returns it."""
    if key not in _CHOICES:
        if len(trials) == 1:
            _CHOICES[key] = next(iter(trials))
        else:
            with torch.inference_mode(False), torch.enable_grad():
                times = {name: median_ms(prepare(), torch.device(device), repeats) for name, prepare in trials.items()}
            _TIMES[key] = times
            _CHOICES[key] = min(times, key=times.get)
    return _CHOICES[key]


def cached_choice(key: Hashable) -> Optional[str]:
    """The choice made for ``key``, None if it was never measured (nothing is measured here)."""
    return _CHOICES.get(key)


def attention_choices() -> Dict[Hashable, Dict[str, object]]:
    """What ``backend="auto"`` chose so far: key -> {"backend", "ms" (per candidate, when measured)}."""
    return {k: {"backend": v, "ms": dict(_TIMES.get(k, {}))} for k, v in _CHOICES.items()}


def clear_attention_choices() -> None:
    """Forget every choice (the next call of each shape class measures again)."""
    _CHOICES.clear()
    _TIMES.clear()
