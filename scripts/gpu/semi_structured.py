"""GPU check of issue 32 item 3: 2:4 semi-structured vs dense at GPT-2-medium's MLP shapes (bf16,
8192 tokens), forward+backward, with a noise-floor control and a correctness check. It runs
``benchmarks/semi_structured.py`` (the benchmark itself) in this process; < 60 s on an H100/H200;
on a CPU-only machine it prints {"gpu": false, ...} and exits 0. Last line: one JSON object.

    python scripts/gpu/semi_structured.py [--rounds 50]
"""
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "semi_structured.py"
    sys.argv[0] = str(bench)
    runpy.run_path(str(bench), run_name="__main__")
