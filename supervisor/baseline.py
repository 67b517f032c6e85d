"""The baseline footprint of each managed GPU: what memory.used reads with no process on it.

Set in config (`gpus.baseline_mib`) or calibrated when NVML shows no compute process on any
managed device, and persisted with the time and the driver version. A driver upgrade changes the
footprint, so a baseline from another driver version is calibrated again.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel, ValidationError

from supervisor.model import utcnow
from supervisor.ports.gpu import GpuPort


class BaselineError(Exception):
    pass


class Baseline(BaseModel):
    driver_version: str
    calibrated_at: datetime
    devices: dict[int, int]  # GPU index -> MiB


def baseline_path(state_dir: Path) -> Path:
    return state_dir / "baseline.json"


def calibrate(gpu: GpuPort, indices: list[int]) -> Baseline:
    samples = gpu.sample(indices)
    busy = [(s.index, [p.pid for p in s.processes]) for s in samples if s.processes]
    if busy:
        detail = "; ".join(f"GPU {i}: PIDs {', '.join(map(str, pids))}" for i, pids in busy)
        raise BaselineError(
            f"refusing to calibrate while compute processes run ({detail}): "
            "stop them (or run a teardown) and calibrate again"
        )
    return Baseline(
        driver_version=gpu.driver_version(),
        calibrated_at=utcnow(),
        devices={s.index: s.used_mib for s in samples},
    )


def save(state_dir: Path, baseline: Baseline) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = baseline_path(state_dir)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(baseline.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(state_dir: Path) -> Baseline | None:
    path = baseline_path(state_dir)
    try:
        return Baseline.model_validate(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, ValidationError):
        # Unreadable: moved aside and calibrated again rather than trusted.
        path.rename(path.with_name(f"{path.name}.corrupt-{utcnow():%Y%m%dT%H%M%S}"))
        return None


def resolve(
    gpu: GpuPort, indices: list[int], fixed: dict[str, int], state_dir: Path
) -> dict[int, int]:
    """Baseline MiB per managed GPU: fixed in config first, then persisted (same driver), else
    calibrated now and persisted."""
    out = {i: fixed[str(i)] for i in indices if str(i) in fixed}
    missing = [i for i in indices if i not in out]
    if not missing:
        return out
    stored = load(state_dir)
    if (
        stored
        and stored.driver_version == gpu.driver_version()
        and all(i in stored.devices for i in missing)
    ):
        return out | {i: stored.devices[i] for i in missing}
    fresh = calibrate(gpu, indices)
    save(state_dir, fresh)
    return out | {i: fresh.devices[i] for i in missing}
