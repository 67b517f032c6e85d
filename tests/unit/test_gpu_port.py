"""The NVML port over a stand-in pynvml: every error of every call is GpuUnavailable (data for
the loop, never an exception that ends it), and a driver that comes back is picked up."""

from __future__ import annotations

import errno
import sys
import types
from collections.abc import Iterator
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
