"""A mode switch as kimi-mode asks for it and follows it, and the exit codes every kimi-mode
command shares (as documented in docs/control-protocol.md):

    0  done (or nothing to do)
    1  the switch failed, or its teardown ended STUCK
    2  usage error
    3  the daemon is unreachable, or refused the request
    4  timed out waiting (the switch goes on)
  130  interrupted with Ctrl-C while following (the switch goes on)

kimi_mode.py (the parser and the other commands) and capture.py (which switches to profile mode
first) both use it; neither imports the other.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.render import Follower, redraws
from kimi_supervisor.control.client import TimedOut, exchange

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_TIMEOUT, EXIT_INTERRUPTED = (
    0,
    1,
    2,
    3,
    4,
    130,
)


def cmd_switch(args: argparse.Namespace, sock: Path) -> int:
    req: dict[str, Any] = {
        "cmd": "switch",
        "mode": args.mode,
        "follow": not args.no_wait,
        "force": args.force,
    }
    if getattr(args, "for_s", None):
        req["for_s"] = args.for_s
    out = sys.stdout
    tty = redraws(out, os.environ) and not args.json
    follower = Follower(out, tty)
    try:
        for raw, msg in exchange(sock, req, timeout_s=args.timeout):
            if args.json:
                out.write(raw.decode() + "\n")
                out.flush()
            kind = msg.get("type")
            if kind == "reply":
                if (code := refused(msg, args.json)) is not None:
                    return code
                if not args.json:
                    follower.say(msg["message"])
                if msg["code"] == "already" or args.no_wait:
                    return EXIT_OK
            elif kind == "event" and not args.json:
                follower.on_event(msg)
            elif kind == "end":
                if not args.json:
                    follower.finish()
                    print(("done: " if msg["ok"] else "FAILED: ") + msg["message"], file=out)
                return EXIT_OK if msg["ok"] else EXIT_FAILED
    except TimedOut:
        print(
            f"\nkimi-mode: timed out after {args.timeout:g} s waiting; the switch to {args.mode} "
            "goes on (`kimi-mode status`)",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT
    except KeyboardInterrupt:
        print(
            f"\nkimi-mode: stopped following; the switch to {args.mode} goes on "
            "(`kimi-mode status` shows where it is)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    print(
        "kimi-mode: the daemon closed the connection before the switch ended (`kimi-mode status`)",
        file=sys.stderr,
    )
    return EXIT_UNREACHABLE


def refused(msg: dict[str, Any], as_json: bool) -> int | None:
    """The exit code for a reply that refuses the request (said on stderr), else None."""
    if msg["ok"]:
        return None
    if not as_json:
        print(f"kimi-mode: {msg['message']}", file=sys.stderr)
    return refusal_exit(msg["code"])


def refusal_exit(code: str) -> int:
    """A refused request: the request was wrong (2), the host is busy or in the wrong mode (1),
    or the daemon refused the caller or failed (3)."""
    if code in ("bad_request", "bad_json", "too_long", "unsupported_version"):
        return EXIT_USAGE
    if code in ("busy", "wrong_mode", "stopping", "no_capture", "port_taken"):
        return EXIT_FAILED
    return EXIT_UNREACHABLE
