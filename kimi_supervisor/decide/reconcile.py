"""Desired mode vs what is observed -> the next action. Pure: no I/O, no clock of its own.

The loop calls `decide` on every tick with what it just observed; the same inputs always give
the same action, so a daemon restarted at any point (crash, upgrade, reboot) simply decides
again from what it sees. Read top to bottom:

    an operator's switch, while a capture flushes, no --force -> HOLD_FOR_CAPTURE
    an operator's switch                                      -> SWITCH (ends a load under way)
    FAILED                         -> nothing until an operator asks for a mode
    STARTING   start job queued    -> nothing (systemd holds it for the unit's dependencies)
               unit gone           -> START_FAILED
               /health 200         -> READY
               past the deadline   -> START_FAILED
    BACKOFF, STUCK  when due       -> RETRY (teardown to clean, then start)
    BOOTING, SERVING:
      desired mode running, healthy           -> ADOPT (or nothing if already serving it;
                                                 an earlier config's argv, too: the
                                                 operator restarts it with --apply)
      desired mode running, not healthy yet   -> RESUME_START at boot (a load in progress)
      ... a new MainPID while serving         -> DIED (restarted outside the supervisor)
      ... unhealthy for health_grace_s, and
          an answer that says so, or the API
          server stopped or idle meanwhile    -> UNHEALTHY (incident, teardown, start again)
      ... /health slow, the API server busy   -> nothing (slow is not hung; status says)
      was serving, unit gone or MainPID new   -> DIED
      another mode (or an unknown argv) runs  -> SWITCH
      nothing runs                            -> SWITCH (teardown makes the GPUs clean first)
    a SWITCH, RETRY or UNHEALTHY while a capture flushes -> HOLD_FOR_CAPTURE (stop recording, wait)

The loop asks only when no teardown runs: a switch accepted meanwhile is its `intent`, and
policy.after_teardown hands it over when the teardown ends.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kimi_supervisor.model import WAITING_STATES, Mode, State, unit_up


@dataclass(frozen=True)
class Observed:
    active_state: str  # the unit's ActiveState
    sub_state: str
    main_pid: int
    running_mode: Mode | None  # from MainPID's argv; None: no match (or nothing runs)
    health: int  # HTTP status of GET /health; 0: no answer; -1: not probed
    gpus_clean: bool
    result: str = ""
    exec_main_status: int = 0
    job: str = ""  # a job systemd holds for the unit ("start": queued behind its dependencies)
    # running_mode was started with an earlier config's argv (edited since, and reloaded): it is
    # adopted as that mode, never torn down for it; a restart waits for an operator's --apply.
    argv_stale: bool = False
    # Why vLLM's own clients can order it about (launcher.open_routes), "" if they cannot; and
    # whether its profiler is armed with no guard (a start by this daemon adds the guard:
    # `--apply` restarts it).
    open_routes: str = ""
    unguarded: bool = False
    # /health gave no answer that says anything (none in daemon.health_timeout_s, a reset, the
    # daemon's own error): a second sign is needed (decide/liveness.health_failure).
    health_slow: bool = False
    # The unit's LoadState: anything but "loaded" (not-found, masked, bad-setting) while it runs
    # means its file is gone or broken: it runs on, and a start would fail.
    load_state: str = "loaded"

    @property
    def unit_up(self) -> bool:
        return unit_up(self.active_state)

    @property
    def healthy(self) -> bool:
        return self.health == 200

    def describe_unit(self) -> str:
        out = f"{self.active_state}/{self.sub_state}"
        if self.result and self.result != "success":
            out += f", result {self.result}"
        if self.exec_main_status:
            out += f", exit status {self.exec_main_status}"
        return out


@dataclass(frozen=True)
class Intent:
    """A switch an operator asked for (persisted as the desired mode when it was accepted)."""

    mode: Mode
    by: str
    force: bool = False
    # The id its transition will have, made when it was accepted: the reply carries it, so the
    # asker follows its own transition and no other.
    id: str = ""


@dataclass(frozen=True)
class Memory:
    """What the loop remembers between ticks (monotonic seconds)."""

    state: State
    serving_pid: int = 0
    start_deadline: float | None = None
    next_attempt_at: float | None = None
    unhealthy_since: float | None = None
    # Why the failing /health is more than a slow answer (decide/liveness.health_failure), or
    # "": then no restart, however long it fails.
    unhealthy_why: str = ""


class Do(enum.StrEnum):
    NOTHING = "nothing"
    ADOPT = "adopt"
    RESUME_START = "resume_start"
    READY = "ready"
    START_FAILED = "start_failed"
    DIED = "died"
    SWITCH = "switch"
    RETRY = "retry"
    HOLD_FOR_CAPTURE = "hold_for_capture"
    UNHEALTHY = "unhealthy"  # lost as a dead one is: an incident, teardown, start again


@dataclass(frozen=True)
class Action:
    do: Do
    reason: str = ""


def decide(
    desired: Mode,
    mem: Memory,
    obs: Observed,
    *,
    now: float,
    health_grace_s: float,
    intent: Intent | None = None,
    capture: bool = False,
) -> Action:
    """`intent`: a switch an operator asked for, not yet begun; `capture`: a profiler capture
    is recording or flushing its traces."""
    action = _decide(desired, mem, obs, now=now, health_grace_s=health_grace_s, intent=intent)
    held = (Do.SWITCH, Do.RETRY, Do.UNHEALTHY)
    if action.do in held and capture and not (intent and intent.force):
        return Action(Do.HOLD_FOR_CAPTURE, "a capture is flushing its traces; the switch waits")
    return action


def _decide(
    desired: Mode,
    mem: Memory,
    obs: Observed,
    *,
    now: float,
    health_grace_s: float,
    intent: Intent | None,
) -> Action:
    if intent is not None:
        return Action(Do.SWITCH, f"asked by {intent.by}")
    s = mem.state
    if s is State.FAILED:
        return Action(Do.NOTHING, "failed: waiting for an operator")

    if s is State.STARTING:
        # STARTING -> SERVING, or -> teardown (and rollback or backoff)
        if not obs.unit_up and obs.job == "start":
            # At boot the start job waits for the unit's After= dependencies (the network).
            return Action(Do.NOTHING, "the start job is queued behind the unit's dependencies")
        if not obs.unit_up:
            return Action(Do.START_FAILED, f"the unit stopped during start ({obs.describe_unit()})")
        if obs.healthy:
            return Action(Do.READY, "GET /health answered 200")
        if mem.start_deadline is not None and now >= mem.start_deadline:
            return Action(Do.START_FAILED, "not ready within daemon.start_timeout_s")
        return Action(Do.NOTHING, "loading")

    if s in WAITING_STATES:
        # BACKOFF/STUCK -> TEARING_DOWN when due
        if mem.next_attempt_at is not None and now < mem.next_attempt_at:
            return Action(Do.NOTHING, "waiting to retry")
        return Action(Do.RETRY, f"retrying after {s.value}")

    # BOOTING or SERVING (TEARING_DOWN and STOPPING never reach here: they run to their end)
    if obs.unit_up and obs.running_mode is desired:
        if obs.healthy:
            if s is State.SERVING and obs.main_pid == mem.serving_pid:
                return Action(Do.NOTHING, "serving")
            return Action(Do.ADOPT, f"{desired.value} already runs and is healthy")
        if s is State.BOOTING:
            return Action(Do.RESUME_START, f"{desired.value} runs and is not ready yet: waiting")
        if s is State.SERVING and obs.main_pid != mem.serving_pid:
            return Action(
                Do.DIED,
                f"vLLM (PID {mem.serving_pid}) was replaced by PID {obs.main_pid} outside the "
                "supervisor, not healthy",
            )
        if mem.unhealthy_since is not None and now - mem.unhealthy_since >= health_grace_s:
            failed_s = now - mem.unhealthy_since
            if not mem.unhealthy_why:
                # Slow is not hung: a busy API server answers late too (decide/liveness.py).
                return Action(
                    Do.NOTHING,
                    f"/health has given no answer for {failed_s:.0f} s, but vLLM's processes "
                    "are busy: not restarted",
                )
            return Action(
                Do.UNHEALTHY, f"/health has failed for {failed_s:.0f} s ({mem.unhealthy_why})"
            )
        return Action(Do.NOTHING, "unhealthy, within health_grace_s")

    if s is State.SERVING and (not obs.unit_up or obs.main_pid != mem.serving_pid):
        # SERVING -> TEARING_DOWN (orphans hold the GPUs) -> BACKOFF or FAILED
        return Action(
            Do.DIED,
            f"vLLM (PID {mem.serving_pid}) is gone: unit {obs.describe_unit()}"
            + (f", MainPID now {obs.main_pid}" if obs.main_pid else ""),
        )

    if obs.unit_up and obs.load_state != "loaded":
        # Torn down, it could not be started again: the unit has no file to start from.
        return Action(
            Do.NOTHING,
            f"vLLM's unit runs with its file {obs.load_state}: it is not torn down for "
            f"{desired.value}, whose start would fail, until the file is back",
        )
    if obs.unit_up:
        running = obs.running_mode.value if obs.running_mode else "an argv matching no mode"
        return Action(Do.SWITCH, f"vLLM runs {running}; {desired.value} is desired")
    if not obs.gpus_clean:
        return Action(Do.SWITCH, "vLLM is not running and the GPUs are not at baseline")
    return Action(Do.SWITCH, "vLLM is not running")
