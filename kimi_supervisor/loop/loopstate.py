"""The daemon's loop state: everything it remembers between wake-ups, in one place.

Only the loop thread writes it. Connection threads never read it: they read the status the loop
publishes (kimi_supervisor/loop/publish.py).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kimi_supervisor.decide.downtime import Stopwatch
from kimi_supervisor.decide.eta import Estimate
from kimi_supervisor.decide.liveness import Cpu
from kimi_supervisor.decide.policy import Purpose
from kimi_supervisor.decide.progress import Progress
from kimi_supervisor.decide.reconcile import Intent, Memory, Observed
from kimi_supervisor.model import Mode, State, TeardownReport, utcnow
from kimi_supervisor.status import (
    BundleStatus,
    DowntimeStatus,
    FailureStatus,
    GpuHealthStatus,
    IntrusionStatus,
    LivenessStatus,
    RolledBackStatus,
    WarmStatus,
)
from kimi_supervisor.store.state import TransitionRecord

if TYPE_CHECKING:
    from kimi_supervisor.capture.job import Capture


@dataclass(frozen=True)
class Serving:
    mode: Mode
    pid: int
    since: datetime


@dataclass
class Job:
    """A teardown running on the job thread, and what follows it (policy.after_teardown)."""

    purpose: Purpose
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)
    attempt: int = 1
    cause: str = ""  # what went wrong, for the failure that may follow
    # A vLLM serves until now: /health is asked once more just before the unit's stop, so that
    # its unavailable window opens at its real last answer.
    probe: bool = False
    # The next vLLM's argv, whose model files are read into the page cache first, while the
    # old vLLM still serves (loop/warming.py).
    warm_argv: list[str] | None = None
    # Set to stop the warming before its teardown (a --force switch, a stop, the old vLLM's
    # exit), and what set it (said in the warming's end).
    stop_warm: threading.Event = field(default_factory=threading.Event)
    stop_warm_why: str = ""


@dataclass
class LoopState:
    state: State = State.BOOTING
    state_since: datetime = field(default_factory=utcnow)
    desired: Mode = Mode.PRODUCTION
    profile_until: datetime | None = None
    # The switch in progress, and one found persisted at boot (redone or resumed).
    transition: TransitionRecord | None = None
    interrupted: TransitionRecord | None = None
    inherited_id: str = ""  # the transition found persisted at boot (it may be recorded already)
    intent: Intent | None = None
    job: Job | None = None
    serving: Serving | None = None
    # Monotonic deadlines.
    start_deadline: float | None = None
    next_attempt_at: float | None = None
    unhealthy_since: float | None = None
    # While /health fails: the API server's CPU readings (oldest first, over the last two
    # grace periods), and why it is more than slow (decide/liveness.health_failure), or "".
    unhealthy_api: list[Cpu] = field(default_factory=list)
    unhealthy_why: str = ""
    # Since when (wall clock) /health has been slow past the grace with vLLM's processes busy:
    # a doubt, exported with the liveness one (kimi_supervisor_liveness_doubt_since_...).
    health_doubt_since: datetime | None = None
    driver_retry_at: float = 0.0
    driver_retry_s: float = 0.5
    failures: tuple[float, ...] = ()
    stuck_retries: int = 0
    # The STUCK episode under way (first STUCK teardown, until a CLEAN one), and the diagnosis
    # its history last recorded (a retry that ends the same way is counted, not recorded).
    stuck_since: datetime | None = None
    stuck_recorded: str = ""
    progress: Progress = field(default_factory=Progress)
    # The load under way: when it began (monotonic), what past loads of the same mode and argv
    # predict (eta.py), and that argv's key, recorded with the transition when it is ready.
    load_started: float | None = None
    eta: Estimate | None = None
    load_key: str = ""
    # The unavailable window under way (loop/window.py), the last one, and the parts past
    # switches to the same mode and argv took (the ETA's figures).
    watch: Stopwatch | None = None
    last_downtime: DowntimeStatus | None = None
    expected_parts: dict[str, float] = field(default_factory=dict)
    warm: WarmStatus | None = None  # the switch's warming, under way or done
    # The PID of a warming's reader left stuck in the kernel, while it is (a warning says so).
    warm_left: int | None = None
    observed: Observed | None = None
    driver_ready: bool = False
    # What the loop cannot go on without and waits for (the GPU driver, systemd), "" if nothing.
    waiting_for: str = ""
    indices: list[int] = field(default_factory=list)
    baselines: dict[int, int] = field(default_factory=dict)
    baseline_provisional: bool = False
    last_teardown: TeardownReport | None = None
    last_intrusion: IntrusionStatus | None = None
    bundle: BundleStatus | None = None  # the newest incident bundle (loop/bundles.py)
    last_failure: FailureStatus | None = None  # the last failed start, until one succeeds
    # The last switch rolled back, until another mode is desired by anyone but the rollback.
    rolled_back: RolledBackStatus | None = None
    # vLLM's output read since the last start is a failed vLLM's (its start failed, or it died
    # or hung): shown while nothing serves. A switch's old vLLM's lines are not.
    output_failed: bool = False
    gpu_health: GpuHealthStatus | None = None  # read before the last start (gpus.health_check)
    liveness: LivenessStatus | None = None  # what the liveness probe last saw, while serving
    # The liveness probe's last token counts outside captures: (time.monotonic() when /metrics
    # answered, MainPID, generated tokens), the reading that opens a capture's "before" window
    # (capture/stall.py).
    tokens_seen: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=8))
    capture: Capture | None = None
    warnings: list[str] = field(default_factory=list)
    stop_requested: bool = False
    reexec_requested: bool = False
    stopped_clean: bool | None = None  # set when the shutdown teardown has ended

    def eta_text(self, now: float) -> str | None:
        if self.eta is None or self.load_started is None:
            return None
        return self.eta.describe(now - self.load_started)

    def finish_load(self, now: float) -> dict[str, Any]:
        """The load that just became ready, as its transition records it (nothing for a vLLM
        adopted already loading or ready: its start was not seen)."""
        load: dict[str, Any] = {}
        if self.load_started is not None:
            load = {"load_s": round(now - self.load_started, 1), "argv_key": self.load_key}
        self.load_started, self.eta = None, None
        return load

    def stop_warming(self, why: str) -> None:
        """A --force switch, a stop, the old vLLM's exit: the warming before the teardown gives
        up now (loop/warming.py), whatever its reads are doing."""
        if self.job is not None and not self.job.stop_warm.is_set():
            self.job.stop_warm_why = why
            self.job.stop_warm.set()

    @property
    def busy(self) -> bool:
        """A teardown runs: the loop answers requests but observes and decides nothing."""
        return self.job is not None

    def memory(self) -> Memory:
        return Memory(
            state=self.state,
            serving_pid=self.serving.pid if self.serving else 0,
            start_deadline=self.start_deadline,
            next_attempt_at=self.next_attempt_at,
            unhealthy_since=self.unhealthy_since,
            unhealthy_why=self.unhealthy_why,
        )
