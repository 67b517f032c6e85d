"""The capture summary's reader against loading the trace whole: time and peak memory (Python's
allocations, tracemalloc) for one rank's trace of N events, measured in one run.

    .venv/bin/python -m bench.summary_bench --events 1000000 --runs 3 --write docs/performance.md

The trace is shaped like a vLLM worker's with with_stack on (as the real tier's are): mostly
python_function frames, with decode steps of CPU operators.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench.common import write_section
from kimi_supervisor.analysis import trace as tracesummary


def make_trace(path: Path, events: int) -> int:
    """Writes the trace; returns its unpacked size in bytes."""
    size = 0
    with gzip.open(path, "wt") as f:

        def put(text: str) -> None:
            nonlocal size
            f.write(text)
            size += len(text)

        put('{\n  "schemaVersion": 1,\n  "traceEvents": [\n')
        for i in range(events):
            step, k = divmod(i, 1000)
            t = step * 2000.0
            if k == 0:
                ev: dict[str, Any] = {"ph": "X", "cat": "user_annotation", "name":
                    "execute_context_0(0)_generation_4(4)", "ts": t, "dur": 1900.0}  # fmt: skip
            elif k % 50 == 1:
                ev = {"ph": "X", "cat": "cpu_op", "name": "_C::onednn_mm", "ts": t + k, "dur": 20.0}
            else:
                ev = {"ph": "X", "cat": "python_function", "name": f"vllm/x.py({k}): f",
                      "ts": t + k + 0.5, "dur": 0.2, "args": {"Python id": i}}  # fmt: skip
            ev.update(pid=1, tid=1)
            put(("  " if i == 0 else ", ") + json.dumps(ev) + "\n")
        put('  ],\n  "traceName": "bench"\n}\n')
    return size


def measure(fn: Any) -> tuple[float, float]:
    tracemalloc.start()
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return took, peak / 1e6


def run(events: int, runs: int) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "0-rank-0.1.pt.trace.json.gz")
        unpacked = make_trace(path, events)
        packed = path.stat().st_size

        def stream() -> None:
            with open(path, "rb") as f:
                tracesummary.summarize_file(f)

        def whole() -> None:
            with gzip.open(path) as f:
                json.load(f)

        results: dict[str, list[tuple[float, float]]] = {"stream": [], "whole": []}
        for _ in range(runs):
            results["stream"].append(measure(stream))
            results["whole"].append(measure(whole))
    s_t = statistics.median(t for t, _ in results["stream"])
    w_t = statistics.median(t for t, _ in results["whole"])
    s_m = max(m for _, m in results["stream"])
    w_m = max(m for _, m in results["whole"])
    return (
        f"One rank's trace of {events:,} events ({packed / 1e6:.1f} MB gzipped, "
        f"{unpacked / 1e6:.0f} MB of JSON), {runs} runs each, medians of time and the largest "
        "peak of Python's allocations:\n\n"
        "| read | time, s | peak memory, MB |\n|---|---|---|\n"
        f"| the summary (streamed, every figure computed) | {s_t:.2f} | {s_m:.1f} |\n"
        f"| `json.load` of the whole trace (nothing computed) | {w_t:.2f} | {w_m:.0f} |\n\n"
        f"The stream takes {s_t / w_t:.2f}x the time of a plain load and {s_m / w_m:.3f}x "
        "its memory.\n"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--write", type=Path, default=None)
    args = p.parse_args()
    body = run(args.events, args.runs)
    print(body)
    if args.write:
        write_section(args.write, "summary-bench", body)


if __name__ == "__main__":
    main()
