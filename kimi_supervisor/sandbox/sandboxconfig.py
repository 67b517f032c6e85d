"""A sandbox's config: config/sandbox.toml with the sandbox's paths and ports filled in, and the
project's files it is made from."""

from __future__ import annotations

import os
import socket
import tomllib
from pathlib import Path
from typing import Any

from kimi_supervisor.config import Config

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class SandboxError(Exception):
    pass


def project_file(*parts: str) -> Path:
    path = PROJECT_ROOT.joinpath(*parts)
    if not path.exists():
        raise SandboxError(
            f"{path} is missing: run from a checkout of kimi-supervisor "
            "installed with `pip install -e .`"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def extra_paths() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def fill(value: Any, sandbox: str) -> Any:
    if isinstance(value, str):
        return value.replace("{sandbox}", sandbox)
    if isinstance(value, list):
        return [fill(v, sandbox) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, sandbox) for k, v in value.items()}
    return value


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def render_config(
    root: Path,
    gpus: int,
    port: int,
    *,
    bus_address: str,
    real_gpus: bool = False,
    overrides: dict[str, Any] | None = None,
) -> Config:
    raw = tomllib.loads(project_file("config", "sandbox.toml").read_text())
    raw = fill(merge(raw, overrides or {}), str(root))
    if real_gpus:
        # The host's own GPUs through NVML; the fake vLLM and ghosts allocate with CUDA.
        raw["gpus"] = {"backend": "nvml", "managed": list(range(gpus)), "tolerance_mib": 256}
    raw.setdefault("vllm", {})["port"] = port
    raw.setdefault("metrics", {})["port"] = free_port()
    raw["systemd"]["bus_address"] = bus_address
    cmd = raw["vllm"]["command"]
    if "--tensor-parallel-size" in cmd:
        cmd[cmd.index("--tensor-parallel-size") + 1] = str(gpus)
    return Config.model_validate(raw)
