"""The baseline footprint of each managed GPU: what memory.used reads with no process on it.

Set in config (`gpus.baseline_mib`) or calibrated when NVML shows no compute process on any
managed device, and persisted (in the state file) with the time and the driver version. A driver
upgrade changes the footprint, so a baseline from another driver version is calibrated again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kimi_supervisor.model import utcnow
from kimi_supervisor.ports.gpu import GpuPort
from kimi_supervisor.store.state import Baseline, StateStore, with_baseline


class BaselineError(Exception):
    pass


def baseline_path(state_dir: Path) -> Path:
    return StateStore(state_dir).path


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
    StateStore(state_dir).update(lambda st: with_baseline(st, baseline))


def load(state_dir: Path) -> Baseline | None:
    """The persisted baseline; an unusable state file is moved aside by the store."""
    return StateStore(state_dir).read()[0].baseline


def resolve(
    gpu: GpuPort,
    indices: list[int],
    fixed: dict[str, int],
    *,
    state_dir: Path,
    stored_in: Callable[[Path], Baseline | None] = load,
) -> tuple[dict[int, int], Baseline | None]:
    """Baseline MiB per managed GPU: fixed in config first, then persisted (same driver, read
    by `stored_in`: the daemon's reads on its state folder's worker), else calibrated now;
    with the calibration, for the caller to persist (`save`, or the daemon's guarded write: a
    full disk must not stop a baseline measured in memory from being used)."""
    out = {i: fixed[str(i)] for i in indices if str(i) in fixed}
    missing = [i for i in indices if i not in out]
    if not missing:
        return out, None
    stored = stored_in(state_dir)
    if (
        stored
        and stored.driver_version == gpu.driver_version()
        and all(i in stored.devices for i in missing)
    ):
        return out | {i: stored.devices[i] for i in missing}, None
    fresh = calibrate(gpu, indices)
    return out | {i: fresh.devices[i] for i in missing}, fresh
