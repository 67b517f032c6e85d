"""A simulated GPU host that owns memory the way the NVIDIA driver does, as measured.

Layout of the host's directory:
  host.json            devices (index, total, baseline), release delay, driver version
  dev/nvidiaN          stand-ins for /dev/nvidiaN; dev/nvidiactl, dev/nvidia-uvm (one page each,
                       so that they can be mapped), each stamped with the host and its device
                       number (195:N, 195:255 for nvidiactl, as the driver numbers them)
  driver/N             GPU N's side in the driver: its contexts' locks
  alloc/PID.KEY        one context: creator's identity, device, MiB, listed or hidden, its key
  released/...         when a context was first seen closed (for the release delay)
  last_sample          when a reader last looked (monotonic seconds)
  leak/N.M             memory held with no process at all (a driver leak)

The rules, each copying a measurement on 2x H200, driver 580.159.04
(`bench/results/h200x2-2026-11-30-cuda-probe.json`, made by `bench/cuda_probe.py`):

1. Memory belongs to an open device file (the context), not to a PID. A context is an open file
   description of dev/nvidiaN that holds an OFD byte-range lock at its own KEY; memory counts while
   that lock exists, that is while any process still has that open file. Measured: a CUDA
   process with 42,101 MiB used forked a helper and was SIGKILLed; the memory stayed at 42,101
   MiB as long as the helper lived, and went back to 615 MiB 0.163 s after the helper's SIGKILL.
2. A fork shares the context (it inherits the open file, so the lock). It is freed when the last
   process holding it exits or closes it.
3. NVML lists the PID that created the context for as long as the context exists, even after
   that PID died. Measured: `listed_after_parent_death` is the dead parent's PID; the helper is
   listed nowhere.
4. A CUDA process opens every device file, nvidiactl and nvidia-uvm, and maps the device files
   of the GPUs it can see, nvidiactl and nvidia-uvm. Measured: a process using GPU 0 with every
   GPU visible mapped /dev/nvidia0 and /dev/nvidia1; one with CUDA_VISIBLE_DEVICES=1 opened
   both but mapped only /dev/nvidia1. Its forked helper mapped the device files and nvidiactl but
   not nvidia-uvm (here: the uvm mapping is MADV_DONTFORK).
5. An NVML client opens every device file and maps none (`nvml_client`: 6 files open, 0 mapped).
6. A process that closed its descriptors but keeps its mappings holds no memory. Measured: the
   forked helper closed every descriptor, its parent was SIGKILLed, and the memory came back at
   once although the helper still mapped /dev/nvidia0. Here the mappings are made from
   descriptors other than the context's, so they do not keep the context's open file alive.
7. The driver frees a context's memory `release_delay_s` after its last holder is gone, and NVML
   lists the creator until then. Measured: 0.150-0.158 s from SIGKILL to NVML at baseline
   (`cuda_start`), 0.163 s for the helper; DRIVER_RELEASE_S is the default. On the real host
   that time is the holder's own exit (the driver tears the context down as the process exits,
   so memory is back by the time it is reaped: `fork_helper_closed_fds`); a simulated holder
   exits at once, so the delay runs after it, counted from the last look (by any reader) before
   the context was seen closed. Seen through NVML the two read the same, for a reader that polls
   and for one that looks once, long after.
8. The driver knows a node by its device number, not its path or inode. A container's own /dev
   (Docker's or podman's with the NVIDIA toolkit, systemd-nspawn's, a chroot's) holds other
   inodes with the same numbers, and a process that opens one reaches the same GPU. Measured
   (an H200): a process in its own mount namespace with fresh nodes (mknod 195:0)
   held a dead parent's 40 GiB, which NVML showed; its maps named the container's node, by the
   container's file system and inode. Here a node is a stamped page at any inode; a context,
   made through any node, is a lock on the GPU's driver file; `owndev.py` builds such a /dev.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kimi_supervisor.ports import processes
from kimi_supervisor.ports.gpu import GpuUnavailable
from kimi_supervisor.sandbox.simreader import (
    ACTIVITY,
    F_OFD_SETLK,
    FLOCK,
    NODE_MAGIC,
    PAGE,
    driver_file,
    read_stamp,
)
from kimi_supervisor.sandbox.simreader import (
    SimGpu as SimGpu,  # the reader, for the sandbox's users
)
from kimi_supervisor.sandbox.simreader import device_file as device_file
from kimi_supervisor.sandbox.simreader import hold_files as hold_files
from kimi_supervisor.sandbox.simreader import shared_files as shared_files

H200_TOTAL_MIB = 143771
H200_BASELINE_MIB = 615
# Rule 7: SIGKILL to NVML at baseline on an H200 (bench/results/h200x2-2026-11-30-cuda-probe.json).
DRIVER_RELEASE_S = 0.15
# The NVIDIA driver's character major for /dev/nvidiaN and nvidiactl (minor 255); nvidia-uvm's
# major is given out at load time, so any free one stands for it.
NVIDIA_MAJOR = 195
UVM_NUMBER = "509:0"


def create_host(
    root: Path,
    gpus: int,
    total_mib: int = H200_TOTAL_MIB,
    *,
    baseline_mib: int = H200_BASELINE_MIB,
    release_delay_s: float = DRIVER_RELEASE_S,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("dev", "driver", "alloc", "released", "leak", ACTIVITY):
        (root / sub).mkdir(exist_ok=True)
    host_id = secrets.token_hex(8)
    numbers = {f"nvidia{i}": f"{NVIDIA_MAJOR}:{i}" for i in range(gpus)}
    numbers |= {"nvidiactl": f"{NVIDIA_MAJOR}:255", "nvidia-uvm": UVM_NUMBER}
    for name, number in numbers.items():
        stamp = NODE_MAGIC + f"{host_id} {number}\n".encode()
        (root / "dev" / name).write_bytes(stamp.ljust(PAGE, b"\0"))
    for i in range(gpus):
        driver_file(root, i).write_bytes(b"")
    host = {
        "host_id": host_id,
        "devices": [
            {
                "index": i,
                "total_mib": total_mib,
                "baseline_mib": baseline_mib,
                "uuid": f"GPU-sim-{i:04d}",
                "name": "Simulated NVIDIA H200",
            }
            for i in range(gpus)
        ],
        "release_delay_s": release_delay_s,
        "driver_version": "sim-580.159",
    }
    _write_json(root / "host.json", host)
    return root


def set_release_delay(root: Path, seconds: float) -> None:
    host = json.loads((root / "host.json").read_text())
    host["release_delay_s"] = seconds
    _write_json(root / "host.json", host)


def set_health(root: Path, index: int, **signals: object) -> None:
    """GPU `index`'s health signals as the driver would report a failing one
    (`remap_pending=True`, `xids=[79]`, `ecc_uncorrected=2`); none: healthy again."""
    path = root / "health.json"
    try:
        health = json.loads(path.read_text())
    except FileNotFoundError:
        health = {}
    if signals:
        health[str(index)] = signals
    else:
        health.pop(str(index), None)
    _write_json(path, health)


def set_activity(root: Path, indices: Sequence[int], state: str, *, pid: int = 0) -> None:
    """What GPUs `indices` run now, as the fake engine says it: "work" (a step: read as work
    for simreader.WORK_HOLD_S), "spin" (a kernel spinning on a flag never set, until said
    otherwise) or "idle"; `pid`: the one process it is (a ghost's kernel: NVML samples only it
    so), 0: every process on the GPU (the fake engine's workers). Best effort: a fake engine
    that may not write there (vLLM's user on a booted host whose sim folder is root's) steps
    all the same, its GPUs read idle."""
    try:
        (root / ACTIVITY).mkdir(exist_ok=True)
        for i in indices:
            _write_json(root / ACTIVITY / str(i),
                        {"state": state, "at": time.monotonic(), "pid": pid})  # fmt: skip
    except OSError:
        pass


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _device_indices(root: Path) -> list[int]:
    return sorted(
        int(p.name.removeprefix("nvidia"))
        for p in (root / "dev").iterdir()
        if p.name.removeprefix("nvidia").isdigit()
    )


def _lock(fd: int, key: int) -> None:
    fcntl.fcntl(fd, F_OFD_SETLK, struct.pack(FLOCK, fcntl.F_WRLCK, os.SEEK_SET, key, 1, 0))


class Runtime:
    """What a CUDA process holds besides its contexts (rule 4): every device file, nvidiactl and
    nvidia-uvm open; the visible GPUs' device files, nvidiactl and nvidia-uvm mapped."""

    def __init__(self, root: Path, visible: Sequence[int] | None = None) -> None:
        everything = [device_file(root, i) for i in _device_indices(root)] + shared_files(root)
        self.fds = hold_files(everything)
        seen = _device_indices(root) if visible is None else list(visible)
        ctl, uvm = shared_files(root)
        self.maps: list[mmap.mmap] = []
        for path in [device_file(root, i) for i in seen] + [ctl, uvm]:
            fd = os.open(path, os.O_RDWR)
            try:
                m = mmap.mmap(fd, PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)  # the mapping stays; it keeps no context alive (rule 6)
            if path == uvm:
                m.madvise(mmap.MADV_DONTFORK)  # a forked helper does not map nvidia-uvm
            self.maps.append(m)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        for m in self.maps:
            m.close()
        self.fds, self.maps = [], []


def visible_devices(root: Path) -> list[int]:
    """The GPUs a CUDA process sees: CUDA_VISIBLE_DEVICES (physical indices here), else all."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return _device_indices(root)
    return [int(x) for x in spec.split(",") if x.strip().isdigit()]


class Context:
    """Memory on one simulated GPU, owned by an open file of its device file (rules 1-3)."""

    def __init__(self, root: Path, index: int, mib: int, *, hidden: bool = False) -> None:
        path = device_file(root, index)
        if not path.exists():
            raise GpuUnavailable(f"simulated GPU {index} does not exist under {root}")
        # The node as this process sees it (its own /dev's, maybe), and through it the GPU its
        # number names (rule 8).
        self.node = os.open(path, os.O_RDWR)
        stamp = read_stamp(self.node)
        if stamp is None or not stamp[1].startswith(f"{NVIDIA_MAJOR}:"):
            os.close(self.node)
            raise GpuUnavailable(f"{path} is not a simulated GPU's device node")
        index = int(stamp[1].split(":")[1])
        self.fd = os.open(driver_file(root, index), os.O_RDWR)
        key = secrets.randbits(40) + 1
        _lock(self.fd, key)  # before the record: a reader never sees a record without its lock
        ref = processes.ref_of(os.getpid())
        assert ref is not None
        self.record = root / "alloc" / f"{ref.pid}.{key}"
        _write_json(
            self.record,
            {
                "pid": ref.pid,
                "start_ticks": ref.start_ticks,
                "device": index,
                "mib": mib,
                "hidden": hidden,
                "key": key,
            },
        )

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.record.unlink()
        os.close(self.fd)
        os.close(self.node)


def leak(root: Path, index: int, mib: int) -> Path:
    """Memory that stays used with no process behind it."""
    path = root / "leak" / f"{index}.{time.monotonic_ns()}"
    _write_json(path, {"device": index, "mib": mib})
    return path
