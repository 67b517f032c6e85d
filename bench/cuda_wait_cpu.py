"""What the liveness rule's CPU signal sees of a GPU engine stuck on its device, measured on a
GPU host: a process whose thread waits in `torch.cuda.synchronize()` behind a kernel that does
not end (`torch.cuda._sleep`, as a collective whose peer never comes spins on the GPU), read
from outside every 0.5 s as the daemon's probe reads it (/proc/PID/stat: state, CPU time).

    python3 -m bench.cuda_wait_cpu --out $OUT/cuda-wait-cpu.json      # on the GPU host

Two waits: CUDA's default scheduling (cudaDeviceScheduleAuto: with fewer CUDA contexts than
cores, the waiting thread spins) and cudaDeviceScheduleBlockingSync (it sleeps). Needs only
torch and the standard library; every process it starts is its own and ended before it returns.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import ctypes, sys, time, torch
if sys.argv[1] == "blocking":
    cudart = ctypes.CDLL("libcudart.so." + torch.version.cuda.split(".")[0])
    assert cudart.cudaSetDeviceFlags(4) == 0  # cudaDeviceScheduleBlockingSync
torch.cuda.init()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
torch.cuda._sleep(int(float(sys.argv[2]) * 2e9))  # cycles: about 2 GHz
torch.cuda.synchronize()
print("done", flush=True)
"""


def stat(pid: int) -> tuple[str, float]:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(mode: str, wait_s: float) -> dict[str, object]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(wait_s * 4)],
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # the kernel is queued, the thread in synchronize()
        rows = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait_s:
            state, cpu = stat(p.pid)
            rows.append((round(time.monotonic() - t0, 2), state, cpu))
            time.sleep(0.5)
        used = rows[-1][2] - rows[0][2]
        took = rows[-1][0] - rows[0][0]
        return {"mode": mode, "seconds": took, "cpu_s": round(used, 2),
                "cpu_fraction_of_a_core": round(used / took, 3),
                "states": sorted({r[1] for r in rows})}  # fmt: skip
    finally:
        p.send_signal(signal.SIGKILL)  # our own child
        p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--wait-s", type=float, default=10.0)
    args = ap.parse_args()
    import torch

    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "runs": [one(m, args.wait_s) for m in ("auto", "blocking", "auto", "blocking")],
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
