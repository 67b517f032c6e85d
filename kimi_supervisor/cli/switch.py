"""A mode switch as kimi-mode asks for it and follows it, and the following of a switch already
under way (`wait`, or the same mode asked again: a join). kimi_mode.py (the parser and the other
commands) and capture.py (which switches to profile mode first) both use it; neither imports the
other. The loop that follows: cli/follow.py; exit codes: cli/exits.py.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.exits import Exit, end_exit
from kimi_supervisor.cli.follow import Follow
from kimi_supervisor.cli.follower import Follower, redraws
from kimi_supervisor.cli.output import Output
from kimi_supervisor.cli.render import columns, wrap

REJOIN = "`kimi-mode wait` follows it again; `kimi-mode status` shows where it is"


def follower_for(o: Output) -> Follower:
    return Follower(o.out, redraws(o.out, os.environ) and not o.json)


class SwitchFollow(Follow):
    """A switch asked for and followed: the reply says it is under way (or joined, or already
    done), the events draw the live display, the end says how it went."""

    closed = "the daemon closed the connection before the switch ended (`kimi-mode status`)"

    display: Follower

    def __init__(self, args: argparse.Namespace, sock: Path, o: Output) -> None:
        super().__init__(o, sock, follower_for(o))
        self.args = args
        self.goes_on = f"the switch to {args.mode} goes on ({REJOIN})"

    def on_reply(self, msg: dict[str, Any]) -> Exit | None:
        if msg.get("data", {}).get("transition"):
            self.display.join(msg["data"]["transition"])  # joined: its target, its clock
        if not self.o.json:
            self.display.say(msg["message"])
        if msg["code"] == "already" or self.args.no_wait:
            return Exit.OK
        return None

    def on_event(self, msg: dict[str, Any]) -> None:
        if not self.o.json:
            self.display.on_event(msg)

    def on_end(self, msg: dict[str, Any]) -> Exit:
        if not self.o.json:
            self.display.finish()
            print_end(msg, self.o)
        return end_exit(msg)


def cmd_switch(args: argparse.Namespace, sock: Path) -> int:
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
    return SwitchFollow(args, sock, Output(args.output)).run(req, args.timeout)


def print_end(msg: dict[str, Any], o: Output) -> None:
    """A followed switch's last lines: its outcome, and the window it cost the service, wrapped
    at the terminal's width (80 in a pipe)."""
    lines = [("done: " if msg["ok"] else "FAILED: ") + msg["message"]]
    if said := (msg.get("data", {}).get("downtime") or {}).get("text"):
        lines.append(f"  {said}")
    print("\n".join(wrap(lines, columns(o.out) - 1)), file=o.out)
