"""The composition root's parts that every `kimi-supervisor` command shares: which config, and
the ports it names (the systemd manager, the GPU backend)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi_supervisor.config import Config

if TYPE_CHECKING:
    from kimi_supervisor.ports.bounded import IoWorker
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
    return systemd_port(config), open_gpu(config)


def systemd_port(config: Config) -> PystemdSystemd:
    from kimi_supervisor.ports.systemd import PystemdSystemd

    return PystemdSystemd(config.systemd.scope, config.systemd.bus_address)


def open_gpu(config: Config, worker: IoWorker | None = None) -> GpuPort:
    """The GPU backend the config names: real NVML, or a simulated GPU host's reader (the
    sandbox's, chosen here and nowhere else, so that no other wing imports the sandbox). Its
    calls run on `worker` (the daemon's: a process of its own), else on a thread."""
    from kimi_supervisor.ports.gpu import BoundedGpu, NvmlGpu

    inner: GpuPort
    made_by: tuple[Any, tuple[Any, ...]]
    if config.gpus.backend == "nvml":
        inner, made_by = NvmlGpu(), (NvmlGpu, ())
    else:
        from kimi_supervisor.sandbox.simreader import SimGpu

        assert config.gpus.sim_dir is not None  # GpusConfig refuses "sim" without sim_dir
        inner, made_by = SimGpu(config.gpus.sim_dir), (SimGpu, (str(config.gpus.sim_dir),))
    if worker is None:
        return BoundedGpu(inner, config.gpus.timeout_s)
    return BoundedGpu(inner, config.gpus.timeout_s, worker, made_by=made_by)


def managed_indices(config: Config, gpu: GpuPort) -> list[int]:
    return list(config.gpus.managed) or list(range(gpu.device_count()))
