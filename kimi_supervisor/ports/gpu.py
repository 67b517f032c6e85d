"""The GPU port: memory used and processes per device, and the device files that stand for them.

Two backends behind one small interface: real NVML (`pynvml`, from nvidia-ml-py) and the
simulated GPU host of the sandbox. NVML is initialised lazily; its failures become
`GpuUnavailable` with a message that says what to check.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import os
import re
import select
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kimi_supervisor.model import GpuActivity, GpuHealth

if TYPE_CHECKING:
    from kimi_supervisor.ports.bounded import IoWorker

MIB = 1024 * 1024
# NVML's per-process samples read per GPU and reading at most (it keeps one or a few a process).
MAX_SAMPLES = 4096


class GpuUnavailable(Exception):
    """No GPU information can be had (no driver, no device, or a device index out of range)."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: int | None  # None: NVML could not say (other namespaces, some drivers)
    kind: Literal["compute", "graphics"] = "compute"


@dataclass(frozen=True)
class DeviceSample:
    index: int
    used_mib: int
    total_mib: int
    processes: tuple[GpuProcess, ...] = ()


class GpuPort(Protocol):
    def device_count(self) -> int: ...
    def sample(self, indices: Sequence[int]) -> list[DeviceSample]: ...
    def health(self, indices: Sequence[int]) -> list[GpuHealth]: ...
    def activity(self, indices: Sequence[int]) -> list[GpuActivity]: ...
    def device_path(self, index: int) -> str: ...
    def uuid(self, index: int) -> str: ...
    def driver_version(self) -> str: ...
    def fabric(self, indices: Sequence[int] | None = None) -> dict[str, Any]: ...
    def close(self) -> None: ...

    def node_key(self, path: str, st: os.stat_result) -> tuple[object, ...] | None:
        """What the driver takes the node `st` (readable at `path`) for, where its file identity
        (a character device's number, another file's inode) is not enough; None: it is."""
        ...


class NvmlGpu:
    """GpuPort over NVML. Device handles are looked up once and cached."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}
        # Each GPU's newest per-process sample read (NVML's CPU timestamp, µs): the next
        # activity() asks for those after it.
        self._sampled: dict[int, int] = {}

    def _lib(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            import pynvml
        except ImportError as e:
            raise GpuUnavailable(
                "the pynvml module is missing: install nvidia-ml-py (pip install nvidia-ml-py)"
            ) from e
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise GpuUnavailable(
                f"NVML could not be initialised ({e}): is the NVIDIA driver loaded? "
                "`nvidia-smi` should list the GPUs"
            ) from e
        self._nvml = pynvml
        return pynvml

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        """One NVML call. Every error is GpuUnavailable, which the callers treat as data (as
        nvitop's nvmlQuery does): "GPU is lost", "driver not loaded", an unknown error, a
        descriptor limit (OSError) alike. After one, the handles and the library are dropped,
        so that a driver that comes back (reloaded, a GPU reset) is picked up by the next call
        without a restart."""
        nv = self._lib()
        try:
            return fn(*args)
        except (nv.NVMLError, OSError) as e:
            self._forget()
            raise GpuUnavailable(f"{what}: NVML query failed: {e}") from e

    def _forget(self) -> None:
        self._handles.clear()
        nv, self._nvml = self._nvml, None
        if nv is not None:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            nv = self._lib()
            count = self._call("the GPU count", nv.nvmlDeviceGetCount)
            if not 0 <= index < count:
                raise GpuUnavailable(f"GPU {index} does not exist: NVML reports {count} GPU(s)")
            self._handles[index] = self._call(f"GPU {index}", nv.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def device_count(self) -> int:
        return int(self._call("the GPU count", self._lib().nvmlDeviceGetCount))

    def sample(self, indices: Sequence[int]) -> list[DeviceSample]:
        nv = self._lib()
        out = []
        for index in indices:
            h = self._handle(index)
            what = f"GPU {index}"
            mem = self._call(what, nv.nvmlDeviceGetMemoryInfo, h)
            procs = [
                GpuProcess(p.pid, _mib(p.usedGpuMemory), "compute")
                for p in self._call(what, nv.nvmlDeviceGetComputeRunningProcesses, h)
            ] + [
                GpuProcess(p.pid, _mib(p.usedGpuMemory), "graphics")
                for p in self._call(what, nv.nvmlDeviceGetGraphicsRunningProcesses, h)
            ]
            out.append(
                DeviceSample(index, int(mem.used) // MIB, int(mem.total) // MIB, tuple(procs))
            )
        return out

    def health(self, indices: Sequence[int]) -> list[GpuHealth]:
        """NVML's health signals of each GPU, then the kernel's Xid lines for it. A signal this
        GPU does not support (NVML's NotSupported: page retirement on an H200, NVLink on a
        PCIe card) is None and named in `unread`, as is any other error of one signal. A GPU
        NVML cannot find, or whose reading fails in any other way, has every signal None and
        why in `unread`: one lost GPU hides none of the others' health. NVML itself not there
        is GpuUnavailable. NVML is read first: the Xids (the kernel's log, else the journal,
        given JOURNAL_TIMEOUT_S) never cost the NVML signals the port's deadline."""
        nv = self._lib()
        read: list[tuple[int, dict[str, Any], list[str], str | None]] = []
        for index in indices:
            unread: list[str] = []
            try:
                fields, bus_id = self._health_of(nv, index, unread)
            except Exception as e:  # one GPU's failure is that GPU's, whatever it is
                read.append((index, {}, [f"the GPU: {reading_error(e)}"], None))
                continue
            read.append((index, fields, unread, bus_id))
        xids: dict[str, list[int]] | None = None
        cut = False
        if any(fields for _i, fields, _u, _b in read):  # no GPU read: no Xid to match either
            xids, cut = kernel_xids()
            if xids is None:  # the daemon's unit: ProtectKernelLogs=yes, no CAP_SYSLOG
                xids, cut = journal_xids()
        out = []
        for index, fields, unread, bus_id in read:
            if fields:
                known = xids is not None and bus_id is not None
                if xids is None:
                    unread.append(
                        "Xid: neither the kernel's log (/dev/kmsg) nor this boot's kernel "
                        "messages in the journal can be read"
                    )
                elif bus_id is None:
                    unread.append("Xid: the GPU's PCI address is unknown")
                elif cut:
                    unread.append(
                        "Xid: the kernel's log is longer than what is read "
                        f"({KMSG_MAX_BYTES >> 20} MiB, {JOURNAL_TIMEOUT_S:g} s): some not read"
                    )
                mine = xids.get(bus_id) if xids is not None and bus_id is not None else None
                fields["xids"] = tuple(mine or ()) if known else None
            out.append(GpuHealth(index, **fields, unread=tuple(unread)))
        return out

    def _health_of(
        self, nv: Any, index: int, unread: list[str]
    ) -> tuple[dict[str, Any], str | None]:
        """One GPU's NVML signals (GpuHealth's fields but the Xids) and its PCI address."""
        h = self._handle(index)

        ask = _asker(nv, unread)

        rows = ask("row remapping", nv.nvmlDeviceGetRemappedRows, h)
        pending = ask("page retirement", nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        ecc = ask(
            "uncorrected ECC", nv.nvmlDeviceGetTotalEccErrors, h,
            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC,
        )  # fmt: skip
        bus = ask("PCI bus", nv.nvmlDeviceGetPciInfo, h)
        fields = {
            "remap_pending": bool(rows[2]) if rows is not None else None,
            "remap_failed": bool(rows[3]) if rows is not None else None,
            "retired_pending": bool(pending) if pending is not None else None,
            "ecc_uncorrected": int(ecc) if ecc is not None else None,
            "nvlink_errors": self._nvlink_errors(nv, h),
        }
        return fields, _pci_id(bus.busId) if bus is not None else None

    @staticmethod
    def _nvlink_errors(nv: Any, h: Any) -> int | None:
        """Errors summed over the active links; None where the GPU has no NVLink, or no
        counter of an active link could be read (not supported is not "no error")."""
        total, read = 0, 0
        counters = [
            getattr(nv, name)
            for name in (
                "NVML_NVLINK_ERROR_DL_CRC_FLIT",
                "NVML_NVLINK_ERROR_DL_CRC_DATA",
                "NVML_NVLINK_ERROR_DL_REPLAY",
                "NVML_NVLINK_ERROR_DL_RECOVERY",
            )
            if hasattr(nv, name)
        ]
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
            except Exception:
                continue  # no such link, or no NVLink at all (or an old pynvml's own error)
            for c in counters:
                with contextlib.suppress(Exception):
                    total += int(nv.nvmlDeviceGetNvLinkErrorCounter(h, link, c))
                    read += 1
        return total if read else None

    def fabric(self, indices: Sequence[int] | None = None) -> dict[str, Any]:
        """The host's fabric as NVML reports it, per GPU (`indices`, None: every one): its PCIe
        link's generation and width now and at most, and its NVLink links (those NVML answers
        for), how many are active and their version. Errors are data: a reading that fails is
        named in that GPU's `unread`, a GPU that cannot be read has only `unread`, and NVML
        itself missing is {"error": why} (the capture records it as it is)."""
        try:
            nv = self._lib()
            count = self.device_count()
        except GpuUnavailable as e:
            return {"source": "NVML at capture time", "gpus": [], "error": str(e)}
        gpus: list[dict[str, Any]] = []
        for index in range(count) if indices is None else indices:
            unread: list[str] = []
            try:
                h = self._handle(index)
            except GpuUnavailable as e:
                gpus.append({"index": index, "unread": [str(e)]})
                continue

            ask = _asker(nv, unread)

            name = ask("name", nv.nvmlDeviceGetName, h)
            pcie = {
                "gen": ask("PCIe generation", nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "width": ask("PCIe width", nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                "max_gen": ask("PCIe max generation", nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "max_width": ask("PCIe max width", nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            }
            links = active = 0
            version = None
            for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
                try:
                    state = nv.nvmlDeviceGetNvLinkState(h, link)
                except Exception:
                    continue  # no such link, or no NVLink at all
                links += 1
                if state == nv.NVML_FEATURE_ENABLED:
                    active += 1
                    if version is None:
                        version = ask("NVLink version", nv.nvmlDeviceGetNvLinkVersion, h, link)
            gpus.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "pcie": pcie,
                    "nvlink": {"links": links, "active": active, "version": version},
                    "unread": unread,
                }
            )
        return {"source": "NVML at capture time", "gpus": gpus}

    def activity(self, indices: Sequence[int]) -> list[GpuActivity]:
        """Each GPU's own counters now (GpuActivity): utilization (kernels, memory), power,
        the SM clock, PCIe and NVLink traffic, and the processes it lists (another user's
        process on the GPU makes its counters no one's). A counter this GPU does not support,
        or whose read fails, is None and named in `unread`; a GPU NVML cannot find has every
        counter None. NVML itself not there is GpuUnavailable."""
        nv = self._lib()
        out = []
        for index in indices:
            unread: list[str] = []
            try:
                h = self._handle(index)
            except Exception as e:  # one GPU's failure is that GPU's
                out.append(GpuActivity(index, unread=(f"the GPU: {reading_error(e)}",)))
                continue

            ask = _asker(nv, unread)
            util = ask("utilization", nv.nvmlDeviceGetUtilizationRates, h)
            power = ask("power", nv.nvmlDeviceGetPowerUsage, h)
            clock = ask("SM clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            tx = ask("PCIe sent", nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES)
            rx = ask("PCIe received", nv.nvmlDeviceGetPcieThroughput, h,
                     nv.NVML_PCIE_UTIL_RX_BYTES)  # fmt: skip
            compute = ask("processes", nv.nvmlDeviceGetComputeRunningProcesses, h)
            graphics = ask("processes", nv.nvmlDeviceGetGraphicsRunningProcesses, h)
            samples = self._samples(nv, h, index)
            out.append(
                GpuActivity(
                    index,
                    util_gpu=float(util.gpu) if util is not None else None,
                    util_memory=float(util.memory) if util is not None else None,
                    power_w=power / 1000 if power is not None else None,
                    sm_clock_mhz=float(clock) if clock is not None else None,
                    pcie_mb_s=(tx + rx) / 1000 if tx is not None and rx is not None else None,
                    nvlink_kib=_nvlink_kib(nv, h, unread),
                    unread=tuple(unread),
                    pids=_pids(compute, graphics),
                    samples=samples,
                )
            )
        return out

    def _samples(self, nv: Any, h: Any, index: int) -> tuple[tuple[int, float, float], ...] | None:
        """NVML's per-process samples of GPU `index` since its previous reading (the highest
        kernel and memory % per PID); () where it took none (NOT_FOUND: no process sampled),
        None where the GPU cannot sample processes or the read fails."""
        # NVML stamps a sample with the wall clock (µs): one stamped ahead of a clock that was
        # then set back (NTP, an operator) would hide every sample until the clock caught up.
        now_us = int(time.time() * 1e6)
        since = self._sampled.get(index, 0)
        if since > now_us:
            since = 0
        best: dict[int, tuple[float, float]] = {}
        newest = since
        try:
            for s in nv.nvmlDeviceGetProcessUtilization(h, since)[:MAX_SAMPLES]:
                pid, sm, mem = int(s.pid), float(s.smUtil), float(s.memUtil)
                was = best.get(pid, (0.0, 0.0))
                best[pid] = (max(was[0], sm), max(was[1], mem))
                newest = max(newest, int(s.timeStamp))
        except Exception as e:  # not supported, an old pynvml, an odd answer: not sampled
            not_found = getattr(nv, "NVMLError_NotFound", None)
            return () if not_found is not None and isinstance(e, not_found) else None
        self._sampled[index] = min(newest, now_us)
        return tuple((pid, sm, mem) for pid, (sm, mem) in sorted(best.items()))

    def device_path(self, index: int) -> str:
        h = self._handle(index)
        minor = self._call(f"GPU {index}", self._lib().nvmlDeviceGetMinorNumber, h)
        return f"/dev/nvidia{int(minor)}"

    def uuid(self, index: int) -> str:
        """The GPU's UUID (`GPU-...`), the label dcgm-exporter's series carry too."""
        u = self._call(f"GPU {index}", self._lib().nvmlDeviceGetUUID, self._handle(index))
        return u.decode() if isinstance(u, bytes) else str(u)

    def node_key(self, path: str, st: os.stat_result) -> tuple[object, ...] | None:
        """None: the driver finds a GPU by the node's device number (195:minor), which is its
        file identity already, in any /dev (a container's nodes are other inodes, the same
        numbers: measured on an H200)."""
        return None

    def driver_version(self) -> str:
        v = self._call("the driver version", self._lib().nvmlSystemGetDriverVersion)
        return v.decode() if isinstance(v, bytes) else str(v)

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml = None
            self._handles.clear()


# The kernel's line for an Xid: "NVRM: Xid (PCI:0000:18:00): 79, pid=..., GPU has fallen off
# the bus." (NVIDIA's Xid catalog). Read from /dev/kmsg: root's, bounded, never waited on.
# On a MIG GPU the address is followed by its instances: "(PCI:0000:18:00 GPU-I:05 GPU-CI:00)"
# (open-gpu-kernel-modules, kernel_rc.c).
_XID = re.compile(rb"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)[^)\n]*\): (\d+)")
# The kernel's ring is at most 32 MiB as configured (CONFIG_LOG_BUF_SHIFT <= 25); more is a
# boot parameter's, and its newest records are then said to be unread. /dev/kmsg is read from
# its oldest record and cannot be read backwards.
KMSG_MAX_BYTES = 32 << 20


def _pci_id(raw: bytes | str) -> str | None:
    """A PCI address as the kernel writes it in an Xid line (domain:bus:device, lower case):
    NVML's busId is "00000000:18:00.0". None for what is no address ("::18:00")."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    parts = text.lower().split(".")[0].split(":")
    if len(parts) != 3 or not all(parts):
        return None
    try:
        domain, bus, device = (int(p, 16) for p in parts)
    except ValueError:
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def _add_xids(
    found: dict[str, list[int]], text: bytes, on_line: Callable[[bytes], None] | None = None
) -> None:
    """The Xid codes of `text`'s lines into `found`, by the GPU's PCI address, each code once;
    a line whose address is none is skipped. `on_line` is given `text` (a record of the
    kernel's log, a line of the journal) when it holds an Xid line: the incident bundle's."""
    if on_line is not None and _XID.search(text):
        on_line(text)
    for m in _XID.finditer(text):
        bus, code = _pci_id(m.group(1)), int(m.group(2))
        if bus is not None and code not in (codes := found.setdefault(bus, [])):
            codes.append(code)  # each code once: a flood of one code is one entry


def _kmsg_is_the_kernels(st: os.stat_result) -> bool:
    """The kernel's log device (character 1:11), not what a container put at its path."""
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 11)


def kernel_xids(
    path: str = "/dev/kmsg",
    device: bool = True,
    on_line: Callable[[bytes], None] | None = None,
) -> tuple[dict[str, list[int]] | None, bool]:
    """The Xid codes the kernel's log holds, by the GPU's PCI address (domain:bus:device),
    None where the log cannot be read; and whether the log went on past KMSG_MAX_BYTES (its
    newest records unread). /dev/kmsg is read without waiting (O_NONBLOCK: EAGAIN at its end),
    record by record, and only if it is the kernel's log (character device 1:11; `device`
    False: any file, for tests): a container's /dev/kmsg may be /dev/null, whose nothing is
    no "no Xid"."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None, False
    found: dict[str, list[int]] = {}
    read = 0
    try:
        if device and not _kmsg_is_the_kernels(os.fstat(fd)):
            return None, False
        while True:
            if read >= KMSG_MAX_BYTES:
                return found, True
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the log
            except OSError as e:
                if e.errno == errno.EPIPE:  # a record overwritten while read: go on
                    continue
                return (None if not read else found), False
            if not record:
                break
            read += len(record)
            _add_xids(found, record, on_line)
    finally:
        os.close(fd)
    return found, False


# The journal's copy of this boot's kernel messages: what the daemon reads under its own unit,
# where /dev/kmsg is closed to it (ProtectKernelLogs=yes; reading it also takes CAP_SYSLOG under
# Debian 12's kernel.dmesg_restrict=1). First whether the journal holds any kernel message of
# this boot (a container's holds none: no reading, not "no Xid"), then the Xid lines alone,
# newest first. Both together get JOURNAL_TIMEOUT_S, a third of gpus.timeout_s's default: a
# slow journal costs the Xids, never the NVML signals read before them.
JOURNAL_ANY = ["journalctl", "-k", "-b", "-n", "1", "--output=cat", "--no-pager", "--quiet"]
JOURNAL_XIDS = [
    "journalctl", "-k", "-b", "--grep=NVRM: Xid", "--reverse", "--output=cat", "--no-pager",
    "--quiet",
]  # fmt: skip
JOURNAL_TIMEOUT_S = 3.0
LINE_MAX_BYTES = 1 << 16  # a journal line longer than this is no Xid line: skipped


def journal_xids(
    argv: Sequence[str] = JOURNAL_XIDS,
    timeout_s: float = JOURNAL_TIMEOUT_S,
    probe: Sequence[str] | None = JOURNAL_ANY,
    *,
    on_line: Callable[[bytes], None] | None = None,
) -> tuple[dict[str, list[int]] | None, bool]:
    """kernel_xids' answer from the journal: None where journalctl is missing or `probe`
    prints nothing (no kernel message at all); cut when the output passed KMSG_MAX_BYTES or
    the time ran out."""
    deadline = time.monotonic() + timeout_s
    if probe is not None:
        _, any_read, _, failed = _run_bounded(probe, deadline, lambda _line: None)
        if not any_read or failed:
            return None, False
    found: dict[str, list[int]] = {}
    started, read, cut, failed = _run_bounded(
        argv, deadline, lambda line: _add_xids(found, line, on_line)
    )
    # journalctl --grep exits 1 both when nothing matched and on an error (which it says on
    # standard error): only the silent 1 is "no Xid". Cut short with nothing read is no reading.
    if not started or failed or (cut and not read) or (probe is None and not read):
        return None, False
    return found, cut


def xid_lines(max_lines: int) -> tuple[list[str] | None, bool]:
    """The kernel's Xid lines themselves (not only their codes, as `health` reads them), the
    newest `max_lines`, oldest first, from where `health` reads them: the kernel's log, else
    this boot's kernel messages in the journal (the daemon's unit). None where neither can be
    read; True when some were not read or not kept (the log longer than its bound, the
    journal's time out, more lines than `max_lines`)."""
    # The kernel's log is read oldest first: the deque keeps the newest.
    kept: collections.deque[bytes] = collections.deque(maxlen=max_lines)
    found, cut = kernel_xids(on_line=kept.append)
    if found is None:
        newest: list[bytes] = []  # the journal newest first: the first ones are kept
        more = [False]

        def keep(line: bytes) -> None:
            if len(newest) < max_lines:
                newest.append(line)
            else:
                more[0] = True

        found, cut = journal_xids(on_line=keep)
        kept = collections.deque(reversed(newest))
        cut = cut or more[0]
    elif len(kept) == max_lines:
        cut = True  # maybe more: the deque keeps only the newest
    if found is None:
        return None, False
    return [line.decode(errors="backslashreplace").rstrip("\n") for line in kept], cut


def _run_bounded(
    argv: Sequence[str], deadline: float, each_line: Callable[[bytes], None]
) -> tuple[bool, int, bool, bool]:
    """`argv` run until it ends, KMSG_MAX_BYTES were read, or `deadline`: each whole line
    (up to LINE_MAX_BYTES) to `each_line`. Returns whether it could start, the bytes read,
    whether it was cut short, and whether it failed (said something on standard error, or
    ended with a status other than 0 or 1). The child is killed by its handle after, and never
    waited on past a moment (one stuck in the kernel is left)."""
    try:
        proc = subprocess.Popen(
            list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, close_fds=True,
        )  # fmt: skip
    except OSError:
        return False, 0, False, True
    assert proc.stdout is not None
    out = proc.stdout.fileno()
    os.set_blocking(out, False)
    read, cut, tail = 0, False, bytearray()
    try:
        while True:
            if read >= KMSG_MAX_BYTES or time.monotonic() >= deadline:
                cut = True
                break
            if not select.select([out], [], [], max(0.0, deadline - time.monotonic()))[0]:
                continue
            try:
                chunk = os.read(out, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                break
            read += len(chunk)
            *lines, rest = chunk.split(b"\n")
            if lines:
                lines[0] = bytes(tail) + lines[0]
                for line in lines:
                    if len(line) <= LINE_MAX_BYTES:
                        each_line(line)
                tail = bytearray(rest)
            elif len(tail) <= LINE_MAX_BYTES:
                tail += rest  # a line still coming (an over-long one is dropped)
        if not cut and tail and len(tail) <= LINE_MAX_BYTES:
            each_line(bytes(tail))
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # our own child, by its handle; done or cut short
        proc.stdout.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1)
        assert proc.stderr is not None
        os.set_blocking(proc.stderr.fileno(), False)
        try:  # what it said before it ended, if anything (never waited for)
            said = os.read(proc.stderr.fileno(), 4096)
        except (BlockingIOError, OSError):
            said = b""
        proc.stderr.close()
    # Its status, unless it is our kill's (or it is still not reaped: left, as said).
    failed = bool(said.strip()) or proc.returncode not in (0, 1, -signal.SIGKILL, None)
    return True, read, cut, failed


def reading_error(e: Exception) -> str:
    """Why a health reading failed, in words: GpuUnavailable says it itself; anything else (a
    port's own bug, an odd pynvml) is named by its type too."""
    return str(e) if isinstance(e, GpuUnavailable) else f"{type(e).__name__}: {e}"


def _asker(nv: Any, unread: list[str]) -> Callable[..., Any]:
    """ask(name, fn, *args): one NVML read, its value, or None with why in `unread`."""

    def ask(name: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except nv.NVMLError_NotSupported:
            unread.append(f"{name}: not supported by this GPU")
        except (nv.NVMLError, OSError) as e:
            unread.append(f"{name}: {e}")
        except Exception as e:  # an old pynvml without the call, an odd answer: not read
            unread.append(f"{name}: {type(e).__name__}: {e}")
        return None

    return ask


def fabric_of(gpu: GpuPort | None, indices: Sequence[int] = ()) -> dict[str, Any] | None:
    """A capture's fabric reading (the GPUs of `indices`, none: every one), whatever goes
    wrong as data; None with no port."""
    if gpu is None:
        return None
    try:
        return gpu.fabric(list(indices) or None)
    except Exception as e:  # a port's own bug: said in the reading, never a failed capture
        return {"source": "NVML at capture time", "gpus": [], "error": reading_error(e)}


def _nvlink_kib(nv: Any, h: Any, unread: list[str]) -> float | None:
    """NVLink data sent and received so far (KiB, every link together: NVML's scope "all
    links"), or None where the GPU has no NVLink (not said: a PCIe card has none) or the
    counters cannot be read (said)."""
    fields = [getattr(nv, f"NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{d}", None) for d in ("TX", "RX")]
    if None in fields:
        unread.append("NVLink traffic: this pynvml has no such field")
        return None
    try:  # scope UINT_MAX: summed over every link (NVML's nvmlFieldValue_t.scopeId)
        values = nv.nvmlDeviceGetFieldValues(h, [(f, 0xFFFFFFFF) for f in fields])
    except nv.NVMLError_NotSupported:
        return None
    except Exception as e:
        unread.append(f"NVLink traffic: {type(e).__name__}: {e}")
        return None
    total = 0.0
    for v in values:
        if v.nvmlReturn == getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3):
            return None
        if v.nvmlReturn != 0:
            unread.append(f"NVLink traffic: NVML error {v.nvmlReturn}")
            return None
        total += float(v.value.ullVal)
    return total


def _pids(compute: Any, graphics: Any) -> tuple[int, ...] | None:
    """The PIDs of a GPU's compute and graphics processes, None where the compute list could
    not be read (a graphics list unread is taken for none: a compute GPU may not say it)."""
    if compute is None:
        return None
    return tuple(sorted({int(p.pid) for p in [*compute, *(graphics or ())]}))


def _mib(value: int | None) -> int | None:
    # NVML reports NVML_VALUE_NOT_AVAILABLE (2**64-1) or None where it cannot account memory.
    if value is None or value >= 2**63:
        return None
    return int(value) // MIB


class BoundedGpu:
    """A GpuPort whose every call waits at most `timeout_s` (`gpus.timeout_s`): NVML's calls
    take no timeout, and a driver that hangs in one would hold the loop or the teardown for as
    long as it lasts. Each call runs on a worker of its own (ports/bounded.py): the daemon's is
    a process in a scope of its own (`made_by` names how that process makes its GpuPort), so
    that a call stuck in the driver holds no stop either; elsewhere a thread, calling `inner`.
    A call that passes the deadline is abandoned, and until it returns every other call fails
    at once. Either way the caller gets GpuUnavailable: no reading, which decides nothing by
    itself (the teardown cannot call the GPUs clean without one; the observer says so)."""

    def __init__(
        self,
        inner: GpuPort,
        timeout_s: float,
        worker: IoWorker | None = None,
        *,
        made_by: tuple[Callable[..., GpuPort], tuple[Any, ...]] | None = None,
    ) -> None:
        from kimi_supervisor.ports.bounded import Worker

        self.inner = inner
        self.worker: IoWorker = worker if worker is not None else Worker("nvml", timeout_s)
        self._made_by = made_by
        # A GPU's device node and UUID do not change while the host runs: asked once (the
        # daemon asks at boot), they need no answer of a driver that hangs later.
        self._paths: dict[int, str] = {}
        self._uuids: dict[int, str] = {}

    def _call(self, what: str, method: str, *args: Any) -> Any:
        from kimi_supervisor.ports.bounded import ProcessGone, on_object

        if self._made_by is not None:
            fn = functools.partial(on_object, *self._made_by, method, *args)
        else:
            fn = functools.partial(getattr(self.inner, method), *args)
        try:
            return self.worker.call(fn, what)
        except (TimeoutError, ProcessGone) as e:
            raise GpuUnavailable(f"NVML: {e}") from e

    def device_count(self) -> int:
        return int(self._call("the GPU count", "device_count"))

    def sample(self, indices: Sequence[int]) -> list[DeviceSample]:
        shown = ", ".join(map(str, indices))
        return list(self._call(f"reading GPU(s) {shown}", "sample", list(indices)))

    def device_path(self, index: int) -> str:
        if index not in self._paths:
            what = f"GPU {index}'s device file"
            self._paths[index] = str(self._call(what, "device_path", index))
        return self._paths[index]

    def uuid(self, index: int) -> str:
        if index not in self._uuids:
            self._uuids[index] = str(self._call(f"GPU {index}'s UUID", "uuid", index))
        return self._uuids[index]

    def driver_version(self) -> str:
        return str(self._call("the driver version", "driver_version"))

    def health(self, indices: Sequence[int]) -> list[GpuHealth]:
        shown = ", ".join(map(str, indices))
        return list(self._call(f"the health of GPU(s) {shown}", "health", list(indices)))

    def fabric(self, indices: Sequence[int] | None = None) -> dict[str, Any]:
        """The inner port's fabric; a driver that hangs past the deadline is {"error": why}."""
        try:
            got = self._call("the fabric", "fabric", None if indices is None else list(indices))
        except GpuUnavailable as e:
            return {"source": "NVML at capture time", "gpus": [], "error": str(e)}
        return dict(got)

    def activity(self, indices: Sequence[int]) -> list[GpuActivity]:
        shown = ", ".join(map(str, indices))
        return list(self._call(f"the counters of GPU(s) {shown}", "activity", list(indices)))

    def node_key(self, path: str, st: os.stat_result) -> tuple[object, ...] | None:
        # Asked once per device node while judging a holder, on the caller's thread: NVML's
        # answers nothing here (None); the simulated host's reads a file of its own folder.
        return self.inner.node_key(path, st)

    def close(self) -> None:
        """Shut the library down, unless a call is stuck in it (then it is left as it is), and
        end the worker (a process stuck in the driver is left in its scope)."""
        # A process already gone (the system stopping its scope first) is not started again
        # only to shut NVML down in it.
        if getattr(self.worker, "alive", True):
            with contextlib.suppress(GpuUnavailable):
                self._call("closing NVML", "close")
        self.worker.close()
