"""The composition root's parts that every `kimi-supervisor` command shares: which config, and
the ports it names (the systemd manager, the GPU backend)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kimi_supervisor.config import Config

if TYPE_CHECKING:
    from kimi_supervisor.ports.gpu import GpuPort
    from kimi_supervisor.ports.systemd import PystemdSystemd


def config_path(arg: str | None) -> Path:
    path = (
        arg
        or os.environ.get("KIMI_SUPERVISOR_CONFIG")
        or "/etc/kimi-supervisor/kimi-supervisor.toml"
    )
    return Path(path)


def ports(config: Config) -> tuple[PystemdSystemd, GpuPort]:
    """The composition root: the systemd manager and the GPU backend the config names."""
    from kimi_supervisor.ports.systemd import PystemdSystemd

    systemd = PystemdSystemd(config.systemd.scope, config.systemd.bus_address)
    return systemd, open_gpu(config)


def open_gpu(config: Config) -> GpuPort:
    """The GPU backend the config names: real NVML, or a simulated GPU host's reader (the
    sandbox's, chosen here and nowhere else, so that no other wing imports the sandbox)."""
    from kimi_supervisor.ports.gpu import BoundedGpu, NvmlGpu

    inner: GpuPort
    if config.gpus.backend == "nvml":
        inner = NvmlGpu()
    else:
        from kimi_supervisor.sandbox.simreader import SimGpu

        assert config.gpus.sim_dir is not None  # GpusConfig refuses "sim" without sim_dir
        inner = SimGpu(config.gpus.sim_dir)
    return BoundedGpu(inner, config.gpus.timeout_s)


def managed_indices(config: Config, gpu: GpuPort) -> list[int]:
    return list(config.gpus.managed) or list(range(gpu.device_count()))
