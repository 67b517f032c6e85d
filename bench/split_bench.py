"""The capture summary with the wait/transfer split, on 8 ranks of large traces: time and peak
memory of `kimi-mode capture --summarize` against Meta's HolisticTraceAnalysis on the same files
(its TraceAnalysis and get_comm_comp_overlap), or against a `json.load` of one rank when HTA is
not installed. Measured in one run, each in its own process tree; the peak is the tree's summed
resident memory, sampled every 50 ms.

    .venv/bin/python -m bench.split_bench --ranks 8 --mb 200 --hta-python /tmp/hta/bin/python \\
        --write docs/performance.md

The traces are synthetic (tests/synthetic_traces.py): decode steps of 61
layers, each a GEMM and an NCCL all-reduce, CPU operators for bulk, rank 3 arriving 400 µs late
at every all-reduce; `--mb` is each rank's unpacked JSON, written gzipped as vLLM writes it. The
split must still recover the injected wait at that size, which is checked and printed.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from bench.common import machine, main
from tests.synthetic_traces import write_rank

LAYERS, LATE, LATE_US, JITTER_US = 61, 3, 400.0, 40.0
HTA_SCRIPT = """
import sys
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
print(a.get_comm_comp_overlap(visualize=False).to_json())
"""


def _steps_for(mb: float, world: int) -> int:
    """Steps that make `mb` MB of one rank's JSON (measured on a few steps)."""
    buf = io.StringIO()
    write_rank(buf, 0, world, 4, LAYERS, late=LATE, late_us=LATE_US, jitter_us=JITTER_US)
    return max(4, int(mb * 1e6 / (len(buf.getvalue()) / 4)))


def _write(args: tuple[Path, int, int, int]) -> tuple[int, dict[str, float], int]:
    folder, rank, world, steps = args
    name = folder / f"1796000000000000000-rank-{rank}.1796080794321189670.pt.trace.json.gz"
    with gzip.open(name, "wt", compresslevel=1) as f:
        truth = write_rank(
            f, rank, world, steps, LAYERS, late=LATE, late_us=LATE_US, jitter_us=JITTER_US
        )
    with gzip.open(name, "rb") as f:
        unpacked = sum(len(b) for b in iter(lambda: f.read(1 << 20), b""))
    return rank, truth, unpacked


def tree_peak(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """Run argv; its wall time (s), its process tree's peak summed RSS (MB), and its stdout."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, env=env)
        peak = 0
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            root = psutil.Process(proc.pid)
            while not done.is_set():
                try:
                    procs = [root, *root.children(recursive=True)]
                    total = 0
                    for p in procs:
                        with contextlib.suppress(psutil.Error):
                            total += p.memory_info().rss
                    peak = max(peak, total)
                except psutil.Error:
                    return
                done.wait(0.05)

        t0 = time.monotonic()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.wait()
        took = time.monotonic() - t0
        done.set()
        sampler.join()
        out.seek(0)
        return took, peak / 1e6, out.read().decode(errors="replace")


def run(runs: int, ranks: int, mb: float, hta_python: str) -> str:
    with tempfile.TemporaryDirectory(prefix="split-bench-") as d:
        folder = Path(d, "capture")
        folder.mkdir()
        steps = _steps_for(mb, ranks)
        t0 = time.monotonic()
        with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            made = list(pool.map(_write, [(folder, r, ranks, steps) for r in range(ranks)]))
        made_s = time.monotonic() - t0
        truth = {r: t for r, t, _ in made}
        unpacked = sum(u for _, _, u in made)
        packed = sum(p.stat().st_size for p in folder.iterdir())
        env = {**os.environ, "KIMI_SUPERVISOR_CONFIG": "/nonexistent"}
        ours_argv = [sys.executable, "-m", "kimi_supervisor.cli.kimi_mode", "capture",
                     "--summarize", str(folder), "-o", "json"]  # fmt: skip
        ours: list[tuple[float, float]] = []
        summary: dict[str, Any] = {}
        for _ in range(runs):
            (folder / "summary.json").unlink(missing_ok=True)
            took, peak, out = tree_peak(ours_argv, env)
            summary = json.loads(out)
            ours.append((took, peak))
        other: list[tuple[float, float]] = []
        if hta_python and Path(hta_python).exists():
            label = "HolisticTraceAnalysis: TraceAnalysis + get_comm_comp_overlap"
            for _ in range(runs):
                took, peak, _out = tree_peak([hta_python, "-c", HTA_SCRIPT, str(folder)])
                other.append((took, peak))
        else:
            label = "`json.load` of one rank (HTA not installed)"
            first = sorted(folder.glob("*rank-0*"))[0]
            load = f"import gzip, json; json.load(gzip.open({str(first)!r}))"
            for _ in range(runs):
                took, peak, _out = tree_peak([sys.executable, "-c", load])
                other.append((took, peak))
    ar = summary["across_ranks"]["kinds"]["decode"]["collectives"]["all_reduce"]
    counted = steps - 1
    worst = max(
        abs(p["wait_ms"] - truth[p["rank"]]["wait_us"] / counted / 1000)
        / max(truth[p["rank"]]["wait_us"] / counted / 1000, 1e-9)
        for p in ar["per_rank"]
        if p["rank"] != LATE
    )
    o_t, o_m = min(t for t, _ in ours), max(m for _, m in ours)
    h_t, h_m = min(t for t, _ in other), max(m for _, m in other)
    return (
        f"{machine()}. {ranks} ranks x {unpacked / ranks / 1e6:.0f} MB of JSON each "
        f"({unpacked / 1e9:.2f} GB in all, {packed / 1e6:.0f} MB gzipped; {steps} decode steps "
        f"of {LAYERS} all-reduces per rank; made in {made_s:.0f} s), {runs} run(s) each, "
        "the fastest time and the largest peak:\n\n"
        "| read | time, s | peak memory of the process tree, MB |\n|---|---|---|\n"
        f"| `kimi-mode capture --summarize` (every rank at once, the split) | {o_t:.1f} | "
        f"{o_m:.0f} |\n"
        f"| {label} | {h_t:.1f} | {h_m:.0f} |\n\n"
        f"Ours takes {o_t / h_t:.2f}x the time and {o_m / h_m:.2f}x the memory. The split at "
        f"this size: rank {ar['last_to_arrive']['rank']} last in "
        f"{ar['last_to_arrive']['share'] * 100:.0f} % of calls (injected: rank {LATE}, every "
        f"call), the others' wait within {worst * 100:.2f} % of the injected.\n"
    )


if __name__ == "__main__":
    main("split-bench", run, runs=1, ranks=(int, 8), mb=(float, 200.0), hta_python=(str, ""))
