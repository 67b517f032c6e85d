"""The NVML port over a stand-in pynvml: every error of every call is GpuUnavailable (data for
the loop, never an exception that ends it), and a driver that comes back is picked up."""

from __future__ import annotations

import errno
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.ports.gpu import GpuUnavailable, NvmlGpu


class NVMLError(Exception):
    pass


class StandIn(types.ModuleType):
    """pynvml with one GPU; `fail` names the calls that raise, and what."""

    NVMLError = NVMLError

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.fail: dict[str, Exception] = {}
        self.inits = 0

    def _maybe(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def nvmlInit(self) -> None:
        self._maybe("nvmlInit")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        self._maybe("nvmlDeviceGetCount")
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> object:
        self._maybe("nvmlDeviceGetHandleByIndex")
        return ("handle", i)

    def nvmlDeviceGetMinorNumber(self, h: object) -> int:
        self._maybe("nvmlDeviceGetMinorNumber")
        return 0

    def nvmlSystemGetDriverVersion(self) -> str:
        self._maybe("nvmlSystemGetDriverVersion")
        return "580.159.04"

    def nvmlDeviceGetUUID(self, h: object) -> str:
        self._maybe("nvmlDeviceGetUUID")
        return "GPU-0"

    def nvmlDeviceGetMemoryInfo(self, h: object) -> Any:
        self._maybe("nvmlDeviceGetMemoryInfo")
        return types.SimpleNamespace(used=615 << 20, total=143771 << 20)

    def nvmlDeviceGetComputeRunningProcesses(self, h: object) -> list[Any]:
        self._maybe("nvmlDeviceGetComputeRunningProcesses")
        return []

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: object) -> list[Any]:
        return []


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    fake = StandIn()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    yield fake


CALLS = {
    "nvmlDeviceGetCount": lambda g: g.device_count(),
    "nvmlSystemGetDriverVersion": lambda g: g.driver_version(),
    "nvmlDeviceGetMinorNumber": lambda g: g.device_path(0),
    "nvmlDeviceGetHandleByIndex": lambda g: g.sample([0]),
    "nvmlDeviceGetMemoryInfo": lambda g: g.sample([0]),
    "nvmlDeviceGetComputeRunningProcesses": lambda g: g.sample([0]),
    "nvmlDeviceGetUUID": lambda g: g.uuid(0),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize(
    "error",
    [NVMLError("GPU is lost"), OSError(errno.EMFILE, "Too many open files")],
    ids=["GPU is lost", "EMFILE"],
)
def test_any_nvml_error_is_gpu_unavailable_and_a_driver_that_comes_back_is_picked_up(
    nvml: StandIn, call: str, error: Exception
) -> None:
    gpu = NvmlGpu()
    nvml.fail[call] = error
    with pytest.raises(GpuUnavailable) as e:
        CALLS[call](gpu)
    assert str(error) in str(e.value) and "NVML query failed" in str(e.value)
    del nvml.fail[call]
    CALLS[call](gpu)  # the same port object, no restart
    assert nvml.inits == 2, "NVML was initialised again after the error"
    assert gpu.sample([0])[0].used_mib == 615


def test_the_kernels_xid_lines_are_found_per_gpu_by_its_pci_address(tmp_path: Path) -> None:
    """/dev/kmsg's records as the kernel writes them (NVIDIA's Xid catalog's format); NVML
    names a GPU's bus "00000000:18:00.0", the kernel "0000:18:00"."""
    from kimi_supervisor.ports.gpu import _pci_id, kernel_xids

    log = tmp_path / "kmsg"
    log.write_bytes(
        b"3,1001,5512345,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, "
        b"GPU has fallen off the bus.\n"
        b"4,1002,5512399,-;NVRM: Xid (PCI:0000:9A:00): 63, pid='<unknown>', Row Remapper\n"
        b"6,1003,5512400,-;eth0: link up\n"
    )
    assert kernel_xids(str(log), device=False) == ({"0000:18:00": [79], "0000:9a:00": [63]}, False)
    assert _pci_id(b"00000000:9A:00.0") == "0000:9a:00" and _pci_id("0000:18:00") == "0000:18:00"
    assert kernel_xids(str(tmp_path / "none"), device=False) == (
        None,
        False,
    )  # cannot be read: not "no Xid"


def test_an_xid_line_whose_address_is_none_is_skipped_and_the_others_still_read(
    tmp_path: Path,
) -> None:
    """An outside review: "PCI::18:00" raised ValueError out of the health read, and the daemon
    started its teardown again and again (624 cycles in 8 s)."""
    from kimi_supervisor.ports.gpu import _pci_id, kernel_xids

    log = tmp_path / "kmsg"
    log.write_bytes(
        b"3,1,1,-;NVRM: Xid (PCI::18:00): 79, pid=1, GPU has fallen off the bus.\n"
        b"3,2,2,-;NVRM: Xid (PCI:zz:18:00): 79, pid=1\n"
        b"3,3,3,-;NVRM: Xid (PCI:0000:18:00): 48, pid=1, DBE\n"
    )
    assert kernel_xids(str(log), device=False) == ({"0000:18:00": [48]}, False)
    assert [_pci_id(x) for x in ("::18:00", "0000:18", "", "0000:18:00:00")] == [None] * 4


def test_a_kernel_log_longer_than_the_bound_is_said_to_be_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kimi_supervisor.ports import gpu

    log = tmp_path / "kmsg"
    log.write_bytes(b"3,1,1,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1\n" + b"x" * 20000)
    monkeypatch.setattr(gpu, "KMSG_MAX_BYTES", 8192)
    assert gpu.kernel_xids(str(log), device=False) == ({"0000:18:00": [79]}, True)


class Health(StandIn):
    """Three GPUs with health signals; the second is lost (its handle fails), the third's ECC
    read raises what pynvml never should, and NVLink's counters are not supported."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 2
    NVML_NVLINK_ERROR_DL_REPLAY = 0

    class NVMLError_NotSupported(NVMLError):
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetHandleByIndex(self, i: int) -> object:
        if i == 1:
            raise NVMLError("GPU is lost")
        return ("handle", i)

    def nvmlDeviceGetRemappedRows(self, h: object) -> tuple[int, int, int, int]:
        return (0, 0, 1, 0)  # a remapping pending

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: object) -> int:
        raise self.NVMLError_NotSupported()

    def nvmlDeviceGetTotalEccErrors(self, h: object, kind: int, counter: int) -> int:
        if h == ("handle", 2):
            raise RuntimeError("an old pynvml's own error")
        return 0

    def nvmlDeviceGetPciInfo(self, h: object) -> Any:
        return types.SimpleNamespace(busId=b"00000000:18:00.0")

    def nvmlDeviceGetNvLinkState(self, h: object, link: int) -> int:
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: object, link: int, counter: int) -> int:
        raise self.NVMLError_NotSupported()


def test_one_lost_gpu_hides_none_of_the_others_health_and_unsupported_counters_are_unread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kimi_supervisor.decide.gpuhealth import judge

    monkeypatch.setitem(sys.modules, "pynvml", Health())
    first, lost, odd = NvmlGpu().health([0, 1, 2])
    assert first.remap_pending is True, "the first GPU's health was read"
    assert first.nvlink_errors is None, "NVLink counters not supported are not 'no error'"
    assert lost.remap_pending is None and "GPU is lost" in lost.unread[0]
    # Any other error of one call is that signal unread, never the whole reading lost.
    assert odd.remap_pending is True and odd.ecc_uncorrected is None
    assert "uncorrected ECC: RuntimeError: an old pynvml's own error" in odd.unread
    v = judge([first, lost])
    assert v.verdict == "failing" and "GPU 0: rows remapped" in v.text()
    assert any(u.startswith("GPU 1: the GPU: ") for u in v.unread)


def test_a_health_with_a_gpu_not_read_is_unread_never_healthy() -> None:
    """An outside review: GPU 0 read healthy and GPU 1 lost was "healthy", which cleared the
    warning a refusal for GPU 1 had left. Of a GPU none of whose failing signals was read
    nothing is known."""
    from kimi_supervisor.decide.gpuhealth import judge
    from kimi_supervisor.model import GpuHealth

    lost = GpuHealth(1, unread=("the GPU: GPU is lost",))
    v = judge([lost])
    assert (v.verdict, v.healthy) == ("unread", False)
    assert v.text() == "not read: GPU 1: the GPU: GPU is lost"
    well = GpuHealth(0, remap_pending=False, remap_failed=False, ecc_uncorrected=0, xids=())
    v = judge([well, lost])
    assert (v.verdict, v.not_read) == ("unread", [1])
    assert v.text() == "not read: GPU 1: the GPU: GPU is lost"
    assert judge([]).verdict == "unread"
    # Another GPU's warning never stands for the health of the one not read: it is named.
    warned = GpuHealth(0, remap_pending=False, remap_failed=False, ecc_uncorrected=0, xids=(74,))
    v = judge([warned, lost])
    assert v.verdict == "warnings"
    assert v.text().endswith("since boot; not read: GPU 1: the GPU: GPU is lost"), v.text()


def test_a_gpu_is_failing_on_what_the_driver_holds_now_and_only_warned_of_for_its_past() -> None:
    from kimi_supervisor.decide.gpuhealth import judge
    from kimi_supervisor.model import GpuHealth

    healthy = GpuHealth(0, remap_pending=False, remap_failed=False, ecc_uncorrected=0, xids=())
    assert judge([healthy]).healthy and judge([healthy]).text() == "healthy"
    v = judge([GpuHealth(1, remap_failed=True, retired_pending=True, ecc_uncorrected=3)])
    assert v.failing == [
        "GPU 1: a row remapping failed (no spare row: replace the GPU)",
        "GPU 1: pages retired, waiting for a GPU reset to take effect",
        "GPU 1: 3 uncorrected ECC error(s) since the driver loaded",
    ]
    past = judge([GpuHealth(2, xids=(13, 79, 79), nvlink_errors=4)])
    assert not past.failing, "an Xid since boot may be what a reset has repaired since"
    assert past.warnings == [
        "GPU 2: the kernel logged Xid 79 (the GPU fell off the bus) since boot",
        "GPU 2: 4 NVLink error(s) on its active links",
    ]  # Xid 13 (a graphics engine exception: the application's) is not the GPU's health
    unread = judge(
        [GpuHealth(3, ecc_uncorrected=0, unread=("row remapping: not supported by this GPU",))]
    )
    assert unread.healthy and unread.unread == ["GPU 3: row remapping: not supported by this GPU"]


BUSY_S = 60  # a deadline for a journalctl that ends, met on a busy host too


def test_where_the_kernels_log_is_closed_the_journals_kernel_messages_give_the_xids(
    tmp_path: Path,
) -> None:
    """The daemon's own unit closes /dev/kmsg (ProtectKernelLogs=yes, no CAP_SYSLOG): the Xids
    come from the journal then. A journal with no kernel message at all (a container's) or no
    journalctl is no reading; a journalctl that never ends is cut at its deadline and said to
    be; a MIG GPU's lines (its instances after the address) are found; each code once."""
    from kimi_supervisor.ports.gpu import journal_xids

    lines = tmp_path / "kernel.txt"
    lines.write_text(
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.159.04\n"
        "NVRM: Xid (PCI:0000:18:00): 48, pid=7, DBE (0x1,0x2)\n"
        "NVRM: Xid (PCI:0000:18:00): 48, pid=7, DBE (0x1,0x2)\n"
        "NVRM: Xid (PCI::18:00): 79, pid=7\n"
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:00): 95, pid=7, Uncontained\n"
        "NVRM: Xid (PCI:0000:9a:00): 154, pid='<unknown>', GPU recovery action changed"
    )  # the last line without its newline
    some = ["echo", "a kernel message"]
    want = {"0000:18:00": [48], "0000:3b:00": [95], "0000:9a:00": [154]}
    assert journal_xids(["cat", str(lines)], BUSY_S, probe=some) == (want, False)
    assert journal_xids(["cat", str(lines)], BUSY_S, probe=["true"]) == (None, False)  # none at all
    assert journal_xids(["false"], BUSY_S, probe=some) == ({}, False)  # --grep matched nothing
    # An error exits 1 too, and says so on standard error; any other status is one as well.
    failing = ["sh", "-c", "echo 'Failed to compile pattern' >&2; exit 1"]
    assert journal_xids(failing, BUSY_S, probe=some) == (None, False)
    assert journal_xids(["sh", "-c", "exit 2"], BUSY_S, probe=some) == (None, False)
    # The probe's time used up, nothing read: no reading, not "no Xid".
    assert journal_xids(["sleep", "5"], 0.3, probe=some) == (None, False)
    assert journal_xids([str(tmp_path / "no-journalctl")], BUSY_S, probe=some) == (None, False)
    # A journalctl that never ends holds no read: what came is the answer, cut (True) at the
    # deadline, not read to the end 60 s later (False). The deadline leaves a loaded machine
    # time to start the probe, sh and cat.
    got = journal_xids(["sh", "-c", f"cat {lines}; echo; exec sleep 60"], 10, probe=some)
    assert got == (want, True), "a journalctl that never ends held the read"


def test_a_journal_that_floods_or_never_ends_a_line_is_bounded_in_bytes_and_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kimi_supervisor.ports import gpu

    monkeypatch.setattr(gpu, "KMSG_MAX_BYTES", 4 << 20)
    line = "NVRM: Xid (PCI:0000:18:00): 31, pid=1, MMU Fault"
    # Cut at the bound in bytes (well before the 60 s given), each code kept once.
    assert gpu.journal_xids(["yes", line], 60, probe=None) == ({"0000:18:00": [31]}, True)
    assert gpu.journal_xids(["head", "-c", "8000000", "/dev/zero"], 60, probe=None) == ({}, True)


def test_a_kmsg_that_is_not_the_kernels_log_is_no_reading(tmp_path: Path) -> None:
    """A container's /dev/kmsg may be /dev/null, or a file: its nothing is no "no Xid", and
    the journal is asked instead."""
    from kimi_supervisor.ports import gpu

    fake = tmp_path / "kmsg"
    fake.write_bytes(b"")
    assert gpu.kernel_xids(str(fake)) == (None, False)
    assert gpu.kernel_xids("/dev/null") == (None, False)
    assert gpu.kernel_xids(str(fake), device=False) == ({}, False)  # read as given


class Fabric(Health):
    """Health's three GPUs with links: GPU 0 an SXM card (2 NVLink 4 links, one active, the
    link at Gen1 while idle), GPU 2 a PCIe card whose NVLink calls are not supported and whose
    width read fails."""

    def nvmlDeviceGetName(self, h: object) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: object) -> int:
        return 1

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: object) -> int:
        if h == ("handle", 2):
            raise NVMLError("Unknown Error")
        return 16

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: object) -> int:
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: object) -> int:
        return 16

    def nvmlDeviceGetNvLinkState(self, h: object, link: int) -> int:
        if h == ("handle", 2):
            raise self.NVMLError_NotSupported()
        return 1 if link == 0 else 0

    def nvmlDeviceGetNvLinkVersion(self, h: object, link: int) -> int:
        return 4


def test_the_fabric_is_read_per_gpu_with_every_error_as_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kimi_supervisor.analysis.sizes import limit

    monkeypatch.setitem(sys.modules, "pynvml", Fabric())
    got = NvmlGpu().fabric()
    sxm, lost, pcie = got["gpus"]
    assert sxm["pcie"] == {"gen": 1, "width": 16, "max_gen": 5, "max_width": 16}
    assert sxm["nvlink"] == {"links": 2, "active": 1, "version": 4} and sxm["unread"] == []
    assert "GPU is lost" in lost["unread"][0] and "pcie" not in lost
    assert pcie["nvlink"] == {"links": 0, "active": 0, "version": None}
    assert pcie["pcie"]["width"] is None and pcie["unread"] == ["PCIe width: Unknown Error"]
    # GPU 2 reaches the others over PCIe: the limit is the slowest PCIe link, at its maximum
    # (an idle link trains down to Gen1), not GPU 0's one NVLink.
    assert limit(got) == {"gbps": 63.008, "said": "GPU 0: PCIe Gen5 x16 (not every GPU has an "
                          "active NVLink): 63.0 GB/s per direction"}  # fmt: skip
    assert limit({"gpus": [sxm]})["said"] == (
        "GPU 0: NVLink 4, 1 active links x 25 GB/s: 25.0 GB/s per direction")  # fmt: skip
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no pynvml at all: said, not raised
    assert "pynvml module is missing" in NvmlGpu().fabric()["error"]


class Counters(Health):
    """The GPUs' own counters: the first spins (as measured on an H100) beside another user's
    process and one of another PID namespace (PID 0), the second is lost, the third cannot say
    its utilization nor its processes; no GPU has NVLink."""

    def nvmlDeviceGetComputeRunningProcesses(self, h: object) -> list[Any]:
        if h == ("handle", 2):
            raise NVMLError("Unknown Error")
        return [types.SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in (4242, 0)]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: object) -> list[Any]:
        return [types.SimpleNamespace(pid=4242, usedGpuMemory=None)]

    NVML_CLOCK_SM = 1
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139

    def nvmlDeviceGetUtilizationRates(self, h: object) -> Any:
        if h == ("handle", 2):
            raise self.NVMLError_NotSupported()
        return types.SimpleNamespace(gpu=100, memory=0)

    def nvmlDeviceGetPowerUsage(self, h: object) -> int:
        return 125_072  # mW

    def nvmlDeviceGetClockInfo(self, h: object, clock: int) -> int:
        return 1980

    def nvmlDeviceGetPcieThroughput(self, h: object, counter: int) -> int:
        return (1355, 412)[counter]  # KB/s

    def nvmlDeviceGetFieldValues(self, h: object, fields: list[tuple[int, int]]) -> Any:
        assert all(scope == 0xFFFFFFFF for _f, scope in fields), "every link's sum"
        raise self.NVMLError_NotSupported()


def test_the_gpus_own_counters_are_read_and_what_cannot_be_read_is_said_never_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", Counters())
    spin, lost, mute = NvmlGpu().activity([0, 1, 2])
    assert (spin.util_gpu, spin.util_memory, spin.power_w) == (100.0, 0.0, 125.072)
    assert spin.pcie_mb_s == pytest.approx(1.767) and spin.sm_clock_mhz == 1980
    assert spin.nvlink_kib is None and spin.unread == (), "no NVLink is not unread"
    assert lost.util_gpu is None and "GPU is lost" in lost.unread[0]
    assert mute.util_memory is None and "utilization: not supported by this GPU" in mute.unread
    assert spin.pids == (0, 4242), "every process NVML lists, once"
    assert mute.pids is None and "processes: Unknown Error" in mute.unread, "unread, not none"


class Sampled(Counters):
    """Counters' GPUs, with NVML's per-process samples: GPU 0 has two of vLLM's worker (PID
    102) and one of another's job, GPU 2 none since the last (NOT_FOUND); once `unsupported`,
    no GPU can sample processes. Each call records the timestamp it was asked from."""

    class NVMLError_NotFound(NVMLError):
        pass

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[object, int]] = []
        self.unsupported = False

    def nvmlDeviceGetProcessUtilization(self, h: object, since: int) -> list[Any]:
        self.asked.append((h, since))
        if self.unsupported:
            raise self.NVMLError_NotSupported()
        if h == ("handle", 2):
            raise self.NVMLError_NotFound()
        row = types.SimpleNamespace
        return [row(pid=102, timeStamp=since + 10, smUtil=100, memUtil=0, encUtil=0, decUtil=0),
                row(pid=102, timeStamp=since + 20, smUtil=99, memUtil=3, encUtil=0, decUtil=0),
                row(pid=4242, timeStamp=since + 15, smUtil=50, memUtil=60, encUtil=0,
                    decUtil=0)]  # fmt: skip


def test_each_processs_samples_are_read_since_the_last_reading_and_vllms_own_told_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kimi_supervisor.decide.liveness import foreign_on, gpu_said

    nv = Sampled()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    gpu = NvmlGpu()
    first, lost, none = gpu.activity([0, 1, 2])
    assert first.samples == ((102, 100.0, 3.0), (4242, 50.0, 60.0)), "each PID's highest"
    assert none.samples == () and lost.samples is None, "none taken is not unsampled"
    assert first.unread == (), "samples are no counter: none unread"
    gpu.activity([0])
    assert nv.asked[-1] == (("handle", 0), 20), "from the newest sample read, not again"
    nv.unsupported = True
    (cannot,) = gpu.activity([0])
    assert cannot.samples is None and cannot.unread == ()
    mine = foreign_on(first, {102})
    assert mine.own == (100.0, 3.0) and foreign_on(first, {7}).own is None
    assert foreign_on(none, {102}).own is None, "no sample of vLLM's: the counters judge"
    assert "PCIe 1.767 MB/s; vLLM's: busy 100 %, memory 3 %, shared with" in gpu_said(mine, None)


def sample(pid: Any, ts: Any, sm: Any = 100, mem: Any = 0) -> Any:
    return types.SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm, memUtil=mem, encUtil=0,
                                 decUtil=0)  # fmt: skip


ODD_SAMPLES = {
    "a sample read raising a plain error leaves the counters read": RuntimeError("odd"),
    "a sample read answering None leaves the counters read": None,
    "a sample row with no timestamp leaves the counters read": [types.SimpleNamespace(pid=102)],
    "a sample row whose pid is not a number leaves the counters read": [sample(None, 10)],
}


@pytest.mark.parametrize("answer", ODD_SAMPLES.values(), ids=list(ODD_SAMPLES))
def test_an_odd_sample_answer_never_costs_the_gpus_counters(
    monkeypatch: pytest.MonkeyPatch, answer: Any
) -> None:
    class Odd(Sampled):
        def nvmlDeviceGetProcessUtilization(self, h: object, since: int) -> list[Any]:
            if isinstance(answer, BaseException):
                raise answer
            return answer  # type: ignore[no-any-return]

    monkeypatch.setitem(sys.modules, "pynvml", Odd())
    (g,) = NvmlGpu().activity([0])
    assert g.util_gpu == 100.0 and g.util_memory == 0.0 and g.samples is None, g


def test_a_sample_stamped_ahead_of_a_clock_set_back_does_not_end_sampling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVML stamps samples with the wall clock (µs): a clock set back an hour after one (NTP, an
    operator, an RTC corrected at boot) must not hide every later sample until it catches up
    (the GPU's counters, with an ended job's bursts in them, would judge again)."""
    import time

    now_us = int(time.time() * 1e6)

    class Clocked(Sampled):
        clock = now_us + 3600 * 10**6  # the first sample, stamped an hour ahead

        def nvmlDeviceGetProcessUtilization(self, h: object, since: int) -> list[Any]:
            self.asked.append((h, since))
            if self.clock <= since:
                raise self.NVMLError_NotFound()
            return [sample(102, self.clock, 100, 0)]

    nv = Clocked()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    port = NvmlGpu()
    (first,) = port.activity([0])
    assert first.samples == ((102, 100.0, 0.0),)
    nv.clock = now_us  # the clock set back: samples stamped now again
    for _ in range(2):
        nv.clock += 15 * 10**6
        (g,) = port.activity([0])
        assert g.samples == ((102, 100.0, 0.0),), f"asked from {nv.asked[-1][1]}"


def test_the_simulated_host_lists_each_gpus_processes_with_its_counters_as_nvml_does(
    tmp_path: Path,
) -> None:
    from kimi_supervisor.sandbox import simgpu
    from kimi_supervisor.sandbox.simreader import SimGpu

    root = simgpu.create_host(tmp_path / "sim", 2)
    context = simgpu.Context(root, 1, 100)  # another's process, as `sandbox ghost` plants one
    gpu = SimGpu(root)
    try:
        idle, held = gpu.activity([0, 1])
        assert (idle.pids, held.pids) == ((), (os.getpid(),))
        assert (idle.samples, held.samples) == ((), ((os.getpid(), 0.0, 0.0),)), "each sampled"
        simgpu.set_activity(root, [1], "spin", pid=os.getpid() + 1)  # another's kernel
        (_idle, beside) = gpu.activity([0, 1])
        assert beside.util_gpu == 100.0 and beside.samples == ((os.getpid(), 0.0, 0.0),)
        simgpu.set_activity(root, [1], "spin")  # the engine's own
        assert gpu.activity([1])[0].samples == ((os.getpid(), 100.0, 0.0),)
        (sample,) = gpu.sample([1])
        assert [p.pid for p in sample.processes] == [os.getpid()], "as the reading lists"
    finally:
        context.free()
        gpu.close()
