"""The daemon's status as typed plain data: what `kimi-mode status`, the live switch display,
`/metrics` and sd_notify's STATUS= all show. The loop builds it (kimi_supervisor/loop/publish.py);
the wire carries `Status.model_dump(mode="json")` and kimi-mode reads it back with
`Status.model_validate` (kimi_supervisor/cli/render.py), so both ends share one definition, and
kimi-mode loads none of the loop to read it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, computed_field

from kimi_supervisor.model import at_baseline


class Holder(BaseModel):
    pid: int
    name: str
    used_mib: int | None = None


class GpuStatus(BaseModel):
    index: int
    used_mib: int
    baseline_mib: int
    tolerance_mib: int
    total_mib: int | None = None
    holders: list[Holder] = Field(default_factory=list)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def clean(self) -> bool:
        return at_baseline(self.used_mib, self.baseline_mib, self.tolerance_mib, self.holders)


class UnitStatus(BaseModel):
    name: str
    active_state: str = "unknown"
    sub_state: str = "unknown"
    main_pid: int = 0
    running_mode: str | None = None
    health: int = -1


class ProgressStatus(BaseModel):
    phase: str
    percent: float | None = None
    text: str


class DaemonInfo(BaseModel):
    pid: int
    started_at: str
    loop_heartbeat_age_s: float | None = None


class Status(BaseModel):
    desired_mode: str
    mode: str | None = None
    state: str
    state_since: str  # times are ISO 8601 strings, as every message on the wire carries them
    status_line: str
    mode_since: str | None = None
    transition: dict[str, Any] | None = None
    progress: ProgressStatus | None = None
    unit: UnitStatus
    gpus: list[GpuStatus] = Field(default_factory=list)
    gpus_age_s: float | None = None
    baseline_provisional: bool = False
    last_teardown: dict[str, Any] | None = None
    failures_in_window: int = 0
    next_attempt_in_s: float | None = None
    warnings: list[str] = Field(default_factory=list)
    last_intrusion: dict[str, Any] | None = None
    profile_until: str | None = None
    profile_left_s: int | None = None
    capture: dict[str, Any] | None = None
    # While vLLM loads: what past loads of the same mode and argv predict (eta.py).
    eta: dict[str, Any] | None = None
    daemon: DaemonInfo
