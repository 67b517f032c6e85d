"""Holding GPU memory for the sandbox's fakes: simulated, or real CUDA through torch.

Used by the fake vLLM's workers and by ghosts. The backend comes from the environment:
KIMI_FAKE_CUDA=1 for real CUDA, else KIMI_SIM_GPU_DIR names the simulated host.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kimi_supervisor.sandbox import simgpu


def real_cuda() -> bool:
    return os.environ.get("KIMI_FAKE_CUDA", "") == "1"


def sim_dir() -> Path:
    d = os.environ.get("KIMI_SIM_GPU_DIR", "")
    if not d:
        raise SystemExit("KIMI_SIM_GPU_DIR is not set and KIMI_FAKE_CUDA is not 1: no GPU to use")
    return Path(d)


class Holding:
    """What a process holds; released when the process exits (or by `release`)."""

    def __init__(self) -> None:
        self.sim: list[simgpu.Context] = []
        self.runtime: simgpu.Runtime | None = None
        self.fds: list[int] = []
        self.tensors: list[Any] = []

    def release(self) -> None:
        for a in self.sim:
            a.free()
        for fd in self.fds:
            os.close(fd)
        if self.runtime is not None:
            self.runtime.close()
        self.tensors.clear()
        self.sim, self.fds, self.runtime = [], [], None


def hold(devices: Sequence[int], mib: int, hidden: bool = False) -> Holding:
    """Take `mib` MiB on each device (0: only open the device files, as an NVML client does)."""
    h = Holding()
    if real_cuda():
        if mib == 0:
            import pynvml

            pynvml.nvmlInit()  # opens /dev/nvidia*, nvidiactl and nvidia-uvm, allocates nothing
            return h
        import torch

        for d in devices:
            h.tensors.append(torch.empty(mib * 1024 * 1024, dtype=torch.uint8, device=f"cuda:{d}"))
            torch.cuda.synchronize(d)
        return h
    root = sim_dir()
    if mib == 0:
        paths = [simgpu.device_file(root, d) for d in devices] + simgpu.shared_files(root)
        h.fds = simgpu.hold_files(paths)
        return h
    # As a CUDA process does: every device file open, the visible ones mapped, then a context on
    # each device used (simgpu's rules 1-4).
    h.runtime = simgpu.Runtime(root, simgpu.visible_devices(root))
    h.sim = [simgpu.Context(root, d, mib, hidden=hidden) for d in devices]
    return h
