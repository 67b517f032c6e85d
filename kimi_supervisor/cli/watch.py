"""Commands that follow the daemon over time: `status --watch` and `wait`."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.ask import status as _status
from kimi_supervisor.cli.exits import Exit, end_exit, refusal_exit
from kimi_supervisor.cli.output import Output
from kimi_supervisor.cli.render import format_status
from kimi_supervisor.cli.switch import follower_for, print_end
from kimi_supervisor.control.client import TimedOut, exchange


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
        import shutil

        tty = o.out.isatty()
        width = shutil.get_terminal_size((80, 24)).columns if tty else 80
        print(format_status(data, max(width, 40)), file=o.out, flush=True)


def watch(args: argparse.Namespace, sock: Path, o: Output) -> int:
    """`status --watch`: the status again every --interval seconds (a terminal: redrawn in
    place; otherwise, and in json mode, a new one each time it changed), until Ctrl-C."""
    from kimi_supervisor.cli.follower import redraws

    tty = redraws(o.out, os.environ) and not o.json
    last: Any = None
    drawn = 0
    try:
        while True:
            data = _status(sock)
            if tty:
                import shutil

                width = shutil.get_terminal_size((80, 24)).columns - 1
                lines = format_status(data, max(width, 20)).splitlines()
                stamp = time.strftime("%H:%M:%S")
                lines.insert(0, f"every {args.interval:g} s, {stamp} (Ctrl-C ends)")
                if drawn:
                    o.out.write(f"\x1b[{drawn}F\x1b[J")
                o.out.write("\n".join(lines) + "\n")
                o.out.flush()
                drawn = len(lines)
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


def wait(args: argparse.Namespace, sock: Path, o: Output) -> int:
    """Follow the switch under way (the live display, from its real start) until it ends, or,
    given MODE, until vLLM serves in MODE; return at once if there is nothing to wait for. Ends
    with the status's exit: 0 serving, 6 STUCK, 1 failed; 4 at --timeout; 130 at Ctrl-C."""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    follower = follower_for(o)
    following = ""  # the transition being followed
    try:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimedOut()
            # Subscribe first, then read the status from the subscription's own reply, so no
            # event between the two is lost; the stream is read until something to judge.
            for raw, msg in exchange(sock, {"cmd": "subscribe"}, timeout_s=left):
                kind = msg.get("type")
                if kind == "reply":
                    if not msg["ok"]:
                        return o.fail(refusal_exit(msg["code"]), msg["message"])
                    data = msg["data"]
                    tr = data.get("transition")
                    if tr and tr["id"] != following:
                        following = tr["id"]
                        follower.join(tr)
                        follower.say(
                            f"following {tr['id']}: {tr.get('previous') or 'nothing'} -> "
                            f"{tr['target']} (since {tr['started_at'][11:19]} UTC, {tr['step']})"
                        )
                    verdict = _wait_verdict(data, args.mode)
                    if verdict is not None:
                        if o.json:
                            print_status(o, data)
                        elif not following:
                            print(f"nothing to wait for: {data['status_line']}", file=o.out)
                        return verdict
                    continue
                if o.json:
                    o.raw(raw)
                if kind == "event":
                    if msg.get("event") == "transition_started":
                        following = msg.get("transition") or ""
                    if not o.json:
                        follower.on_event(msg)
                elif kind == "end":
                    follower.finish()
                    if not o.json:
                        print_end(msg, o)
                    if args.mode is None:
                        return end_exit(msg)
                    break  # judge the status again: a rollback or a retry may follow
            else:
                return o.fail(Exit.UNREACHABLE, "the daemon closed the connection")
    except TimedOut:
        follower.finish()
        return o.fail(
            Exit.TIMEOUT, f"timed out after {args.timeout:g} s waiting; the switch goes on"
        )
    except KeyboardInterrupt:
        follower.finish()
        return o.fail(Exit.INTERRUPTED, "stopped waiting; the switch goes on")


def _wait_verdict(data: dict[str, Any], mode: str | None) -> Exit | None:
    """The exit `wait` ends with for this status, or None to go on waiting."""
    state = data.get("state")
    if state == "stuck":
        return Exit.STUCK
    if state == "failed":
        return Exit.FAILED
    if data.get("transition"):
        return None
    if state == "serving":
        if mode is None or data.get("mode") == mode:
            return Exit.OK
        if data.get("desired_mode") != mode:
            return Exit.FAILED  # serving another mode, and nobody asked for MODE
        return None
    if mode is None and state not in ("booting", "starting", "tearing_down", "backoff"):
        return status_exit(data)
    return None
