"""Commands that follow the daemon over time: `status --watch` and `wait`."""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.ask import checked_status
from kimi_supervisor.cli.ask import status as _status
from kimi_supervisor.cli.exits import Exit, end_exit
from kimi_supervisor.cli.follow import Again, Follow
from kimi_supervisor.cli.follower import Follower, Redraw, redraws
from kimi_supervisor.cli.output import Output, VerdictOut
from kimi_supervisor.cli.render import columns, cut, format_status, rows_of, wrap
from kimi_supervisor.cli.switch import follower_for, print_end
from kimi_supervisor.control.client import Unreachable


def status_exit(data: dict[str, Any]) -> Exit:
    """`status`'s exit: STUCK; FAILED or waiting for what the daemon cannot go on without (the
    GPU driver, systemd); else ok."""
    if data.get("state") == "stuck":
        return Exit.STUCK
    if data.get("state") == "failed" or data.get("waiting_for"):
        return Exit.FAILED
    return Exit.OK


def print_status(o: Output, data: dict[str, Any]) -> None:
    if o.json:
        o.line({"v": 1, "type": "status", **data})
    else:
        print(format_status(data, columns(o.out)), file=o.out, flush=True)


def _columns() -> int:
    return shutil.get_terminal_size((80, 24)).columns


def _lines() -> int:
    return shutil.get_terminal_size((80, 24)).lines


def watch(args: argparse.Namespace, sock: Path, o: Output) -> int:
    """`status --watch`: the status again every --interval seconds (a terminal: redrawn in
    place; otherwise, and in json mode, a new one each time it changed), until Ctrl-C."""
    tty = redraws(o.out, os.environ) and not o.json
    last: Any = None
    screen = Redraw(o.out, _columns, _lines)
    try:
        while True:
            data = _status(sock)
            if tty:
                lines = format_status(data, max(_columns() - 1, 20)).splitlines()
                stamp = time.strftime("%H:%M:%S")
                lines.insert(0, f"every {args.interval:g} s, {stamp} (Ctrl-C ends)")
                room, width = max(_lines() - 1, 2), max(_columns(), 1)
                if rows_of(lines, width) > room:  # taller than the screen piles up: folded
                    # Every row within the width (a path kept whole, wide characters), and
                    # as many as fit.
                    lines = [cut(x, width - 1) for x in lines]
                    if len(lines) > room:  # cut to the width, each takes one row
                        more = (
                            f"  {len(lines) - room + 1} more rows (a taller terminal shows "
                            "them; `kimi-mode status` prints all)"
                        )
                        lines = [*lines[: room - 1], cut(more, width - 1)]
                screen.draw(lines)
            else:
                # What changed, not the ages that tick by themselves.
                key = {k: v for k, v in data.items() if k not in ("daemon", "gpus_age_s")}
                if key != last:
                    last = key
                    print_status(o, data)
                    if not o.json:
                        print("", file=o.out, flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return Exit.OK


# A status older than an end already heard is asked for again, first after this long, the
# pause doubling up to STALE_MAX_S (under --timeout, if given).
STALE_PAUSE_S = 0.02
STALE_MAX_S = 1.0


class WaitFollow(Follow):
    """`wait`: a subscription whose reply is the status to judge (the switch under way is
    joined from its real start), whose events draw the live display, and whose end is the
    answer, or, given MODE, a reason to judge the status again.

    Given MODE it keeps kubectl wait's contract: it waits until MODE serves or --timeout runs
    out, through STUCK retries, rollbacks and other people's switches, and ends with one
    verdict about MODE, its last line (a `verdict` object in json mode), with the exit to match
    (`mode_verdict`, `timeout_verdict`).

    The end of a transition and the status that no longer shows it may reach this client in
    either order: a status that still shows a transition whose end was heard is older than
    that end, and is asked for again (after a short pause) instead of being followed, since
    nothing more will come about that transition."""

    goes_on = "the switch goes on"
    stopped = "stopped waiting"
    closed = "the daemon closed the connection"
    prints_reply = False  # the status is printed once judged, as a `status` line

    display: Follower

    def __init__(self, args: argparse.Namespace, sock: Path, o: Output) -> None:
        super().__init__(o, sock, follower_for(o))
        self.mode: str | None = args.mode
        self.following = ""  # the transition being followed
        self.ended: set[str] = set()  # transitions whose end was heard
        self.targets: dict[str, str] = {}  # transition -> its target, as heard
        self.failed = ""  # how the last switch to MODE heard of failed ("": none, or it served)
        self.stuck = 0  # STUCK teardowns heard while waiting
        self.last: dict[str, Any] = {}  # the status judged last
        self.lost_at: float | None = None  # since when the daemon is gone (a restart)
        self._pause_s = STALE_PAUSE_S
        # Given MODE, asked again before --timeout's deadline: the status the verdict names
        # is read afresh, and never after the deadline.
        self.refresh_s = REFRESH_S if self.mode is not None else 0.0

    def on_reply(self, msg: dict[str, Any]) -> Exit | Again | None:
        # Subscribed first, the status read from the subscription's own reply: no event between
        # the two is lost; the stream is read until something to judge.
        data = checked_status(msg.get("data"))
        tr = data.get("transition")
        if tr and tr["id"] in self.ended:
            pause, self._pause_s = self._pause_s, min(self._pause_s * 2, STALE_MAX_S)
            return Again(pause)  # older than the end heard: nothing more comes about it
        self._pause_s = STALE_PAUSE_S
        self.last, self.lost_at = data, None
        failure = data.get("last_failure") or {}
        if self.mode is not None and failure.get("mode") == self.mode != data["desired_mode"]:
            # Joined while a failed switch to MODE rolls back: its failure, kept (the rollback
            # clears it from the status once it is ready).
            self.failed = self.failed or str(failure.get("reason", ""))
        if tr:
            self.targets[tr["id"]] = tr["target"]
        if tr and tr["id"] != self.following:
            self.following = tr["id"]
            self.display.join(tr)
            if not self.o.json:
                self.display.say(
                    f"following {tr['id']}: {tr.get('previous') or 'nothing'} -> "
                    f"{tr['target']} (since {tr['started_at'][11:19]} UTC, {tr['step']})"
                )
        if self.mode is not None:
            said = mode_verdict(data, self.mode, failed=self.failed, stuck=self.stuck)
            if said is None:
                return None
            if self.o.json:
                print_status(self.o, data)
            return self.verdict(*said)
        verdict = _wait_verdict(data)
        if verdict is not None:
            if self.o.json:
                print_status(self.o, data)
            elif not self.following:
                said_ = [f"nothing to wait for: {data['status_line']}"]
                print("\n".join(wrap(said_, columns(self.o.out) - 1)), file=self.o.out)
        return verdict

    def on_event(self, msg: dict[str, Any]) -> None:
        if msg.get("event") == "transition_started":
            self.following = msg.get("transition") or ""
            data = msg.get("data") or {}
            if data.get("id"):
                self.targets[str(data["id"])] = str(data.get("target"))
        if not self.o.json:
            self.display.on_event(msg)

    def on_end(self, msg: dict[str, Any]) -> Exit | None:
        ended = str((msg.get("data") or {}).get("transition") or "")
        if ended:
            self.ended.add(ended)
        outcome = msg.get("outcome")
        if outcome == "stuck":
            self.stuck += 1
        elif self.targets.get(ended) == self.mode:
            # preempted or stopped: someone else's doing, not MODE's failure
            if msg.get("ok"):
                self.failed = ""
            elif outcome not in ("preempted", "stopped"):
                self.failed = str(msg.get("message", ""))
        self.display.finish()
        if not self.o.json:
            print_end(msg, self.o)
        if self.mode is None:
            return end_exit(msg)
        return None  # judge the status again: a rollback or a retry may follow

    def on_closed(self) -> Exit | Again:
        """Given MODE, a daemon that restarts (an upgrade, a reload) is asked again, for
        RECONNECT_S at most: waiting for MODE goes on through it, as through other events.
        Past that, the verdict `unreachable` (3) with the status read last."""
        if self.mode is None or not self.last:
            return super().on_closed()
        return self._lost(self.closed)

    def refused(self, msg: dict[str, Any]) -> Exit | Again:
        """Given MODE, a subscription asked again that the daemon refuses for want of a slot
        (`too_many_clients`: control.max_clients connections are open, for as long as other
        clients hold them) is asked again as a restart is, for RECONNECT_S at most; any other
        refusal, or a first one, ends the wait as a refusal does."""
        if self.mode is None or not self.last or msg.get("code") != "too_many_clients":
            return super().refused(msg)
        return self._lost(f"the daemon refused to answer again ({msg.get('message', '')})")

    def _lost(self, why: str) -> Exit | Again:
        """The daemon, answered before, does not answer now: asked again after a pause, for
        RECONNECT_S at most since it stopped answering, then the verdict `unreachable`."""
        now = time.monotonic()
        self.lost_at = self.lost_at or now
        if now - self.lost_at <= RECONNECT_S:
            return Again(RECONNECT_PAUSE_S)
        self._finish()
        known = self.last.get("status_line") or "no status"
        return self.verdict(
            Exit.UNREACHABLE,
            "unreachable",
            f"no answer from the daemon for {RECONNECT_S:g} s while waiting for {self.mode} "
            f"({why}); the switch may go on; last known: {known}",
        )

    def on_unreachable(self, e: Unreachable) -> Exit | Again:
        if self.mode is None or not self.last:
            raise e
        return self._lost(str(e))

    def on_timeout(self, timeout_s: float) -> Exit:
        """--timeout ran out: the verdict on the status read last (asked for afresh before the
        deadline, REFRESH_S)."""
        if self.mode is None:
            return super().on_timeout(timeout_s)
        said = mode_verdict(self.last, self.mode, failed=self.failed, stuck=self.stuck)
        return self.verdict(
            *(said or timeout_verdict(self.last, self.mode, timeout_s, stuck=self.stuck))
        )

    def on_interrupt(self) -> Exit:
        """Ctrl-C, at any point: what was known last (the switch followed, else the status),
        and, given MODE, as its verdict."""
        # The display's switch only while it goes on: once its end was heard, the status read
        # after it is newer.
        live = self.following and self.following not in self.ended
        known = (self.display.seen() if live else "") or self.last.get("status_line")
        known = known or "no status yet"
        if self.mode is None:
            return self.o.fail(Exit.INTERRUPTED, f"{self.stopped}; last known: {known}")
        return self.verdict(
            Exit.INTERRUPTED, "interrupted", f"stopped waiting for {self.mode}; last known: {known}"
        )

    def verdict(self, code: Exit, kind: str, message: str) -> Exit:
        """The last line: the verdict about MODE, and its exit (in json mode a verdict that
        is not ok is said on stderr too, as an `error` line is)."""
        if self.o.json:
            if code is not Exit.OK:
                print(f"kimi-mode: {message}", file=self.o.err, flush=True)
            self.o.line(
                VerdictOut(mode=str(self.mode), ok=code is Exit.OK, verdict=kind, exit=code,
                           message=message)
            )  # fmt: skip
        else:
            head = {Exit.OK: "done", Exit.TIMEOUT: "timed out"}.get(code, code.label.upper())
            print("\n".join(wrap([f"{head}: {message}"], columns(self.o.out) - 1)),
                  file=self.o.out, flush=True)  # fmt: skip
        return code


# How long before --timeout's deadline `wait MODE` subscribes again (a quarter of --timeout at
# most): the status its verdict names is that fresh, and the verdict comes at the deadline.
REFRESH_S = 2.0
# A daemon gone while `wait MODE` waits (a restart) is asked again every RECONNECT_PAUSE_S, for
# RECONNECT_S at most (a restart takes a second or two).
RECONNECT_S = 60.0
RECONNECT_PAUSE_S = 0.25


def wait(args: argparse.Namespace, sock: Path, o: Output) -> int:
    """Follow the switch under way (the live display, from its real start) until it ends, or,
    given MODE, until vLLM serves in MODE (WaitFollow); return at once if there is nothing to
    wait for. Without MODE it ends with the status's exit: 0 serving, 6 STUCK, 1 failed; 4 at
    --timeout; 130 at Ctrl-C."""
    return WaitFollow(args, sock, o).run({"cmd": "subscribe"}, args.timeout)


def mode_verdict(
    data: dict[str, Any], mode: str, *, failed: str = "", stuck: int = 0
) -> tuple[Exit, str, str] | None:
    """`wait MODE`'s verdict on this status (exit, kind, words), or None to wait on.

    | the status                                      | verdict                          |
    |-------------------------------------------------|----------------------------------|
    | MODE serves, no transition                      | 0 `serving`                      |
    | a transition under way                          | wait (a switch, a rollback)      |
    | STUCK                                           | wait: the daemon retries         |
    | FAILED                                          | 1 `failed`: it waits for a person|
    | another mode desired, a switch to MODE failed   | 1 `rolled_back`                  |
    | (heard, or `rolled_back` in the status: joined  |                                  |
    | late, and no switch was asked since)            |                                  |
    | another mode desired, none failed               | wait: someone may still ask      |
    | MODE desired, not serving (backoff, a driver)   | wait: the daemon goes on         |
    """
    state, line = data.get("state"), data.get("status_line", "")
    if data.get("transition") or state == "stuck":
        return None
    if state == "serving" and data.get("mode") == mode:
        after = f" (after {stuck} STUCK teardown(s), retried until clean)" if stuck else ""
        return Exit.OK, "serving", f"{mode} serves{after}"
    if state == "failed":
        return Exit.FAILED, "failed", f"{mode} does not serve, and the daemon gave up: {line}"
    back = data.get("rolled_back") or {}
    if data.get("desired_mode") != mode and (failed or back.get("mode") == mode):
        why = failed or back.get("reason", "")
        return Exit.FAILED, "rolled_back", f"the switch to {mode} failed: {why}; now: {line}"
    return None


def timeout_verdict(
    data: dict[str, Any], mode: str, timeout_s: float, *, stuck: int = 0
) -> tuple[Exit, str, str]:
    """`wait MODE`'s verdict when --timeout ran out: STUCK (6) if the GPUs are, else 4, with
    what held MODE back."""
    line = data.get("status_line", "") or "no status"
    after = f"{mode} does not serve after {timeout_s:g} s"
    if data.get("state") == "stuck":
        return (
            Exit.STUCK,
            "stuck",
            f"{after}: the GPUs are STUCK ({stuck} teardown(s) heard): {line}",
        )
    if data.get("desired_mode") not in (None, mode) and not data.get("transition"):
        return Exit.TIMEOUT, "not_asked", f"{after}: nobody asked for {mode}; now: {line}"
    return Exit.TIMEOUT, "timeout", f"{after}: {line}"


def _wait_verdict(data: dict[str, Any]) -> Exit | None:
    """The exit `wait` (no MODE) ends with for this status, or None to go on waiting."""
    state = data.get("state")
    if state == "stuck":
        return Exit.STUCK
    if state == "failed":
        return Exit.FAILED
    if data.get("transition"):
        return None
    if state == "serving":
        return Exit.OK
    if state not in ("booting", "starting", "tearing_down", "backoff"):
        return status_exit(data)
    return None
