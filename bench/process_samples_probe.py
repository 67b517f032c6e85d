"""Whether NVML's per-process samples still name a process that used a GPU and is gone: what
the liveness probe needs to tell a GPU that another user's short job shared between two of
its readings (its bursts land in vLLM's counters) from one that vLLM alone used.

NVML lists a GPU's running processes (nvmlDeviceGetComputeRunningProcesses) only while they
hold a context; a job that starts and ends between two readings is never listed. The driver
also keeps a buffer of per-process utilization samples (nvmlDeviceGetProcessUtilization, since
a CPU timestamp). This measures, for short jobs of several shapes that end before the reading:
is the job's PID in the samples since the previous reading, how long after its end it stays
there (the buffer's depth), and what its samples read (a copy-only job: SM 0 %?).

    python3 -m bench.process_samples_probe --out $OUT/process-samples.json   # on the GPU host

Needs torch and nvidia-ml-py. Every process it starts is its own, waited for; the GPU's
settings (accounting mode included) are read, never changed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CHILD = r"""
import sys, time
shape, seconds = sys.argv[1], float(sys.argv[2])
import torch
dev = torch.device("cuda")
torch.zeros(1, device=dev); torch.cuda.synchronize()
print("working", flush=True)
end = time.monotonic() + seconds
if shape == "gemm":
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    while time.monotonic() < end:
        for _ in range(4):
            a @ a
        torch.cuda.synchronize()
elif shape == "h2d_copy":
    h = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    d = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    while time.monotonic() < end:
        d.copy_(h, non_blocking=True); torch.cuda.synchronize()
elif shape == "idle_context":
    while time.monotonic() < end:
        time.sleep(0.05)
print("done", flush=True)
"""


def now_us() -> int:
    return int(time.time() * 1e6)


def samples(nv: Any, h: Any, since_us: int) -> tuple[list[dict[str, int]], str | None]:
    try:
        got = nv.nvmlDeviceGetProcessUtilization(h, since_us)
    except nv.NVMLError as e:
        return [], str(e)
    return [
        {"pid": int(s.pid), "ts_us": int(s.timeStamp), "sm": int(s.smUtil), "mem": int(s.memUtil)}
        for s in got
    ], None


def running(nv: Any, h: Any) -> list[int]:
    return sorted(int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(h))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gpu", type=int, default=0)
    args = p.parse_args()

    import pynvml as nv

    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(args.gpu)
    info: dict[str, Any] = {
        "what": "NVML per-process samples of jobs gone before the reading "
        "(bench/process_samples_probe.py)",
        "gpu": nv.nvmlDeviceGetName(h),
        "driver": nv.nvmlSystemGetDriverVersion(),
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        info["accounting_mode"] = int(nv.nvmlDeviceGetAccountingMode(h))
    except nv.NVMLError as e:
        info["accounting_mode"] = str(e)
    first, err = samples(nv, h, 0)
    info["samples_before_any_job"] = {
        "count": len(first),
        "error": err,
        "pids": sorted({s["pid"] for s in first}),
    }

    runs = []
    # (shape, seconds of work, seconds between the job's end and the reading)
    plan = [
        ("gemm", 2.0, 0.0),
        ("gemm", 2.0, 0.5),
        ("gemm", 0.6, 0.5),
        ("h2d_copy", 2.0, 0.5),
        ("idle_context", 2.0, 0.5),
        ("gemm", 2.0, 5.0),
        ("h2d_copy", 2.0, 5.0),
    ]
    for shape, seconds, after in plan:
        since = now_us()  # the previous reading's time: the job starts after it
        t0 = time.monotonic()
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, shape, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        child.stdout.readline()  # "working"
        time.sleep(seconds / 2)
        during, during_err = samples(nv, h, since)  # the control: while the job runs
        running_during = running(nv, h)
        rest = child.stdout.read()
        child.wait(timeout=300)
        ended = time.monotonic()
        time.sleep(after)
        got, err = samples(nv, h, since)
        mine = [s for s in got if s["pid"] == child.pid]
        run = {
            "shape": shape,
            "work_s": seconds,
            "read_after_end_s": after,
            "child_pid": child.pid,
            "child_ok": rest.strip() == "done",
            "child_lifetime_s": round(ended - t0, 2),
            "during": {
                "running": running_during,
                "child_in_samples": any(s["pid"] == child.pid for s in during),
                "child_samples": sum(s["pid"] == child.pid for s in during),
                "child_sm_max": max(
                    (s["sm"] for s in during if s["pid"] == child.pid), default=None
                ),
                "error": during_err,
            },
            "after": {
                "running": running(nv, h),
                "child_in_samples": bool(mine),
                "child_samples": len(mine),
                "child_sm_max": max((s["sm"] for s in mine), default=None),
                "other_pids": sorted({s["pid"] for s in got} - {child.pid}),
                "error": err,
            },
        }
        runs.append(run)
        print(json.dumps(run), flush=True)
    info["runs"] = runs
    nv.nvmlShutdown()
    args.out.write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
