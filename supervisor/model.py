"""Names shared by every layer: modes, teardown steps and outcomes, and the report models.

Plain data only; nothing here has side effects.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from pydantic import BaseModel, Field


class Mode(enum.StrEnum):
    PRODUCTION = "production"
    PROFILE = "profile"


class Step(enum.StrEnum):
    """Teardown steps, in the order they escalate."""

    STOP_UNIT = "stop_unit"
    KILL_CGROUP = "kill_cgroup"
    KILL_STRAYS = "kill_strays"
    KILL_GPU_HOLDERS = "kill_gpu_holders"
    WAIT_RELEASE = "wait_release"
    HOST_LEFTOVERS = "host_leftovers"
    VERIFY = "verify"


class Outcome(enum.StrEnum):
    CLEAN = "clean"
    STUCK = "stuck"


class Evidence(enum.StrEnum):
    """Why a process was judged to belong to the teardown's targets, strongest first."""

    UNIT_CGROUP = "in the unit's cgroup"
    ESCAPED_UNIT = "was in the unit's process tree when the teardown began"
    LISTENS_ON_PORT = "listens on vLLM's port"
    VLLM_SIGNATURE = "carries vLLM's signature and uses a managed GPU"
    NVML_LISTED = "NVML lists it as a process on a managed GPU"
    RESPAWNS = "its children came back on a managed GPU after being killed"
    DEVICE_FD = "holds a managed /dev/nvidiaN open while memory is unexplained"


def utcnow() -> datetime:
    return datetime.now(UTC)


class ProcessDescription(BaseModel):
    pid: int
    start_time: float = Field(description="process start, seconds since the epoch")
    state: str = ""
    comm: str = ""
    cmdline: list[str] = Field(default_factory=list)
    cgroup: str = ""


class KillRecord(BaseModel):
    """One signal sent: the audit trail of a teardown."""

    at: datetime
    signal: str
    step: Step
    evidence: Evidence
    reason: str
    process: ProcessDescription
    result: str = Field(description="delivered, already gone, or why it was not sent")


class DeviceReading(BaseModel):
    index: int
    used_mib: int
    baseline_mib: int
    tolerance_mib: int
    processes: list[int] = Field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.used_mib <= self.baseline_mib + self.tolerance_mib and not self.processes


class StepReport(BaseModel):
    step: Step
    started_at: datetime
    duration_s: float
    skipped: bool = False
    note: str = ""
    devices_after: list[DeviceReading] = Field(default_factory=list)


class RemainingHolder(BaseModel):
    process: ProcessDescription
    unit: str = ""
    devices: list[int] = Field(default_factory=list)
    not_cleared_by: Step
    why: str


class TeardownReport(BaseModel):
    unit: str
    started_at: datetime
    duration_s: float = 0.0
    outcome: Outcome = Outcome.STUCK
    steps: list[StepReport] = Field(default_factory=list)
    kills: list[KillRecord] = Field(default_factory=list)
    devices: list[DeviceReading] = Field(default_factory=list)
    remaining: list[RemainingHolder] = Field(default_factory=list)
    shm_removed: list[str] = Field(default_factory=list)
    diagnosis: str = ""
    next_action: str = ""
