"""A mode switch as kimi-mode asks for it and follows it, and the following of a switch already
under way (`wait`, or the same mode asked again: a join). kimi_mode.py (the parser and the other
commands) and capture.py (which switches to profile mode first) both use it; neither imports the
other. Exit codes: cli/exits.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.exits import Exit, end_exit, refusal_exit
from kimi_supervisor.cli.follower import Follower, redraws
from kimi_supervisor.cli.output import Output
from kimi_supervisor.control.client import TimedOut, exchange

REJOIN = "`kimi-mode wait` follows it again; `kimi-mode status` shows where it is"


def follower_for(o: Output) -> Follower:
    return Follower(o.out, redraws(o.out, os.environ) and not o.json)


def cmd_switch(args: argparse.Namespace, sock: Path) -> int:
    o = Output(args.output)
    req: dict[str, Any] = {
        "cmd": "switch",
        "mode": args.mode,
        "follow": not args.no_wait,
        "force": args.force,
    }
    if getattr(args, "apply", False):
        req["apply"] = True
    if getattr(args, "for_s", None):
        req["for_s"] = args.for_s
    follower = follower_for(o)
    try:
        for raw, msg in exchange(sock, req, timeout_s=args.timeout):
            if o.json:
                o.raw(raw)
            kind = msg.get("type")
            if kind == "reply":
                if (code := refused(msg, o)) is not None:
                    return code
                if msg.get("data", {}).get("transition"):
                    follower.join(msg["data"]["transition"])  # joined: its target, its clock
                if not o.json:
                    follower.say(msg["message"])
                if msg["code"] == "already" or args.no_wait:
                    return Exit.OK
            elif kind == "event" and not o.json:
                follower.on_event(msg)
            elif kind == "end":
                if not o.json:
                    follower.finish()
                    print_end(msg, o)
                return end_exit(msg)
    except TimedOut:
        follower.finish()
        return o.fail(
            Exit.TIMEOUT,
            f"timed out after {args.timeout:g} s waiting; the switch to {args.mode} goes on "
            f"({REJOIN})",
        )
    except KeyboardInterrupt:
        follower.finish()
        return o.fail(
            Exit.INTERRUPTED,
            f"stopped following; the switch to {args.mode} goes on ({REJOIN})",
        )
    return o.fail(
        Exit.UNREACHABLE,
        "the daemon closed the connection before the switch ended (`kimi-mode status`)",
    )


def print_end(msg: dict[str, Any], o: Output) -> None:
    """A followed switch's last lines: its outcome, and the window it cost the service."""
    print(("done: " if msg["ok"] else "FAILED: ") + msg["message"], file=o.out)
    if said := (msg.get("data", {}).get("downtime") or {}).get("text"):
        print(f"  {said}", file=o.out)


def refused(msg: dict[str, Any], o: Output) -> Exit | None:
    """The exit code for a reply that refuses the request (said on stderr), else None. In json
    mode the reply line itself, already printed, is the answer."""
    if msg["ok"]:
        return None
    print(f"kimi-mode: {msg['message']}", file=sys.stderr)
    return refusal_exit(msg["code"])
