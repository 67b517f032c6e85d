"""How the cost grows: teardown time with the number of GPUs, and one scan for strays and GPU
holders with thousands of extra idle processes on the host.

    .venv/bin/python -m bench.scale_bench [--runs N] [--write docs/performance.md]

The idle processes are `sleep` children of this benchmark, reaped at the end (also on failure).
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import fmt_ms, grow_idle, machine, reap_idle
from bench.common import main as bench_main
from bench.teardown_bench import Bench
from kimi_supervisor.ports import processes
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.sandbox import UNIT, Sandbox
from kimi_supervisor.teardown.scan import device_users, has_vllm_signature, listeners


def teardown_by_gpus(runs: int) -> list[str]:
    rows = []
    for gpus in (1, 2, 4, 8):
        root = Path(tempfile.mkdtemp(prefix=f"kimi-scale{gpus}-"))
        sb = Sandbox.up(root, gpus=gpus, daemon=False)
        try:
            b = Bench(sb, gpus)
            floor = [b.floor("well-behaved") for _ in range(runs)]
            own = [b.own_exit("well-behaved") or 0.0 for _ in range(runs)]
            td = [b.teardown("well-behaved") for _ in range(runs)]
        finally:
            sb.down()
        rows.append(
            f"| {gpus} | {fmt_ms(floor)} | {fmt_ms(own)} | {fmt_ms(td)} | "
            f"{statistics.median(td) / statistics.median(own):.2f}× |"
        )
    return rows


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def scans(runs: int) -> list[str]:
    root = Path(tempfile.mkdtemp(prefix="kimi-scan-"))
    sb = Sandbox.up(root, gpus=8, daemon=False)
    idle: list[subprocess.Popen[bytes]] = []
    rows = []
    try:
        b = Bench(sb, 8)
        b.setup("well-behaved")  # vLLM's tree serving: 8 workers listed on the GPUs
        config = b.config
        main_pid = b.systemd.status(UNIT).main_pid
        gpu = simgpu.SimGpu(sb.gpu_dir)
        indices = list(range(8))
        paths = [gpu.device_path(i) for i in indices]
        for extra in (1_000, 5_000, 10_000):
            grow_idle(idle, extra)
            total = len(processes.all_pids())

            def normal_path() -> None:
                # What a teardown pass reads: the unit's tree, NVML's lists, the signature of
                # the listed processes, the port's listeners (vLLM's tree looked at first).
                tree = [main_pid, *processes.descendants(main_pid)]
                listed = [p.pid for s in gpu.sample(indices) for p in s.processes]
                for pid in listed:
                    has_vllm_signature(pid, [])
                listeners(config.vllm.port, config.vllm.host, tree + listed)

            def tree_only() -> None:
                processes.descendants(main_pid)

            def nvml_only() -> None:
                gpu.sample(indices)

            normal = timed(normal_path, runs)
            tree = timed(tree_only, runs)
            nvml = timed(nvml_only, runs)
            # Rung 2: who has a managed device file open, with what they map of the GPUs' files.
            files = paths + [str(p) for p in simgpu.shared_files(sb.gpu_dir)]
            full = timed(lambda f=files: device_users(f, paths), runs)
            target = "met" if statistics.median(normal) < 0.1 else "MISSED"
            rows.append(
                f"| {extra:,} ({total:,} processes in all) | {fmt_ms(normal)} | {fmt_ms(tree)} | "
                f"{fmt_ms(nvml)} | {fmt_ms(full)} | < 100 ms: {target} |"
            )
        gpu.close()
        b.reset([])
    finally:
        reap_idle(idle)
        sb.down()
    return rows


def run(runs: int) -> str:
    gpus = teardown_by_gpus(runs)
    scan = scans(runs)
    return (
        f"Measured {machine()}; {runs} runs per cell, milliseconds, median (min–max).\n\n"
        "Teardown of the well-behaved scenario (vLLM's tree in the unit, one worker per GPU), "
        "against the floor (SIGKILL of every holder until the GPUs read baseline) and the fake "
        "vLLM's own orderly exit (`systemctl stop`), which a teardown of a well-behaved vLLM "
        "waits for:\n\n"
        "| simulated GPUs | floor | own exit | teardown → CLEAN | teardown / own exit |\n"
        "|---|---|---|---|---|\n"
        + "\n".join(gpus)
        + "\n\nOne scan for strays and GPU holders with extra idle processes on the host "
        "(vLLM's tree serving on 8 simulated GPUs). *Normal path*: the unit's process tree "
        "(from /proc/PID/task/*/children), the GPUs' process lists, vLLM's signature of the "
        "listed processes and the listeners of vLLM's port (its tree looked at first). *Full "
        "descriptor scan*: every process's descriptors, and the maps of those holding a managed "
        "device file (rung 2 of the evidence ladder), which a teardown reads only when no live "
        "listed process explains a GPU's memory.\n\n"
        "| extra idle processes | normal path | of which process tree | of which GPU lists | "
        "full descriptor scan | target |\n|---|---|---|---|---|---|\n" + "\n".join(scan) + "\n"
    )


if __name__ == "__main__":
    bench_main("scale-bench", run, 5)
