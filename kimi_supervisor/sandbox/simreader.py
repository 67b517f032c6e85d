"""The GPU port over a simulated GPU host: a directory that `sandbox/simgpu.py` makes
and its fake processes fill, read here the way NVML reads the driver.

The layout and the rules it follows (each copying a measurement on H200s) are in the sandbox
module's docstring. What this reader relies on: a context is a record in alloc/ plus an OFD lock
at the record's key on the GPU's driver file (driver/N), held for as long as some process has the
context's open file; memory counts while the lock exists, and for `release_delay_s` after
(counted from the last look by any reader); NVML's list is each live context's creator. Like an
NVML client, the reader opens every device file and maps none. A device node is known by the
stamp it carries (its host and device number), as the driver knows a node by its device number:
`node_key`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_supervisor.model import GpuActivity, GpuHealth
from kimi_supervisor.ports.gpu import DeviceSample, GpuProcess, GpuUnavailable

# struct flock: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (+ padding)
FLOCK = "hhqqi4x"
F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
PAGE = 4096
HANG = "nvml_hang"  # in the sim folder: the driver answers no call while it exists
# In the sim folder: a GPU's health signals that differ from a healthy H200's, by index
# ({"3": {"remap_pending": true, "xids": [63]}}; simgpu.set_health writes it).
HEALTH = "health.json"
# A healthy H200 as driver 580.159.04 answers (bench/results/h200x1-2026-12-04-gpu-health.txt): rows
# remapping supported and clean, page retirement not supported (row remapping replaced it),
# no uncorrected ECC error, no Xid in the kernel's log. NVLink as the lent host has it: none.
H200_UNREAD = ("page retirement: not supported by this GPU",)
# The fabric of one simulated GPU: an H200 SXM of an HGX board as NVIDIA's H200 datasheet gives
# it (PCIe Gen5 x16, "NVLink 900 GB/s": 18 NVLink 4 links of 25 GB/s per direction each).
# `fabric.json` in the sim folder replaces any of it per index ({"0": {"nvlink": {"links": 0,
# "active": 0, "version": null}}}: a PCIe card). bench/fabric_probe.py reads a real host's.
SXM_FABRIC: dict[str, Any] = {
    "name": "NVIDIA H200",
    "pcie": {"gen": 5, "width": 16, "max_gen": 5, "max_width": 16},
    "nvlink": {"links": 18, "active": 18, "version": 4},
    "unread": [],
}

# In the sim folder: what each GPU runs (activity/N: {"state": "work" or "spin", "at": the
# monotonic clock}), written by the fake engine (simgpu.set_activity). Work read more than
# WORK_HOLD_S ago is over: the GPU reads idle again.
ACTIVITY = "activity"
WORK_HOLD_S = 1.0
# The counters NVML reads for each, as measured on an H100 80GB HBM3, driver 580.159.04 (NVML
# every 0.2 s, medians: bench/gpu_hang_signature.py, bench/results/h100x1-2026-12-07-gpu-hang-
# signature*.json): "idle" a context and nothing run; "spin" a kernel polling a flag in mapped
# host memory that is never set (a stuck collective on a PCIe host: busy, no memory traffic, the
# idle power, and its polls' PCIe traffic, the most a spin was seen to move); "work" the
# decode-like loop (GEMMs and all-reduce-sized copies). PCIe is sent and received together
# (NVML's KB/s over 1000).
COUNTERS: dict[str, dict[str, float]] = {
    "idle": {"util_gpu": 0.0, "util_memory": 0.0, "power_w": 124.2, "sm_clock_mhz": 1980.0,
             "pcie_mb_s": 1.1},
    "spin": {"util_gpu": 100.0, "util_memory": 0.0, "power_w": 118.5, "sm_clock_mhz": 1980.0,
             "pcie_mb_s": 59.4},
    "work": {"util_gpu": 88.0, "util_memory": 80.0, "power_w": 421.4, "sm_clock_mhz": 1980.0,
             "pcie_mb_s": 198.7},
}  # fmt: skip


def device_file(root: Path, index: int) -> Path:
    return root / "dev" / f"nvidia{index}"


def shared_files(root: Path) -> list[Path]:
    return [root / "dev" / "nvidiactl", root / "dev" / "nvidia-uvm"]


def driver_file(root: Path, index: int) -> Path:
    """Where GPU `index`'s contexts live (the driver's side, reached through any node of it)."""
    return root / "driver" / str(index)


# A simulated node's first bytes: b"kimi-sim-node HOST MAJOR:MINOR\n", the rest of its page zero.
NODE_MAGIC = b"kimi-sim-node "
NODE_STAMP_MAX = 128


def read_stamp(fd: int) -> tuple[str, str] | None:
    """(host, "major:minor") of the simulated node open at `fd`, or None if it is not one."""
    head = os.pread(fd, NODE_STAMP_MAX, 0)
    if not head.startswith(NODE_MAGIC) or b"\n" not in head:
        return None
    fields = head[len(NODE_MAGIC) : head.index(b"\n")].decode(errors="replace").split()
    return (fields[0], fields[1]) if len(fields) == 2 else None


def node_stamp(path: Path, expect: os.stat_result | None = None) -> tuple[str, str] | None:
    """The stamp of the node at `path` (that very inode, if `expect` is given), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if expect is not None and (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino):
            return None
        return read_stamp(fd) if stat.S_ISREG(st.st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _locked(fd: int, key: int) -> bool:
    """Whether another open file description holds the lock at `key` (rules 1-2)."""
    probe = struct.pack(FLOCK, fcntl.F_WRLCK, os.SEEK_SET, key, 1, 0)
    l_type = struct.unpack(FLOCK, fcntl.fcntl(fd, F_OFD_GETLK, probe))[0]
    return bool(l_type != fcntl.F_UNLCK)


def hold_files(paths: Sequence[Path]) -> list[int]:
    """Open device files without allocating, as nvidia-persistenced or an NVML client does."""
    return [os.open(p, os.O_RDWR) for p in paths]


@dataclass(frozen=True)
class _Device:
    index: int
    total_mib: int
    baseline_mib: int


class SimGpu:
    """GpuPort over a simulated host directory."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self._loaded: list[_Device] | None = None
        self._driver = "sim"
        self._delay, self._delay_mtime = 0.0, -1
        self._held: list[int] = []
        self._device_fd: dict[int, int] = {}

    @property
    def _devices(self) -> list[_Device]:
        """Opened on first use, as NVML is: a host that is not there yet (the driver not loaded)
        is GpuUnavailable then, and found once it appears."""
        if self._loaded is not None:
            return self._loaded
        try:
            host = json.loads((self.root / "host.json").read_text())
        except (OSError, ValueError) as e:
            raise GpuUnavailable(
                f"no simulated GPU host at {self.root} ({e}): create it with "
                "`kimi-supervisor sandbox up`"
            ) from e
        devices = [_Device(d["index"], d["total_mib"], d["baseline_mib"]) for d in host["devices"]]
        self._driver = str(host.get("driver_version", "sim"))
        # Like an NVML client (rule 5), keep every device file open, mapping none.
        self._held = hold_files(
            [device_file(self.root, d.index) for d in devices] + shared_files(self.root)
        )
        # The contexts are probed on the driver's side, as NVML asks the driver, not a node.
        self._device_fd = {
            d.index: os.open(driver_file(self.root, d.index), os.O_RDONLY | os.O_CLOEXEC)
            for d in devices
        }
        self._loaded = devices
        return devices

    def _release_delay(self) -> float:
        # Re-read only when host.json changed (tests change the delay at run time); a teardown
        # samples every 10 ms and should not parse it each time.
        path = self.root / "host.json"
        try:
            mtime = path.stat().st_mtime_ns
            if mtime != self._delay_mtime:
                self._delay = float(json.loads(path.read_text())["release_delay_s"])
                self._delay_mtime = mtime
        except (OSError, ValueError, KeyError):
            return 0.0
        return self._delay

    def _answer(self) -> None:
        """A driver that does not answer: while the sim folder holds `nvml_hang`, every call
        waits, as NVML's calls do in a hung driver (nvidia-smi in state D after an Xid 45 or 79:
        NVIDIA/gpu-monitoring-tools#46, leptonai/gpud#117, NVIDIA/NVSentinel#1576). Not seen
        on the H200s here; no call of NVML takes a timeout."""
        while (self.root / HANG).exists():
            time.sleep(0.02)

    def device_count(self) -> int:
        self._answer()
        return len(self._devices)

    def _device(self, index: int) -> _Device:
        for d in self._devices:
            if d.index == index:
                return d
        raise GpuUnavailable(
            f"GPU {index} does not exist: the simulated host has {len(self._devices)} GPU(s)"
        )

    def sample(self, indices: Sequence[int]) -> list[DeviceSample]:
        self._answer()
        devices = [self._device(i) for i in indices]
        used = {d.index: d.baseline_mib for d in devices}
        listed: dict[int, dict[int, int]] = {d.index: {} for d in devices}
        delay = self._release_delay()
        now = time.monotonic()
        # A context found closed was closed after the last look by any reader: count its delay
        # from then, so that a reader that looks rarely sees what the driver would show by now.
        previous = _read_time(self.root / "last_sample", now)
        _write_time(self.root / "last_sample", now)
        for entry in os.scandir(self.root / "alloc"):
            rec = _read(entry.path)
            if rec is None or rec.get("device") not in used or "key" not in rec:
                continue
            dev = rec["device"]
            if _locked(self._device_fd[dev], rec["key"]):
                used[dev] += rec["mib"]
                if not rec["hidden"]:  # rule 3: the creator, alive or not
                    listed[dev][rec["pid"]] = listed[dev].get(rec["pid"], 0) + rec["mib"]
                continue
            # The context's last holder is gone: the driver frees it after the delay (rule 7).
            marker = self.root / "released" / entry.name
            if now - _released_at(marker, previous) < delay:
                used[dev] += rec["mib"]
                if not rec["hidden"]:
                    listed[dev][rec["pid"]] = listed[dev].get(rec["pid"], 0) + rec["mib"]
            else:
                for p in (Path(entry.path), marker):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
        for entry in os.scandir(self.root / "leak"):
            rec = _read(entry.path)
            if rec is not None and rec["device"] in used:
                used[rec["device"]] += rec["mib"]
        return [
            DeviceSample(
                d.index,
                min(used[d.index], d.total_mib),
                d.total_mib,
                tuple(GpuProcess(pid, mib) for pid, mib in sorted(listed[d.index].items())),
            )
            for d in devices
        ]

    def health(self, indices: Sequence[int]) -> list[GpuHealth]:
        """A healthy H200's answer, with what `health.json` changes for a GPU (a test's failing
        one). A field set to null there is one the GPU cannot say (named in `unread`)."""
        self._answer()
        try:
            changed = json.loads((self.root / HEALTH).read_text())
        except FileNotFoundError:
            changed = {}
        except (OSError, ValueError) as e:
            raise GpuUnavailable(f"the simulated host's {HEALTH} cannot be read: {e}") from e
        out = []
        for index in indices:
            try:  # as NvmlGpu.health: a GPU not found hides none of the others' health
                self._device(index)
            except GpuUnavailable as e:
                out.append(GpuHealth(index, unread=(f"the GPU: {e}",)))
                continue
            fields: dict[str, object] = {
                "remap_pending": False, "remap_failed": False, "retired_pending": None,
                "ecc_uncorrected": 0, "nvlink_errors": None, "xids": (),
                "unread": H200_UNREAD,
            }  # fmt: skip
            fields.update(changed.get(str(index), {}))
            if isinstance(fields["xids"], list):
                fields["xids"] = tuple(fields["xids"])
            if isinstance(fields["unread"], list):
                fields["unread"] = tuple(fields["unread"])
            out.append(GpuHealth(index, **fields))  # type: ignore[arg-type]
        return out

    def fabric(self, indices: Sequence[int] | None = None) -> dict[str, Any]:
        """NvmlGpu.fabric's answer: each device an SXM GPU's (SXM_FABRIC), with what the sim
        folder's fabric.json changes for it ({"0": {"nvlink": {...}}})."""
        try:
            self._answer()
            devices = self._devices
        except GpuUnavailable as e:
            return {"source": "NVML at capture time", "gpus": [], "error": str(e)}
        try:
            changed = json.loads((self.root / "fabric.json").read_text())
        except (OSError, ValueError):
            changed = {}
        gpus: list[dict[str, Any]] = []
        for index in [d.index for d in devices] if indices is None else indices:
            try:
                self._device(index)
            except GpuUnavailable as e:
                gpus.append({"index": index, "unread": [str(e)]})
                continue
            gpus.append({"index": index, **SXM_FABRIC, **changed.get(str(index), {})})
        return {"source": "NVML at capture time", "gpus": gpus}

    def activity(self, indices: Sequence[int]) -> list[GpuActivity]:
        """Each GPU's counters as NVML reads them for what it runs (COUNTERS): what the fake
        engine last wrote to activity/N, idle once work is WORK_HOLD_S old; and the processes
        `sample` lists on it (a ghost's among them, unless hidden), as NVML lists them. The
        simulated host has no NVLink (as the lent H200s: none)."""
        self._answer()
        now = time.monotonic()
        out = []
        known = [i for i in indices if any(d.index == i for d in self._devices)]
        listed: dict[int, tuple[int, ...] | None] = dict.fromkeys(known)
        unread: tuple[str, ...] = ()
        try:
            listed |= {d.index: tuple(p.pid for p in d.processes) for d in self.sample(known)}
        except (GpuUnavailable, OSError) as e:  # as NVML's: the list unread, the counters read
            unread = (f"processes: {e}",)
        for index in indices:
            try:
                self._device(index)
            except GpuUnavailable as e:
                out.append(GpuActivity(index, unread=(f"the GPU: {e}",)))
                continue
            try:
                seen = json.loads((self.root / ACTIVITY / str(index)).read_text())
                state, at, whose = str(seen["state"]), float(seen["at"]), int(seen.get("pid", 0))
            except (OSError, ValueError, KeyError, TypeError):
                state, at, whose = "idle", now, 0
            if state not in COUNTERS or (state == "work" and now - at > WORK_HOLD_S):
                state = "idle"
            counters = COUNTERS[state]
            pids = listed[index]
            # NVML samples each process that lives: each listed one reads the GPU's state, or,
            # where the state is one process's (a ghost's kernel), that one alone, the rest idle.
            samples = tuple(
                (p, *((counters["util_gpu"], counters["util_memory"]) if whose in (0, p)
                      else (0.0, 0.0)))
                for p in pids or ()
            )  # fmt: skip
            out.append(GpuActivity(index, **counters, pids=pids, samples=samples, unread=unread))  # type: ignore[arg-type]
        return out

    def device_path(self, index: int) -> str:
        self._answer()
        return str(device_file(self.root, self._device(index).index))

    def uuid(self, index: int) -> str:
        """As NVML names one (`GPU-` and a UUID), stable per simulated device."""
        self._answer()
        self._device(index)
        return f"GPU-5e1f0000-0000-4000-8000-{index:012d}"

    def driver_version(self) -> str:
        self._answer()
        self._devices  # noqa: B018 - loads the host
        return self._driver

    def baseline_of(self, index: int) -> int:
        return self._device(index).baseline_mib

    def node_key(self, path: str, st: os.stat_result) -> tuple[object, ...] | None:
        """A simulated node is known by its stamp (host and device number), at any inode: a
        container's own /dev holds copies (fresh nodes with the same numbers reach the
        same GPU, measured on an H200). Only a one-page regular file is read."""
        if not stat.S_ISREG(st.st_mode) or st.st_size != PAGE:
            return None
        stamp = node_stamp(Path(path), st)
        return ("sim-node", *stamp) if stamp is not None else None

    def close(self) -> None:
        self._loaded = None
        for fd in [*self._held, *self._device_fd.values()]:
            os.close(fd)
        self._held, self._device_fd = [], {}


def _read(path: str) -> dict[str, int] | None:
    try:
        data: dict[str, int] = json.loads(Path(path).read_text())
        return data
    except (OSError, ValueError):
        return None  # removed or being replaced: the next sample sees it


def _read_time(path: Path, default: float) -> float:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return default


def _write_time(path: Path, t: float) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(repr(t))
    os.replace(tmp, path)


def _released_at(marker: Path, now: float) -> float:
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        try:
            return float(marker.read_text() or now)
        except (OSError, ValueError):
            return now
    with os.fdopen(fd, "w") as f:
        f.write(repr(now))
    return now
