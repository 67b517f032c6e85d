"""kimi-mode's capture client: `kimi-mode capture` (asks the daemon, passes --out as an open
directory, follows the recording and the flush, Enter stops it) and `capture --summarize DIR`
(an existing capture's summary, made here, no daemon). Switches and exit codes are kimi-mode's.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any

from kimi_supervisor.cli import ask
from kimi_supervisor.cli.exits import Exit
from kimi_supervisor.cli.follow import Follow
from kimi_supervisor.cli.output import Output
from kimi_supervisor.cli.render import columns, duration, format_capture, wrap
from kimi_supervisor.cli.summary_text import format_compare, format_summary
from kimi_supervisor.cli.switch import cmd_switch
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
    from kimi_supervisor.analysis.ranks import summarize_folder  # the summarizer, only here
    from kimi_supervisor.ports.safeopen import try_open

    o = Output(args.output)
    folder = Path(args.summarize)
    try:
        summary, not_written = summarize_folder(folder, try_open)
    except OSError as e:
        return o.fail(Exit.USAGE, f"--summarize {folder}: {e.strerror}")
    if not summary["ranks"]:
        return o.fail(Exit.FAILED, str(not_written))
    if o.json:
        o.line({"v": 1, "type": "summary", **summary})
    else:
        lines = [
            *format_summary(summary).splitlines(),
            not_written or f"written to {folder / SUMMARY}",
        ]
        print("\n".join(wrap(lines, columns(sys.stdout) - 1)))
    return Exit.OK


def _summary_of(folder: Path) -> dict[str, Any]:
    """A capture folder's summary: its summary.json when it is of this version and holds what
    the comparison reads (finite numbers where numbers go), else made again from the traces
    here (and written when the folder lets us): summary.json is a cache, the traces are the
    capture. Raises OSError."""
    from kimi_supervisor.analysis.compare import malformed
    from kimi_supervisor.analysis.ranks import SUMMARY_VERSION, read_summary, summarize_folder
    from kimi_supervisor.ports.safeopen import try_open

    found = read_summary(folder, try_open)
    if found is not None and found.get("version") == SUMMARY_VERSION and not malformed(found):
        return found
    return summarize_folder(folder, try_open)[0]


def compare_sides(given: list[str], after: list[str]) -> tuple[list[Path], list[Path]] | str:
    """`--compare A B`, `--compare A1 A2 -- B1 B2`: each side's capture folders, a folder
    that holds no trace but capture folders standing for those it holds; or what is wrong."""
    if after:
        sides = [given, after]
    elif len(given) == 2:
        sides = [given[:1], given[1:]]
    else:
        return (
            f"--compare takes A B, or several captures a side with -- between the sides "
            f"(A1 A2 -- B1 B2); {len(given)} folders were given without --"
        )
    out: list[list[Path]] = []
    for folders in sides:
        side: list[Path] = []
        for f in map(Path, folders):
            side += _captures_in(f)
        out.append(side)
    return out[0], out[1]


def _captures_in(folder: Path) -> list[Path]:
    """`folder` when it holds traces (or nothing readable to say otherwise), else the capture
    folders in it (those holding traces), by name."""
    from kimi_supervisor.analysis.ranks import rank_traces

    try:
        names = os.listdir(folder)
    except OSError:
        return [folder]  # said when it is read
    if rank_traces(names):
        return [folder]
    inner = sorted(folder / n for n in names if (folder / n).is_dir() and _holds_traces(folder / n))
    return inner or [folder]


def _holds_traces(folder: Path) -> bool:
    from kimi_supervisor.analysis.ranks import rank_traces

    try:
        return bool(rank_traces(os.listdir(folder)))
    except OSError:
        return False


def cmd_compare(args: argparse.Namespace) -> int:
    """`capture --compare A B` (or several captures a side): side by side, made here (no daemon
    needed)."""
    from kimi_supervisor.analysis.compare import CompareError, compare

    o = Output(args.output)
    sides = compare_sides(args.compare, getattr(args, "compare_b", None) or [])
    if isinstance(sides, str):
        return o.fail(Exit.USAGE, sides)
    summaries: list[list[dict[str, Any]]] = []
    for label, folders in zip("AB", sides, strict=True):
        side = []
        for folder in folders:
            try:
                side.append(_summary_of(folder))
            except OSError as e:
                return o.fail(Exit.USAGE, f"--compare {label} {folder}: {e.strerror}")
        summaries.append(side)
    try:
        c = compare(*summaries)
    except CompareError as e:
        return o.fail(Exit.USAGE, f"--compare: {e}")
    a, b = ([str(f.absolute()) for f in folders] for folders in sides)
    if o.json:
        o.line({"v": 1, "type": "compare", "a": ", ".join(a), "b": ", ".join(b),
                "a_folders": a, "b_folders": b, **c})  # fmt: skip
    else:
        text = format_compare(c, a, b)
        print("\n".join(wrap(text.splitlines(), columns(sys.stdout) - 1)))
    return Exit.OK


def cmd_capture(args: argparse.Namespace, sock: Path) -> int:
    if getattr(args, "compare_b", None) and not args.compare:
        return Output(args.output).fail(
            Exit.USAGE, f"capture takes no folder ({' '.join(args.compare_b)}) without --compare"
        )
    if args.summarize or args.compare:
        flag = "--summarize" if args.summarize else "--compare"
        given = [f for f, v in (("--switch", args.switch), ("--seconds", args.seconds),
                                ("--out", args.out),
                                ("--summarize", args.summarize and args.compare)) if v]  # fmt: skip
        if given:
            return Output(args.output).fail(
                Exit.USAGE, f"{flag} takes no capture: drop {', '.join(given)}"
            )
        return cmd_summarize(args) if args.summarize else cmd_compare(args)
    out_fd: int | None = None
    if args.out:
        opened = _open_out(args.out)
        if isinstance(opened, str):
            return Output(args.output).fail(Exit.USAGE, f"--out {args.out}: {opened}")
        out_fd = opened
    try:
        return _capture(args, sock, out_fd)
    finally:
        if out_fd is not None:
            os.close(out_fd)


def _switch_to(mode: str, args: argparse.Namespace, sock: Path) -> int:
    sw = argparse.Namespace(
        mode=mode, no_wait=False, timeout=None, force=False, output=args.output, for_s=None
    )
    return cmd_switch(sw, sock)


def _last_window(sock: Path) -> dict[str, Any] | None:
    """The last switch's unavailable window, as status says it (None if it cannot say)."""
    try:
        d = ask.status(sock).get("downtime")
    except (Unreachable, KeyError):
        return None
    return d if isinstance(d, dict) and not d.get("under_way") else None


def cost_line(windows: list[dict[str, Any]]) -> str:
    """What a capture cycle cost in service: each switch's window, and their sum."""
    said = [f"{w['window_s']:.1f} s to {w['target']}" for w in windows if w.get("window_s")]
    total = sum(w["window_s"] for w in windows if w.get("window_s"))
    return f"this capture cost {total:.1f} s without service ({', '.join(said)})"


def plan_line(last: dict[str, Any] | None) -> str:
    """What a capture by switching will cost in service, said before the first switch: two
    restarts, each a load."""
    if last is None or not last.get("window_s"):
        return ("this capture stops serving twice: a switch to profile mode and one back, each "
                "a restart and a load (none measured on this host yet)")  # fmt: skip
    w = float(last["window_s"])
    return (f"this capture stops serving for about {duration(2 * w)}: two restarts, a switch to "
            f"profile mode and one back (the last switch here took {duration(w)})")  # fmt: skip


# A capture in the mode vLLM serves (its profiler armed): said once the daemon began it.
NO_RESTART = ("no restart: vLLM serves on, slower while it records and while it flushes its "
              "traces")  # fmt: skip


class CaptureFollow(Follow):
    """A capture asked for and followed: the recording (Enter stops one without --seconds),
    the flush, the summary. Ctrl-C stops the recording first, then the following; the end is
    kept in `ended` for what comes after it."""

    def __init__(self, o: Output, sock: Path, switched: bool = False) -> None:
        super().__init__(o, sock)
        self.switched = switched
        self.ended: dict[str, Any] | None = None
        self.stop_sent = threading.Event()

    def stop(self) -> None:
        if not self.stop_sent.is_set():
            self.stop_sent.set()
            _stop_capture(self.sock)

    def enter_stops(self) -> None:
        if sys.stdin.readline():  # Enter; end of input (a script's closed stdin) is not a stop
            self.stop()

    def on_reply(self, msg: dict[str, Any]) -> Exit | None:
        if not self.o.json:
            print("\n".join(wrap([msg["message"]], columns(sys.stdout) - 1)), flush=True)
        return None

    def on_event(self, msg: dict[str, Any]) -> None:
        name, data, text = msg["event"], msg["data"], not self.o.json
        if name == "capture_recording" and text:
            if not self.switched:
                print("\n".join(wrap([NO_RESTART], columns(sys.stdout) - 1)), flush=True)
            if data.get("seconds"):
                print(f"recording for {data['seconds']:g} s; drive your load now", flush=True)
            else:
                print("recording; drive your load now, press Enter to stop", flush=True)
        if name == "capture_recording" and not data.get("seconds"):
            threading.Thread(target=self.enter_stops, daemon=True).start()
        elif name == "capture_flushing" and text:
            print("stopping the profiler; flushing traces (this can take minutes)", flush=True)
        elif name == "capture_summarizing" and text:
            print(f"summarizing {data['files']} trace file(s)", flush=True)
        elif name == "capture_measuring" and text:
            print(f"reading vLLM's tokens/s after the flush (at most {data['seconds']:g} s)",
                  flush=True)  # fmt: skip
        elif name == "capture_progress" and text:
            print(
                f"  flushing: {data['files']} file(s), {data['bytes'] / 1e6:.1f} MB "
                f"after {data['flushing_s']:.0f} s",
                flush=True,
            )

    def on_end(self, msg: dict[str, Any]) -> Exit:
        self.ended = msg
        return Exit.OK if msg["ok"] else Exit.FAILED

    def on_interrupt(self) -> Exit:
        if not self.stop_sent.is_set():
            self.stop()
            print(
                "\nkimi-mode: recording stopped; the flush goes on in the daemon "
                "(`kimi-mode status`; `kimi-mode history` lists the files when done)",
                file=sys.stderr,
            )
            return Exit.INTERRUPTED
        print(
            "\nkimi-mode: stopped following; the capture goes on (`kimi-mode status`)",
            file=sys.stderr,
        )
        return Exit.INTERRUPTED

    def on_closed(self) -> Exit:
        print(
            "kimi-mode: the daemon closed the connection before the capture ended", file=sys.stderr
        )
        return Exit.UNREACHABLE


def _capture(args: argparse.Namespace, sock: Path, out_fd: int | None) -> int:
    o = Output(args.output)
    windows: list[dict[str, Any]] = []
    if args.switch:
        if not o.json:
            print("\n".join(wrap([plan_line(_last_window(sock))], columns(sys.stdout) - 1)),
                  flush=True)  # fmt: skip
        rc = _switch_to("profile", args, sock)
        if rc != Exit.OK:
            return rc
        if (w := _last_window(sock)) is not None:
            windows.append(w)
    out = str(Path(args.out).absolute()) if args.out else None  # shown in the daemon's answers
    req = {"cmd": "capture", "seconds": args.seconds, "then": args.then, "out": out}
    follow = CaptureFollow(o, sock, switched=args.switch)
    captured = follow.run(req, fds=() if out_fd is None else (out_fd,))
    ended = follow.ended
    if ended is None:
        return captured
    if not o.json:
        head = ("done: " if ended["ok"] else "FAILED: ") + ended["message"]
        print("\n".join(wrap([head], columns(sys.stdout) - 1)))
        if ended["ok"]:
            print(format_capture(ended["data"], columns(sys.stdout)))
    if args.then == "production":
        if not o.json:
            print("going back to production")
        rc = _switch_to("production", args, sock)
        if rc != Exit.OK:
            return rc
        if (w := _last_window(sock)) is not None:
            windows.append(w)
    if windows and not o.json:
        print(cost_line(windows))
    return captured
