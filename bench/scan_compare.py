"""The whole-host descriptor scan (rung 2's, and the STUCK diagnosis's) of two checkouts, measured
in one run on one host: the same 10,000 idle processes, the same vLLM tree on 8 simulated GPUs,
the two versions timed in turn.

    .venv/bin/python -m bench.scan_compare [--base REF] [--runs N] [--write docs/performance.md]

The base checkout is a `git worktree` of REF (default: the commit before the container-aware
scan) under a temporary directory, removed at the end. Each measurement is a fresh interpreter
of that checkout calling its own `device_users` as its teardown does (with the GPU port's
`node_key` where the version has one), so neither version warms the other's caches. The idle
processes are `sleep` children of this benchmark, reaped at the end (also on failure).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import fmt_ms, grow_idle, machine, reap_idle
from bench.common import main as bench_main
from bench.teardown_bench import Bench
from kimi_supervisor.ports import processes
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.sandbox import Sandbox

BASE = "c9df740"  # main before the container-aware scan
IDLE = 10_000
CHECKOUT = Path(__file__).resolve().parent.parent

# Run inside the checkout measured: its own device_users, 3 calls, seconds each.
PROBE = """
import inspect, json, sys, time
from kimi_supervisor.teardown.scan import device_users
files, paths, root = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
kw = {}
if "node_key" in inspect.signature(device_users).parameters:
    from kimi_supervisor.sandbox.simreader import SimGpu
    kw["node_key"] = SimGpu(root).node_key
out = []
for _ in range(3):
    t0 = time.perf_counter()
    device_users(files, paths, **kw)
    out.append(time.perf_counter() - t0)
print(json.dumps(out))
"""


def measure(checkout: Path, files: list[str], paths: list[str], root: Path) -> list[float]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(files), json.dumps(paths), str(root)],
        cwd=checkout,
        env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    times: list[float] = json.loads(r.stdout)
    return times


def run(runs: int, base: str = BASE) -> str:
    work = Path(tempfile.mkdtemp(prefix="kimi-scancmp-"))
    old = work / "base"
    git = ["git", "-C", str(CHECKOUT), "worktree"]
    subprocess.run([*git, "add", "-q", "--detach", str(old), base], check=True)
    sb = Sandbox.up(work / "sb", gpus=8, daemon=False)
    idle: list[subprocess.Popen[bytes]] = []
    try:
        b = Bench(sb, 8)
        b.setup("well-behaved")  # vLLM's tree serving: 8 workers holding the GPUs
        gpu = simgpu.SimGpu(sb.gpu_dir)
        paths = [gpu.device_path(i) for i in range(8)]
        files = paths + [str(p) for p in simgpu.shared_files(sb.gpu_dir)]
        gpu.close()
        grow_idle(idle, IDLE)
        total = len(processes.all_pids())
        times: dict[str, list[float]] = {"base": [], "head": []}
        for _ in range(runs):  # in turn, so that a noisy moment hits both
            times["base"] += measure(old, files, paths, sb.gpu_dir)
            times["head"] += measure(CHECKOUT, files, paths, sb.gpu_dir)
        b.reset([])
    finally:
        reap_idle(idle)
        sb.down()
        subprocess.run([*git, "remove", "--force", str(old)], check=False)
    ratio = statistics.median(times["head"]) / statistics.median(times["base"])
    verdict = "met" if ratio <= 1.2 else "MISSED"
    return (
        f"Measured {machine()}; {runs} interpreters × 3 calls per checkout, taken in turn, "
        f"milliseconds, median (min–max). {IDLE:,} extra idle processes ({total:,} in all), "
        "vLLM's tree serving on 8 simulated GPUs; the scan is `device_users` over every GPU's "
        "files, as rung 2 reads it.\n\n"
        "| checkout | full descriptor scan |\n|---|---|\n"
        f"| {base} (before the container-aware scan) | {fmt_ms(times['base'])} |\n"
        f"| this one | {fmt_ms(times['head'])} |\n\n"
        f"This one / before: **{ratio:.2f}×** (target ≤ 1.2×: {verdict}).\n"
    )


if __name__ == "__main__":
    bench_main("scan-compare", run, 5, base=(str, BASE))
