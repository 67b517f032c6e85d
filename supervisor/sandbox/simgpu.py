"""A simulated GPU host that behaves like the driver where the supervisor can tell.

Layout of the host's directory:
  host.json            devices (index, total, baseline), release delay, driver version
  dev/nvidiaN          stand-ins for /dev/nvidiaN; dev/nvidiactl, dev/nvidia-uvm
  alloc/PID.TICKS.N    one allocation: process identity, device, MiB, hidden from lists or not
  released/...         when an allocation's holder was first seen gone (for the release delay)
  leak/N.M             memory held with no process at all (a driver leak)

Memory a process allocated counts only while that process is alive (not a zombie) and still
holds the device file open, as with the real driver, which frees memory when the last
descriptor of a dying process closes; `release_delay_s` adds the driver's lag. Readers open
every device file, as an NVML client does, so descriptor scans find them too.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.ports import processes
from supervisor.ports.gpu import DeviceSample, GpuProcess, GpuUnavailable

H200_TOTAL_MIB = 143771
H200_BASELINE_MIB = 615


def create_host(
    root: Path,
    gpus: int,
    total_mib: int = H200_TOTAL_MIB,
    baseline_mib: int = H200_BASELINE_MIB,
    release_delay_s: float = 0.0,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("dev", "alloc", "released", "leak"):
        (root / sub).mkdir(exist_ok=True)
    for name in [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl", "nvidia-uvm"]:
        (root / "dev" / name).touch()
    host = {
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


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def device_file(root: Path, index: int) -> Path:
    return root / "dev" / f"nvidia{index}"


def shared_files(root: Path) -> list[Path]:
    return [root / "dev" / "nvidiactl", root / "dev" / "nvidia-uvm"]


class Allocation:
    """Memory held by this process on one simulated device, like a CUDA context with buffers.

    It lasts while this process lives and keeps the device file open: closing the descriptor or
    dying frees it (after the host's release delay)."""

    def __init__(self, root: Path, index: int, mib: int, hidden: bool = False) -> None:
        path = device_file(root, index)
        if not path.exists():
            raise GpuUnavailable(f"simulated GPU {index} does not exist under {root}")
        self.fd = os.open(path, os.O_RDWR)
        ref = processes.ref_of(os.getpid())
        assert ref is not None
        self.record = root / "alloc" / f"{ref.pid}.{ref.start_ticks}.{index}"
        _write_json(
            self.record,
            {
                "pid": ref.pid,
                "start_ticks": ref.start_ticks,
                "device": index,
                "mib": mib,
                "hidden": hidden,
            },
        )

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.record.unlink()
        os.close(self.fd)


def hold_files(paths: Sequence[Path]) -> list[int]:
    """Open device files without allocating, as nvidia-persistenced or an NVML client does."""
    return [os.open(p, os.O_RDWR) for p in paths]


def leak(root: Path, index: int, mib: int) -> Path:
    """Memory that stays used with no process behind it."""
    path = root / "leak" / f"{index}.{time.monotonic_ns()}"
    _write_json(path, {"device": index, "mib": mib})
    return path


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
        # Like an NVML client, keep every device file open while we are a client.
        self._held = hold_files(
            [device_file(self.root, d.index) for d in devices] + shared_files(self.root)
        )
        self._loaded = devices
        return devices

    def _release_delay(self) -> float:
        # Re-read only when host.json changed (tests change the delay at run time); a teardown
        # samples every 20 ms and should not parse it each time.
        path = self.root / "host.json"
        try:
            mtime = path.stat().st_mtime_ns
            if mtime != self._delay_mtime:
                self._delay = float(json.loads(path.read_text())["release_delay_s"])
                self._delay_mtime = mtime
        except (OSError, ValueError, KeyError):
            return 0.0
        return self._delay

    def device_count(self) -> int:
        return len(self._devices)

    def _device(self, index: int) -> _Device:
        for d in self._devices:
            if d.index == index:
                return d
        raise GpuUnavailable(
            f"GPU {index} does not exist: the simulated host has {len(self._devices)} GPU(s)"
        )

    def sample(self, indices: Sequence[int]) -> list[DeviceSample]:
        devices = [self._device(i) for i in indices]
        used = {d.index: d.baseline_mib for d in devices}
        procs: dict[int, list[GpuProcess]] = {d.index: [] for d in devices}
        delay = self._release_delay()
        now = time.monotonic()
        for entry in os.scandir(self.root / "alloc"):
            rec = _read(entry.path)
            if rec is None or rec["device"] not in used:
                continue
            ref = processes.ProcessRef(rec["pid"], rec["start_ticks"])
            dev_path = str(device_file(self.root, rec["device"]))
            if processes.is_alive(ref) and processes.holds_any(ref.pid, [dev_path]):
                used[rec["device"]] += rec["mib"]
                if not rec["hidden"]:
                    procs[rec["device"]].append(GpuProcess(ref.pid, rec["mib"]))
                continue
            # The holder is gone: the driver frees its memory after the release delay.
            marker = self.root / "released" / entry.name
            released_at = _released_at(marker, now)
            if now - released_at < delay:
                used[rec["device"]] += rec["mib"]
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
                d.index, min(used[d.index], d.total_mib), d.total_mib, tuple(procs[d.index])
            )
            for d in devices
        ]

    def device_path(self, index: int) -> str:
        return str(device_file(self.root, self._device(index).index))

    def driver_version(self) -> str:
        self._devices  # noqa: B018 - loads the host
        return self._driver

    def baseline_of(self, index: int) -> int:
        return self._device(index).baseline_mib

    def close(self) -> None:
        self._loaded = None
        for fd in self._held:
            os.close(fd)
        self._held = []


def _read(path: str) -> dict[str, int] | None:
    try:
        data: dict[str, int] = json.loads(Path(path).read_text())
        return data
    except (OSError, ValueError):
        return None  # removed or being replaced: the next sample sees it


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
