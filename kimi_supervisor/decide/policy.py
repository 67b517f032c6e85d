"""What the daemon chooses, as pure functions of what it knows: no clock read, no side effect.

Admission of a switch request (`admit`), first match wins:

| situation | verdict |
|---|---|
| the daemon is stopping | REFUSE_STOPPING |
| it is booting | REFUSE_BOOTING |
| a switch to the same mode is running, none queued behind it | JOIN |
| a switch to another mode (or one queued) is running, no --force | REFUSE_BUSY |
| a switch is running, --force | TAKE_OVER |
| the mode serves, is desired and answers /health | ALREADY |
| a capture is active, no --force | ACCEPT_AFTER_CAPTURE |
| anything else | ACCEPT |

After a start that did not become ready (`after_failed_start`): roll back to the previous mode
(or to production from profile) when rollback is on and this was not itself a rollback;
otherwise count a failure.

What follows a teardown (`after_teardown`), first match wins:

| the teardown was for | outcome | situation | next |
|---|---|---|---|
| the daemon's stop | CLEAN, or STUCK on the last attempt | | EXIT |
| the daemon's stop | STUCK | | SHUTDOWN_AGAIN |
| anything else | STUCK | | STUCK (retried later; nothing started on busy GPUs) |
| | CLEAN | the daemon is stopping | STOPPED |
| | CLEAN | a switch was accepted meanwhile | TAKE_OVER |
| a switch | CLEAN | | START its target |
| a start that failed | CLEAN | `after_failed_start` says roll back | ROLLBACK |
| a start that failed, vLLM's death, an intrusion | CLEAN | | FAILURE |

Timed profile mode (`profile_until`, `profile_expired`): `--for`, else
`profiling.default_duration_s`, capped at `profiling.max_duration_s` (0: no cap, no default).

A failure (`after_failure`): the failures within `failure_window_s`, this one included; at
`max_failures` or more: FAILED (wait for an operator); else BACKOFF for
`initial * 2^(n-1)`, at most `max`. A STUCK teardown is retried after `stuck_retry_s * 2^k`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from kimi_supervisor.model import Mode


class Admit(enum.StrEnum):
    REFUSE_STOPPING = "stopping"
    REFUSE_BOOTING = "booting"
    JOIN = "joined"
    REFUSE_BUSY = "busy"
    TAKE_OVER = "take_over"
    ALREADY = "already"
    ACCEPT_AFTER_CAPTURE = "accept_after_capture"
    ACCEPT = "accepted"


@dataclass(frozen=True)
class Running:
    """The switch in progress, as admission sees it."""

    target: Mode
    started_at: datetime
    step: str
    requested_by: str
    queued: bool = False  # another switch already waits to take over


@dataclass(frozen=True)
class AdmissionView:
    stopping: bool
    booting: bool
    running: Running | None  # a switch tearing down or starting
    serving_healthy: Mode | None  # the mode that serves and answers /health, if any
    desired: Mode
    capture_active: bool = False
    stale: bool = False  # the serving vLLM runs an earlier config's argv


def admit(mode: Mode, force: bool, v: AdmissionView, *, apply: bool = False) -> Admit:
    """`apply`: restart the serving mode if it runs an earlier config's argv (else ALREADY)."""
    if v.stopping:
        return Admit.REFUSE_STOPPING
    if v.booting:
        return Admit.REFUSE_BOOTING
    if v.running is not None:
        if v.running.target is mode and not v.running.queued:
            return Admit.JOIN
        return Admit.TAKE_OVER if force else Admit.REFUSE_BUSY
    if v.serving_healthy is mode and v.desired is mode and not (apply and v.stale):
        return Admit.ALREADY
    if v.capture_active and not force:
        return Admit.ACCEPT_AFTER_CAPTURE
    return Admit.ACCEPT


class AfterFailedStart(enum.StrEnum):
    ROLLBACK = "rollback"
    FAILURE = "failure"


def rollback_target(target: Mode, previous: Mode | None) -> Mode | None:
    """Where a failed start of `target` rolls back to: the mode before it, else production
    from profile; None when there is nowhere to go."""
    if previous is not None and previous is not target:
        return previous
    return Mode.PRODUCTION if target is Mode.PROFILE else None


def after_failed_start(
    rollback_enabled: bool, was_rollback: bool, back: Mode | None
) -> AfterFailedStart:
    if rollback_enabled and back is not None and not was_rollback:
        return AfterFailedStart.ROLLBACK
    return AfterFailedStart.FAILURE


@dataclass(frozen=True)
class FailureVerdict:
    failures: tuple[float, ...]  # the failure times still within the window, this one last
    failed: bool  # True: FAILED, wait for an operator
    backoff_s: float  # when not failed: wait this long before trying again


def after_failure(
    earlier: Sequence[float],
    now: float,
    window_s: float,
    *,
    max_failures: int,
    backoff_initial_s: float,
    backoff_max_s: float,
) -> FailureVerdict:
    kept = (*(t for t in earlier if now - t <= window_s), now)
    n = len(kept)
    if n >= max_failures:
        return FailureVerdict(kept, True, 0.0)
    return FailureVerdict(kept, False, min(backoff_initial_s * 2 ** (n - 1), backoff_max_s))


def stuck_retry_s(retries_so_far: int, stuck_retry: float, backoff_max_s: float) -> float:
    return float(min(stuck_retry * 2**retries_so_far, max(backoff_max_s, stuck_retry)))


class Purpose(enum.StrEnum):
    SWITCH = "switch"
    START_FAILED = "start_failed"
    DIED = "died"
    INTRUSION = "intrusion"
    SHUTDOWN = "shutdown"


class Next(enum.StrEnum):
    EXIT = "exit"
    SHUTDOWN_AGAIN = "shutdown_again"
    STUCK = "stuck"
    STOPPED = "stopped"
    TAKE_OVER = "take_over"
    START = "start"
    ROLLBACK = "rollback"
    FAILURE = "failure"


# A stopping daemon tries this many teardowns before it exits unclean.
SHUTDOWN_ATTEMPTS = 3


def after_teardown(
    purpose: Purpose,
    clean: bool,
    stopping: bool,
    *,
    intent_pending: bool,
    then: AfterFailedStart = AfterFailedStart.FAILURE,
    attempt: int = 1,
) -> Next:
    if purpose is Purpose.SHUTDOWN:
        return Next.EXIT if clean or attempt >= SHUTDOWN_ATTEMPTS else Next.SHUTDOWN_AGAIN
    if not clean:
        return Next.STUCK
    if stopping:
        return Next.STOPPED
    if intent_pending:
        return Next.TAKE_OVER
    if purpose is Purpose.SWITCH:
        return Next.START
    if purpose is Purpose.START_FAILED and then is AfterFailedStart.ROLLBACK:
        return Next.ROLLBACK
    return Next.FAILURE


@dataclass(frozen=True)
class Expiry:
    until: datetime | None  # None: profile mode does not end by itself
    capped: bool = False  # --for was longer than profiling.max_duration_s


def profile_until(
    mode: Mode, for_s: float | None, default_s: float, *, max_s: float, now: datetime
) -> Expiry:
    if mode is not Mode.PROFILE:
        return Expiry(None)
    seconds = for_s or default_s or None
    capped = bool(seconds and max_s and seconds > max_s)
    if capped:
        seconds = max_s
    return Expiry(now + timedelta(seconds=seconds) if seconds else None, capped)


def profile_expired(desired: Mode, until: datetime | None, now: datetime) -> bool:
    return desired is Mode.PROFILE and until is not None and now >= until
