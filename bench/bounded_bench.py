"""What the deadline on every NVML call and state-folder call costs (ports/bounded.py): the
same call made directly and through its Worker (a hand-over to one thread and back), in
interleaved rounds, with the spread of the rounds as the noise.

    .venv/bin/python -m bench.bounded_bench [--runs 7] [--calls 2000] [--write docs/performance.md]

On a GPU host (NVML present) it also times a sample of every GPU, directly and through
BoundedGpu; elsewhere a no-op call and a stat of a file stand in and the NVML row says why
it is missing. The teardown samples the GPUs every `teardown.poll_interval_s` (10 ms shipped):
the row to read is the added time per sample against that.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

from bench.common import machine, main
from kimi_supervisor.ports.bounded import Worker


def per_call(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def compare(name: str, fn: Callable[[], object], runs: int, calls: int) -> str:
    w = Worker("bench", 10)
    direct, bounded = [], []
    for _ in range(runs):  # interleaved: drift hits both alike
        direct.append(per_call(fn, calls))
        bounded.append(per_call(lambda: w.call(fn, name), calls))
    d, b = statistics.median(direct), statistics.median(bounded)
    noise = (max(direct) - min(direct)) / d
    return (
        f"| {name} | {d * 1e6:.1f} µs | {b * 1e6:.1f} µs | +{(b - d) * 1e6:.1f} µs | "
        f"{b / d:.2f} | {noise:.0%} |\n"
    )


def run(runs: int, calls: int) -> str:
    rows = compare("a call that does nothing", lambda: None, runs, calls)
    with tempfile.NamedTemporaryFile() as f:
        rows += compare("stat of state.json (the loop's per-pass check)", lambda: os.stat(f.name),
                        runs, calls)  # fmt: skip
    try:
        from kimi_supervisor.ports.gpu import GpuUnavailable, NvmlGpu

        gpu = NvmlGpu()
        indices = list(range(gpu.device_count()))
        rows += compare(f"NVML sample of {len(indices)} GPU(s)", lambda: gpu.sample(indices),
                        runs, max(calls // 10, 50))  # fmt: skip
        gpu.close()
        nvml = ""
    except (GpuUnavailable, ImportError) as e:
        nvml = f"\nNo NVML row on this machine: {e}.\n"
    return (
        f"Measured {machine()}: {runs} interleaved rounds of {calls} calls each (NVML: a tenth),"
        " median per call; noise is the spread of the direct rounds over their median.\n\n"
        "| call | direct | through its Worker | added | ratio | noise |\n"
        "|---|---|---|---|---|---|\n" + rows + nvml
    )


if __name__ == "__main__":
    main("bounded_bench", run, runs=7, calls=(int, 2000))
