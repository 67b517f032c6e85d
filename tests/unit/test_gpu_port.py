"""The NVML port over a stand-in pynvml: every error of every call is GpuUnavailable (data for
the loop, never an exception that ends it), and a driver that comes back is picked up."""

from __future__ import annotations

import errno
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
    assert kernel_xids(str(log)) == {"0000:18:00": [79], "0000:9a:00": [63]}
    assert _pci_id(b"00000000:9A:00.0") == "0000:9a:00" and _pci_id("0000:18:00") == "0000:18:00"
    assert kernel_xids(str(tmp_path / "none")) is None  # cannot be read: not "no Xid"


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
    unread = judge([GpuHealth(3, unread=("row remapping: not supported by this GPU",))])
    assert unread.healthy and unread.unread == ["GPU 3: row remapping: not supported by this GPU"]
