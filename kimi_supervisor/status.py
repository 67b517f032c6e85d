"""The daemon's status as typed plain data: what `kimi-mode status`, the live switch display,
`/metrics` and sd_notify's STATUS= all show. The loop builds it (kimi_supervisor/loop/publish.py);
the wire carries `Status.model_dump(mode="json")` and kimi-mode reads it back with
`Status.model_validate` (kimi_supervisor/cli/render.py), so both ends share one definition, and
kimi-mode loads none of the loop to read it.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, computed_field

from kimi_supervisor.model import CapturePhase, Mode, Outcome, Role, State, at_baseline


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
        return at_baseline(
            self.used_mib, self.baseline_mib, self.tolerance_mib, holders=self.holders
        )


class UnitStatus(BaseModel):
    name: str
    active_state: str = "unknown"
    sub_state: str = "unknown"
    # "not-found": the unit runs with its file gone (moved away, then a daemon-reload); vLLM
    # serves on, and the next start fails until the file is back.
    load_state: str = "unknown"
    main_pid: int = 0
    running_mode: str | None = None
    # running_mode's vLLM runs an earlier config's argv (the config was edited and reloaded).
    argv_stale: bool = False
    health: int = -1


class ProgressStatus(BaseModel):
    phase: str
    percent: float | None = None
    text: str


class DaemonInfo(BaseModel):
    pid: int
    started_at: str
    loop_heartbeat_age_s: float | None = None


class TransitionStatus(BaseModel):
    """The mode switch in progress (the persisted TransitionRecord, as the wire carries it)."""

    id: str
    target: Mode
    previous: Mode | None = None
    kind: str
    reason: str = ""
    requested_by: str = ""
    started_at: str
    step: str
    step_changed_at: str
    start_deadline_at: str | None = None


class EtaStatus(BaseModel):
    """While vLLM loads: what past loads of the same mode and argv predict (decide/eta.py)."""

    expected_s: float
    remaining_s: float
    elapsed_s: float
    past_loads: int
    slower_than_past: bool
    text: str


class DowntimeStatus(BaseModel):
    """A switch's unavailable window (decide/downtime.py): the one under way, else the last.
    `window_s`: from the old vLLM's last /health 200 to the new one's first (so far, while
    under way; null when nothing served before). `parts`: the seconds of each part measured."""

    transition: str
    target: Mode
    under_way: bool
    window_s: float | None = None
    part: str | None = None  # the part under way
    parts: dict[str, float] = Field(default_factory=dict)
    remaining_s: float | None = None  # under way: the rest, by past switches' parts
    at: str  # when it was last measured
    text: str


class WarmStatus(BaseModel):
    """Before a switch's teardown, while the old mode serves: the next mode's model files read
    into the page cache (loop/warming.py), under way or done."""

    under_way: bool
    folder: str = ""  # where the files were found ("" when none was)
    files: int = 0  # to read
    bytes: int = 0  # to read
    read_bytes: int = 0  # read so far
    skipped: list[str] = Field(default_factory=list)  # files that did not fit
    skipped_bytes: int = 0
    budget_bytes: int = 0  # warm.max_ram_share of MemAvailable when it began
    took_s: float = 0.0
    # "aborted" (a --force switch, a stop, the old vLLM's exit), "timeout", "" when it ran out
    stopped: str = ""
    # Files vLLM reads that were not opened as they were judged ("name: why"): a link out of
    # the tree, a FIFO, a device or a socket, another inode than the listing saw.
    refused: list[str] = Field(default_factory=list)
    # Reads stuck in the kernel (a hung mount) when the warming gave up: their reader process
    # is left, in `left_in`, and never waited for.
    abandoned: int = 0
    reader_pid: int | None = None  # the reader left, while abandoned
    left_in: str = ""  # the scope the reader was left in
    text: str


class CaptureStatus(BaseModel):
    capture: str  # its id
    phase: CapturePhase
    started_at: str
    seconds: float | None = None
    then: str
    bytes: int
    by: str


class KillSummary(BaseModel):
    pid: int
    comm: str
    cmdline: str
    step: str
    evidence: str
    result: str


class RemainingSummary(BaseModel):
    pid: int
    name: str
    role: Role
    devices: list[int] = Field(default_factory=list)
    why: str = ""
    check: str = ""


class FailureStatus(BaseModel):
    """The last start that failed, until one succeeds: what happened, what vLLM said about it
    (decide/cause.py), and where to read all of its output."""

    at: str
    mode: Mode
    reason: str
    said: list[str] = Field(default_factory=list)
    more: str = ""


class RolledBackStatus(BaseModel):
    """The last switch that failed and was rolled back, kept until another switch is asked
    for: a `kimi-mode wait MODE` that joins after the rollback still learns that the switch to
    MODE failed, and why (its end, heard by those who followed it)."""

    mode: Mode  # the mode the switch was to
    at: str
    reason: str  # the failed switch's end: why, and what it rolls back to
    transition: str  # the failed switch's id


class GpuHealthStatus(BaseModel):
    """The managed GPUs' health as last read before a load (decide/gpuhealth.py)."""

    checked_at: str
    # "healthy", "warnings" (never a refusal by itself), "failing", or "unread" (no reading:
    # nothing decided on it).
    verdict: str
    text: str
    policy: str  # gpus.health_check when it was read
    refused: bool = False  # the start was refused for it
    gpus: list[dict[str, object]] = Field(default_factory=list)
    unread: list[str] = Field(default_factory=list)


class LivenessStatus(BaseModel):
    """What the liveness probe last saw of the serving vLLM (loop/liveness.py)."""

    # "ok"; "absent": /metrics answered with no vllm:* series (never read as idle);
    # "unreachable": /metrics did not answer in time.
    metrics: str | None = None
    running: float | None = None  # vllm:num_requests_running (null: no reading)
    waiting: float | None = None  # vllm:num_requests_waiting
    tokens: float | None = None  # vllm:generation_tokens_total
    steps: float | None = None  # vllm:iteration_tokens_total's count: the engine's steps
    cpu_s: float | None = None  # vLLM's processes' CPU time, summed
    stopped: list[str] = []  # vLLM's processes found stopped (state T)
    doubt: str | None = None  # one signal said hung and the other did not (not hung)
    doubt_since: str | None = None  # since when, with no proof of progress since
    judging: str | None = None  # why no verdict is made now (a capture)
    canary_at: str | None = None
    canary_ok: bool | None = None
    canary_answered: bool | None = None  # false: no answer within canary_timeout_s
    canary_s: float | None = None
    canary_tokens: int | None = None


class StuckStatus(BaseModel):
    """A STUCK episode: from the first teardown that could not make the GPUs clean until one
    does. It lasts through its retries (and through any switch asked for meanwhile)."""

    since: str
    retries: int = 0  # teardowns tried again since
    retrying: bool = False  # one runs now


class TeardownSummary(BaseModel):
    outcome: Outcome
    started_at: str
    duration_s: float
    kills: list[KillSummary] = Field(default_factory=list)
    diagnosis: str = ""
    next_action: str = ""
    remaining: list[RemainingSummary] = Field(default_factory=list)


class IntruderStatus(BaseModel):
    pid: int
    gpu: int
    name: str


class IntrusionStatus(BaseModel):
    """A process outside vLLM's unit that took a managed GPU while vLLM loaded."""

    at: str
    what: str
    incident: str = "gpu_intrusion"
    processes: list[IntruderStatus] = Field(default_factory=list)


class BundleStatus(BaseModel):
    """The newest incident bundle (store/bundle.py): what the daemon kept at a STUCK, a FAILED
    or a hang restart, in one root-only file under the state directory. `error`: the last one
    tried could not be written (the daemon went on as it would have anyway)."""

    path: str | None = None  # the newest bundle written; null if none is known
    at: str | None = None  # when it was written (ISO); null for one found at start
    trigger: str | None = None  # stuck, failed or hang
    size: int | None = None  # its bytes
    cut: list[str] = Field(default_factory=list)  # parts cut to their caps
    unread: list[str] = Field(default_factory=list)  # what could not be read into it
    error: str | None = None  # why the last bundle tried was not written
    error_at: str | None = None
    folder: str = ""  # where they are kept (state.dir/incidents)


class Status(BaseModel):
    desired_mode: Mode
    mode: Mode | None = None
    state: State
    state_since: str  # times are ISO 8601 strings, as every message on the wire carries them
    status_line: str
    mode_since: str | None = None
    transition: TransitionStatus | None = None
    progress: ProgressStatus | None = None
    unit: UnitStatus
    gpus: list[GpuStatus] = Field(default_factory=list)
    gpus_age_s: float | None = None
    baseline_provisional: bool = False
    last_teardown: TeardownSummary | None = None
    failures_in_window: int = 0
    next_attempt_in_s: float | None = None
    stuck: StuckStatus | None = None
    # What the daemon waits for and cannot go on without (the GPU driver, systemd); null if none.
    waiting_for: str | None = None
    liveness: LivenessStatus | None = None
    gpu_health: GpuHealthStatus | None = None
    last_failure: FailureStatus | None = None
    rolled_back: RolledBackStatus | None = None
    warnings: list[str] = Field(default_factory=list)
    last_intrusion: IntrusionStatus | None = None
    incident_bundle: BundleStatus | None = None
    profile_until: str | None = None
    profile_left_s: int | None = None
    capture: CaptureStatus | None = None
    eta: EtaStatus | None = None
    downtime: DowntimeStatus | None = None
    warm: WarmStatus | None = None  # the switch's warming, while it runs or its switch does
    # Set while the serving vLLM runs an earlier config's argv: what differs and what to run.
    restart_needed: str | None = None
    # vLLM's last lines of output while it does not serve (loading, failed, backing off).
    output_tail: list[str] = Field(default_factory=list)
    output_where: str = ""  # where all of it is read (a journalctl command, or a file)
    daemon: DaemonInfo
