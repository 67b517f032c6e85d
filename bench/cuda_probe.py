"""What the real driver does, measured on a GPU host: the facts the simulated GPU host copies and
the defaults that come from real hardware.

    python3 -m bench.cuda_probe --out $OUT/cuda-probe.json        # on the GPU host

Needs only torch, pynvml and the standard library (the lent host has no pydantic). Every process
it starts is its own (it is a child subreaper) and is ended before it returns. Measures:
- cuda_start: a fresh `python3` that imports torch and allocates on GPU 0, from spawn until NVML
  lists its PID and until its memory shows;
- respawn: a parent that restarts such a child, from the child's SIGKILL until NVML lists the
  next child (what a teardown's respawn watch must cover);
- device files: which /dev/nvidia* a CUDA process, an NVML client and a job on another GPU hold
  open and which they map;
- fork: a CUDA process forks a helper and is SIGKILLed: what NVML lists, whether the memory stays,
  and how long the driver takes to free it once the helper is killed (the floor); and the same
  with a helper that closed its descriptors but kept the mappings.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pynvml

GIB = 1024**3
MIB = 1024**2

HOLDER = """
import os, sys, time, torch
mib = int(sys.argv[1]); mode = sys.argv[2]
x = torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
if mode in ("fork", "fork-close"):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        import ctypes
        ctypes.CDLL(None).prctl(15, b"helper", 0, 0, 0)
        if mode == "fork-close":
            os.closerange(3, 65536)
        else:
            os.close(r)
            os.write(w, b"x")
        while True:
            time.sleep(3600)
    print(pid, flush=True)
print("ready", flush=True)
while True:
    time.sleep(3600)
"""

NVML_CLIENT = """
import time, pynvml
pynvml.nvmlInit()
print("ready", flush=True)
while True:
    time.sleep(3600)
"""

RESPAWNER = """
import subprocess, sys
while True:
    subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2], "plain"],
                   stdout=subprocess.DEVNULL)
"""


def subreaper() -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER")


class Gpu:
    def __init__(self) -> None:
        pynvml.nvmlInit()
        self.n = pynvml.nvmlDeviceGetCount()
        self.h = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.n)]

    def used_mib(self, i: int = 0) -> int:
        return int(pynvml.nvmlDeviceGetMemoryInfo(self.h[i]).used) // MIB

    def listed(self, i: int = 0) -> list[int]:
        return [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self.h[i])]


def wait(cond: Callable[[], object], timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"probe: timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)
    return time.monotonic() - t0


def nv_files(pid: int) -> dict[str, list[str]]:
    fds = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith("/dev/nvidia"):
            fds.add(t)
    maps = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().startswith("/dev/nvidia"):
                maps.add(parts[5].strip())
    return {"open": sorted(fds), "mapped": sorted(maps)}


class Probe:
    def __init__(self) -> None:
        subreaper()
        self.gpu = Gpu()
        self.base = [self.gpu.used_mib(i) for i in range(self.gpu.n)]
        self.mine: list[subprocess.Popen[bytes]] = []

    def spawn(
        self, code: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.mine.append(p)
        return p

    def clean(self) -> bool:
        return all(self.gpu.used_mib(i) <= self.base[i] + 256 for i in range(self.gpu.n))

    def end_all(self) -> None:
        """SIGKILL what we started and every orphan reparented to us; wait for baseline."""
        kids = {p.pid for p in self.mine}
        task = Path(f"/proc/{os.getpid()}/task")
        for tid in os.listdir(task):
            with contextlib.suppress(OSError):
                kids |= {int(c) for c in (task / tid / "children").read_text().split()}
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in kids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.mine.clear()
        wait(self.clean, 60, "baseline after clean-up")

    def cuda_start(self, runs: int) -> list[dict[str, float]]:
        out = []
        for _ in range(runs):
            t0 = time.monotonic()
            p = self.spawn(HOLDER, "10240", "plain")
            wait(lambda pid=p.pid: pid in self.gpu.listed(), 60, "the child listed")
            t_listed = time.monotonic() - t0
            wait(lambda: self.gpu.used_mib() > self.base[0] + 9 * 1024, 60, "its memory")
            t_mem = time.monotonic() - t0
            t1 = time.monotonic()
            p.kill()
            p.wait()
            wait(self.clean, 60, "release")
            out.append(
                {
                    "listed_s": round(t_listed, 3),
                    "memory_s": round(t_mem, 3),
                    "free_after_sigkill_s": round(time.monotonic() - t1, 3),
                }
            )
        return out

    def respawn(self, runs: int) -> list[float]:
        parent = self.spawn(RESPAWNER, HOLDER, "10240")
        gaps = []
        seen: set[int] = set()
        for _ in range(runs):
            wait(lambda: set(self.gpu.listed()) - seen, 60, "a child listed")
            child = (set(self.gpu.listed()) - seen).pop()
            seen.add(child)
            wait(lambda: self.gpu.used_mib() > self.base[0] + 9 * 1024, 60, "its memory")
            t0 = time.monotonic()
            os.kill(child, signal.SIGKILL)
            wait(lambda: set(self.gpu.listed()) - seen, 60, "the next child listed")
            gaps.append(round(time.monotonic() - t0, 3))
        parent.kill()
        self.end_all()
        return gaps

    def files(self) -> dict[str, object]:
        res: dict[str, object] = {}
        p = self.spawn(HOLDER, "1024", "plain")
        assert p.stdout is not None
        p.stdout.readline()
        res["cuda_process_on_gpu0"] = nv_files(p.pid)
        m = self.spawn(NVML_CLIENT)
        assert m.stdout is not None
        m.stdout.readline()
        res["nvml_client"] = nv_files(m.pid)
        if self.gpu.n > 1:
            g = self.spawn(HOLDER, "1024", "plain", env={"CUDA_VISIBLE_DEVICES": "1"})
            assert g.stdout is not None
            g.stdout.readline()
            res["cuda_job_on_gpu1_only"] = nv_files(g.pid)
            res["gpu1_job_listed_on"] = [
                i for i in range(self.gpu.n) if g.pid in self.gpu.listed(i)
            ]
        self.end_all()
        return res

    def fork(self, mode: str) -> dict[str, object]:
        p = self.spawn(HOLDER, "40960", mode)
        assert p.stdout is not None
        helper = int(p.stdout.readline())
        p.stdout.readline()
        res: dict[str, object] = {"helper_files_before": nv_files(helper)}
        used_before = self.gpu.used_mib()
        p.kill()
        p.wait()
        t0 = time.monotonic()
        freed = False
        while time.monotonic() - t0 < 3:
            if self.gpu.used_mib() <= self.base[0] + 256:
                freed = True
                break
            time.sleep(0.005)
        res.update(
            {
                "used_with_parent_mib": used_before,
                "parent_pid": p.pid,
                "freed_within_3s_of_parent_sigkill": freed,
                "freed_after_s": round(time.monotonic() - t0, 3) if freed else None,
                "listed_after_parent_death": self.gpu.listed(),
                "used_after_parent_death_mib": self.gpu.used_mib(),
                "helper_files_after": nv_files(helper),
            }
        )
        if not freed:
            t1 = time.monotonic()
            os.kill(helper, signal.SIGKILL)
            wait(self.clean, 60, "release after the helper's SIGKILL")
            res["floor_helper_sigkill_to_baseline_s"] = round(time.monotonic() - t1, 3)
        self.end_all()
        return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    pr = Probe()
    result: dict[str, object] = {
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "gpus": pr.gpu.n,
        "baseline_mib": pr.base,
    }
    try:
        result["device_files"] = pr.files()
        result["fork_helper"] = pr.fork("fork")
        result["fork_helper_closed_fds"] = pr.fork("fork-close")
        result["cuda_start"] = pr.cuda_start(args.runs)
        result["respawn_gap_s"] = pr.respawn(args.runs)
    finally:
        pr.end_all()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
