"""What the deadline on every NVML call and state-folder call costs (ports/bounded.py): the
same call made directly, through a thread `Worker` (a hand-over to one thread and back) and
through the daemon's `ProcessWorker` (pickled to a process of its own over a pipe and back), in
interleaved rounds, with the spread of the rounds as the noise.

    .venv/bin/python -m bench.bounded_bench [--runs 7] [--calls 2000] [--write docs/performance.md]

On a GPU host (NVML present) it also times a sample of every GPU, directly and through
BoundedGpu; elsewhere a no-op call and a stat of a file stand in and the NVML row says why
it is missing. The teardown samples the GPUs every `teardown.poll_interval_s` (10 ms shipped):
the row to read is the added time per sample against that.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from bench.common import machine, main
from kimi_supervisor.ports.bounded import ProcessWorker, Worker, on_object


def per_call(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def compare(name: str, fn: Callable[[], object], runs: int, calls: int) -> str:
    """`fn` directly, on a thread and in a process; `fn` must pickle (a partial)."""
    thread, process = Worker("bench", 10), ProcessWorker("bench", 10)
    direct, threaded, crossed = [], [], []
    try:
        process.call(fn, name)  # started, and the call's modules imported there
        for _ in range(runs):  # interleaved: drift hits all alike
            direct.append(per_call(fn, calls))
            threaded.append(per_call(lambda: thread.call(fn, name), calls))
            crossed.append(per_call(lambda: process.call(fn, name), calls))
    finally:
        process.close()
    d, t, p = (statistics.median(x) for x in (direct, threaded, crossed))
    noise = max((max(x) - min(x)) / statistics.median(x) for x in (direct, threaded, crossed))
    return (
        f"| {name} | {d * 1e6:.1f} µs | {t * 1e6:.1f} µs (+{(t - d) * 1e6:.1f}) | "
        f"{p * 1e6:.1f} µs (+{(p - d) * 1e6:.1f}) | {p / d:.2f} | {noise:.0%} |\n"
    )


def run(runs: int, calls: int) -> str:
    rows = compare("a call that does nothing", functools.partial(int), runs, calls)
    with tempfile.NamedTemporaryFile() as f:
        rows += compare("stat of state.json (the loop's per-pass check)",
                        functools.partial(os.stat, f.name), runs, calls)  # fmt: skip
    try:
        from kimi_supervisor.ports.gpu import GpuUnavailable, NvmlGpu

        indices = list(range(NvmlGpu().device_count()))
        sample = functools.partial(on_object, NvmlGpu, (), "sample", indices)
        rows += compare(f"NVML sample of {len(indices)} GPU(s)", sample, runs,
                        max(calls // 10, 50))  # fmt: skip
        nvml = ""
    except (GpuUnavailable, ImportError) as e:
        nvml = f"\nNo NVML row on this machine: {e}.\n"
    return (
        f"Measured {machine()}: {runs} interleaved rounds of {calls} calls each (NVML: a tenth),"
        " median per call; the ratio is the process's over direct; noise is the largest spread"
        " of one way's rounds over their median.\n\n"
        "| call | direct | on a thread (added) | in the daemon's I/O process (added) | ratio "
        "| noise |\n"
        "|---|---|---|---|---|---|\n" + rows + nvml
    )


if __name__ == "__main__":
    main("bounded_bench", run, runs=7, calls=(int, 2000))
