"""On the GPU host: what the page cache saves a load, and what an armed torch profiler costs, at
the level vLLM uses them (torch alone; vLLM does not install there).

1. Weights to the GPU: a file of `--gb` GB read in 64 MiB chunks into pinned memory and copied
   to the GPU, once with the file evicted from the page cache (posix_fadvise DONTNEED on that
   file alone), once after a warming read (what kimi-supervisor's warming does before a
   switch's teardown).
2. The armed profiler: a decode-like loop of small kernels (launch-bound, as a decode step is)
   timed plain, with a torch.profiler.profile(CPU, CUDA) constructed and not started (what
   vLLM 0.16's worker holds when started with --profiler-config), and after one start/stop of
   it (kineto initialized, as after a capture); rounds alternate.

    python bench/gpu_warm_probe.py --dir /var/tmp --gb 16 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

CHUNK = 64 << 20


def make_file(path: Path, gb: float) -> int:
    n = int(gb * 1e9) // CHUNK * CHUNK
    block = os.urandom(CHUNK)
    with open(path, "wb") as f:
        for _ in range(n // CHUNK):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return n


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def to_gpu(path: Path) -> float:
    import torch

    pinned = torch.empty(CHUNK, dtype=torch.uint8).pin_memory()
    view = memoryview(pinned.numpy())
    dev = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
    t0 = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while (n := f.readinto(view)) > 0:
            dev[:n].copy_(pinned[:n], non_blocking=False)
    torch.cuda.synchronize()
    return time.monotonic() - t0


def warm_read(path: Path) -> float:
    buf = bytearray(CHUNK)
    t0 = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf) > 0:
            pass
    return time.monotonic() - t0


def decode_loop(steps: int) -> float:
    import torch

    x = torch.randn(8, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(7168, 7168, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.monotonic()
    for _ in range(steps):
        for _ in range(60):  # a step of ~60 layers' worth of small launches
            y = x @ w
            y = torch.nn.functional.silu(y)
            x = (y * 0.001).to(torch.bfloat16)
    torch.cuda.synchronize()
    return time.monotonic() - t0


def profiler_cost(rounds: int, steps: int) -> dict[str, list[float]]:
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    out: dict[str, list[float]] = {"plain": [], "armed": [], "after_capture": []}
    decode_loop(20)  # warm-up
    armed = None
    for _ in range(rounds):
        out["plain"].append(decode_loop(steps))
        armed = torch.profiler.profile(activities=acts)
        out["armed"].append(decode_loop(steps))
        armed.start()
        decode_loop(2)
        armed.stop()
        out["after_capture"].append(decode_loop(steps))
        del armed
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    p.add_argument("--gb", type=float, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    import torch

    res: dict[str, object] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    path = a.dir / f"kimi-warm-probe-{os.getpid()}.bin"
    try:
        t0 = time.monotonic()
        res["file_bytes"] = make_file(path, a.gb)
        res["write_s"] = round(time.monotonic() - t0, 2)
        cold, warm, warming = [], [], []
        for _ in range(2):
            evict(path)
            cold.append(round(to_gpu(path), 2))
            evict(path)
            warming.append(round(warm_read(path), 2))
            warm.append(round(to_gpu(path), 2))
        res |= {"cold_to_gpu_s": cold, "warming_read_s": warming, "warm_to_gpu_s": warm}
    finally:
        path.unlink(missing_ok=True)
    costs = profiler_cost(a.rounds, a.steps)
    res["profiler_loop_s"] = {k: [round(x, 4) for x in v] for k, v in costs.items()}
    plain = statistics.mean(costs["plain"])
    res["profiler_cost"] = {
        k: round((statistics.mean(v) - plain) / plain, 4) for k, v in costs.items()
    }
    res["profiler_noise"] = round(
        max((max(v) - min(v)) / statistics.mean(v) for v in costs.values()), 4
    )
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
