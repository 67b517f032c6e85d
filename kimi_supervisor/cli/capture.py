"""kimi-mode's capture client: `kimi-mode capture` (asks the daemon, passes --out as an open
directory, follows the recording and the flush, Enter stops it) and `capture --summarize DIR`
(an existing capture's summary, made here, no daemon). Switches and exit codes are kimi-mode's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

from kimi_supervisor.cli import switch as km
from kimi_supervisor.cli.render import format_capture, format_summary
from kimi_supervisor.control.client import TimedOut, Unreachable, exchange
from kimi_supervisor.model import SUMMARY


def _stop_capture(sock: Path) -> None:
    try:
        for _raw, msg in exchange(sock, {"cmd": "capture_stop"}, timeout_s=10):
            if not msg.get("ok"):
                print(f"kimi-mode: {msg.get('message')}", file=sys.stderr)
            return
    except (Unreachable, TimedOut) as e:
        print(f"kimi-mode: could not stop the recording: {e}", file=sys.stderr)


def _open_out(out: str) -> int | str:
    """--out opened here, as the asker, in the asker's view of the files (the daemon's sandbox
    has its own /tmp): the descriptor goes to the daemon with the request. Or why not."""
    try:
        return os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return "no such directory: create it first"
    except NotADirectoryError:
        return "not a directory"
    except OSError as e:
        return f"cannot open it: {e.strerror}"


def cmd_summarize(args: argparse.Namespace) -> int:
    """`capture --summarize DIR`: an existing capture's summary, made here as the caller (no
    daemon needed), written beside the traces when the folder lets us."""
    from kimi_supervisor.capture.ranks import summarize_folder  # the summarizer, only here

    folder = Path(args.summarize)
    try:
        summary, not_written = summarize_folder(folder)
    except OSError as e:
        print(f"kimi-mode: --summarize {folder}: {e.strerror}", file=sys.stderr)
        return km.EXIT_USAGE
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(summary))
        print(not_written or f"written to {folder / SUMMARY}")
    if not summary["ranks"]:
        return km.EXIT_FAILED
    return km.EXIT_OK


def cmd_capture(args: argparse.Namespace, sock: Path) -> int:
    if args.summarize:
        given = [f for f, v in (("--switch", args.switch), ("--seconds", args.seconds),
                                ("--out", args.out)) if v]  # fmt: skip
        if given:
            print(f"kimi-mode: --summarize takes no capture: drop {', '.join(given)}",
                  file=sys.stderr)  # fmt: skip
            return km.EXIT_USAGE
        return cmd_summarize(args)
    out_fd: int | None = None
    if args.out:
        opened = _open_out(args.out)
        if isinstance(opened, str):
            print(f"kimi-mode: --out {args.out}: {opened}", file=sys.stderr)
            return km.EXIT_USAGE
        out_fd = opened
    try:
        return _capture(args, sock, out_fd)
    finally:
        if out_fd is not None:
            os.close(out_fd)


def _capture(args: argparse.Namespace, sock: Path, out_fd: int | None) -> int:

    if args.switch:
        sw = argparse.Namespace(
            mode="profile", no_wait=False, timeout=None, force=False, json=args.json, for_s=None
        )
        rc = km.cmd_switch(sw, sock)
        if rc != km.EXIT_OK:
            return rc
    out = str(Path(args.out).absolute()) if args.out else None  # shown in the daemon's answers
    req = {"cmd": "capture", "seconds": args.seconds, "then": args.then, "out": out}
    stop_sent = threading.Event()

    def stop() -> None:
        if not stop_sent.is_set():
            stop_sent.set()
            _stop_capture(sock)

    def enter_stops() -> None:
        if sys.stdin.readline():  # Enter; end of input (a script's closed stdin) is not a stop
            stop()

    ended: dict[str, Any] | None = None
    try:
        for raw, msg in exchange(sock, req, fds=() if out_fd is None else (out_fd,)):
            if args.json:
                print(raw.decode(), flush=True)
            kind = msg.get("type")
            if kind == "reply":
                if (refused := km.refused(msg, args.json)) is not None:
                    return refused
                if not args.json:
                    print(msg["message"], flush=True)
            elif kind == "event":
                name, data = msg["event"], msg["data"]
                if name == "capture_recording" and not args.json:
                    if data.get("seconds"):
                        print(
                            f"recording for {data['seconds']:g} s; drive your load now", flush=True
                        )
                    else:
                        print("recording; drive your load now, press Enter to stop", flush=True)
                if name == "capture_recording" and not data.get("seconds"):
                    threading.Thread(target=enter_stops, daemon=True).start()
                elif name == "capture_flushing" and not args.json:
                    print(
                        "stopping the profiler; flushing traces (this can take minutes)", flush=True
                    )
                elif name == "capture_summarizing" and not args.json:
                    print(f"summarizing {data['files']} trace file(s)", flush=True)
                elif name == "capture_progress" and not args.json:
                    print(
                        f"  flushing: {data['files']} file(s), {data['bytes'] / 1e6:.1f} MB "
                        f"after {data['flushing_s']:.0f} s",
                        flush=True,
                    )
            elif kind == "end":
                ended = msg
                break
    except KeyboardInterrupt:
        if not stop_sent.is_set():
            stop()
            print(
                "\nkimi-mode: recording stopped; the flush goes on in the daemon "
                "(`kimi-mode status`; `kimi-mode history` lists the files when done)",
                file=sys.stderr,
            )
            return km.EXIT_INTERRUPTED
        print(
            "\nkimi-mode: stopped following; the capture goes on (`kimi-mode status`)",
            file=sys.stderr,
        )
        return km.EXIT_INTERRUPTED
    if ended is None:
        print(
            "kimi-mode: the daemon closed the connection before the capture ended", file=sys.stderr
        )
        return km.EXIT_UNREACHABLE
    if not args.json:
        print(("done: " if ended["ok"] else "FAILED: ") + ended["message"])
        if ended["ok"]:
            print(format_capture(ended["data"]))
    if args.then == "production":
        if not args.json:
            print("going back to production")
        back = argparse.Namespace(
            mode="production",
            no_wait=False,
            timeout=None,
            force=False,
            json=args.json,
            for_s=None,
        )
        rc = km.cmd_switch(back, sock)
        if rc != km.EXIT_OK:
            return rc
    return km.EXIT_OK if ended["ok"] else km.EXIT_FAILED
