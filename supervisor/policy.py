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

A failure (`after_failure`): the failures within `failure_window_s`, this one included; at
`max_failures` or more: FAILED (wait for an operator); else BACKOFF for
`initial * 2^(n-1)`, at most `max`. A STUCK teardown is retried after `stuck_retry_s * 2^k`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from supervisor.model import Mode


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


def admit(mode: Mode, force: bool, v: AdmissionView) -> Admit:
    if v.stopping:
        return Admit.REFUSE_STOPPING
    if v.booting:
        return Admit.REFUSE_BOOTING
    if v.running is not None:
        if v.running.target is mode and not v.running.queued:
            return Admit.JOIN
        return Admit.TAKE_OVER if force else Admit.REFUSE_BUSY
    if v.serving_healthy is mode and v.desired is mode:
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
