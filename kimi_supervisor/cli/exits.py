"""Every exit code kimi-mode and kimi-supervisor return, stated once: `Exit`, what each code
means to each program, and which code a daemon's refusal or a followed switch's end becomes.

kimi-mode's --help and both man pages are made from the tables below; a test checks
docs/control-protocol.md's table, the ansible module's and the unit's RestartPreventExitStatus
against them. A code never changes its value: scripts and playbooks act on the numbers.

kimi-mode's codes, one meaning each, the same for every command:
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    TIMEOUT = 4
    REFUSED = 5
    STUCK = 6
    INTERRUPTED = 130
    OUTPUT_CLOSED = 141  # 128 + SIGPIPE: as a shell reports a writer whose reader left

    @property
    def label(self) -> str:
        """The code's name as kimi-mode's `error` line and its --help say it: `unreachable`."""
        return self.name.lower()


KIMI_MODE: dict[Exit, str] = {
    Exit.OK: "done, or nothing to do (is-serving: vLLM serves; doctor: all checks pass)",
    Exit.FAILED: "the switch or capture failed, the daemon gave up (FAILED) or waits for the "
    "driver or systemd; is-serving: vLLM does not serve (in that mode); doctor: a check failed",
    Exit.USAGE: "the command line is wrong; nothing was asked of the daemon",
    Exit.UNREACHABLE: "no daemon answers at the socket, its answer is not understood (a daemon "
    "of another version: restart it after an upgrade), or the caller is denied",
    Exit.TIMEOUT: "--timeout ran out while following or waiting; the switch goes on",
    Exit.REFUSED: "the daemon is busy (another switch, booting, stopping) or refused the request "
    "as it stands (no capture to stop, the port is taken)",
    Exit.STUCK: "the GPUs could not be made clean: STUCK, a person must look",
    Exit.INTERRUPTED: "Ctrl-C while following; the switch goes on",
    Exit.OUTPUT_CLOSED: "the output was closed before the end (`| head`): nothing was judged "
    "after it; the switch goes on",
}

# kimi-supervisor's: its commands are the operator's and the units'. USAGE is the one the unit
# does not restart on (RestartPreventExitStatus).
KIMI_SUPERVISOR: dict[Exit, str] = {
    Exit.OK: "success (teardown: every GPU verified clean)",
    Exit.FAILED: "failure (teardown: STUCK; the diagnosis says what holds the GPUs)",
    Exit.USAGE: "a configuration or state directory to fix by hand; the unit does not restart "
    "on it",
}

__doc__ = (__doc__ or "") + "".join(
    f"\n    {code:>3}  {code.label}: {what}" for code, what in KIMI_MODE.items()
)

# A refused request's code -> the exit code.
_REFUSAL = {
    "bad_request": Exit.USAGE,
    "bad_json": Exit.USAGE,
    "too_long": Exit.USAGE,
    "unsupported_version": Exit.USAGE,
    "forbidden": Exit.UNREACHABLE,
    "too_many_clients": Exit.UNREACHABLE,
    "idle": Exit.UNREACHABLE,
    "busy": Exit.REFUSED,
    "wrong_mode": Exit.REFUSED,
    "stopping": Exit.REFUSED,
    "no_capture": Exit.REFUSED,
    "port_taken": Exit.REFUSED,
    "unit_not_loaded": Exit.REFUSED,
}


def refusal_exit(code: str) -> Exit:
    """The exit code for a reply that refuses the request: the request was wrong (usage), the
    caller is denied (unreachable), the host is busy or in the way (refused); anything else
    (the daemon failed to answer, could not persist it) is a failure."""
    return _REFUSAL.get(code, Exit.FAILED)


def end_exit(end: dict[str, Any]) -> Exit:
    """A followed switch's end: ok, STUCK, or failed."""
    if end.get("ok"):
        return Exit.OK
    return Exit.STUCK if end.get("outcome") == "stuck" else Exit.FAILED
