"""The GPU backend a config names: real NVML, or the simulated GPU host's reader."""

from __future__ import annotations

from supervisor.config import GpusConfig
from supervisor.ports.gpu import GpuPort, NvmlGpu
from supervisor.ports.simgpu import SimGpu


def open_gpu(gpus: GpusConfig) -> GpuPort:
    if gpus.backend == "nvml":
        return NvmlGpu()
    assert gpus.sim_dir is not None  # GpusConfig refuses backend "sim" without sim_dir
    return SimGpu(gpus.sim_dir)
