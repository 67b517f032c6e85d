"""`kimi-mode`: what an operator types. Argument parsing and output only; the daemon does the
work. Exit codes (as documented in docs/control-protocol.md):

    0  done (or nothing to do)
    1  the switch failed, or its teardown ended STUCK
    2  usage error
    3  the daemon is unreachable, or refused the request
    4  timed out waiting (the switch goes on)
  130  interrupted with Ctrl-C while following (the switch goes on)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from supervisor.capturesummary import SUMMARY, summarize_folder
from supervisor.capturesummary import render as render_summary
from supervisor.control.client import TimedOut, Unreachable, exchange
from supervisor.control.protocol import MAX_PROFILE_S
from supervisor.control.render import (
    Follower,
    format_capture,
    format_history,
    format_status,
    redraws,
)
from supervisor.version import package_version

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_TIMEOUT, EXIT_INTERRUPTED = (
    0,
    1,
    2,
    3,
    4,
    130,
)
DEFAULT_SOCKET = Path("/run/kimi-supervisor/control.sock")
DEFAULT_CONFIG = "/etc/kimi-supervisor/kimi-supervisor.toml"


class UsageError(Exception):
    pass


def parse_duration(text: str) -> float:
    """'2h', '90m', '1h30m', '45s', '1d' or plain seconds -> seconds."""
    import re

    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        seconds = float(t)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([dhms])", t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a duration: use e.g. 2h, 90m, 1h30m, 45s"
            )
        unit = {"d": 86400, "h": 3600, "m": 60, "s": 1}
        seconds = sum(float(n) * unit[u] for n, u in parts)
    if seconds <= 0:
        raise argparse.ArgumentTypeError("the duration must be positive")
    if seconds > MAX_PROFILE_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is longer than the daemon accepts ({MAX_PROFILE_S / 86400:g}d)"
        )
    return seconds


def socket_path(args: argparse.Namespace) -> Path:
    """--socket, then KIMI_SUPERVISOR_SOCKET, then the config's control.socket, then default."""
    if args.socket:
        return Path(args.socket)
    env = os.environ.get("KIMI_SUPERVISOR_SOCKET")
    if env:
        return Path(env)
    explicit = args.config or os.environ.get("KIMI_SUPERVISOR_CONFIG")
    path = Path(explicit or DEFAULT_CONFIG)
    if not explicit and not path.exists():
        return DEFAULT_SOCKET
    from supervisor.config import ConfigError, load_config

    try:
        return load_config(path).control.socket
    except ConfigError as e:
        if explicit:
            raise UsageError(f"cannot use the config to find the socket:\n{e}") from None
        return DEFAULT_SOCKET


# ------------------------------------------------------------------------------ formatting
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
                if (refused := _refused(msg, args.json)) is not None:
                    return refused
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


def _refused(msg: dict[str, Any], as_json: bool) -> int | None:
    """The exit code for a reply that refuses the request (said on stderr), else None."""
    if msg["ok"]:
        return None
    if not as_json:
        print(f"kimi-mode: {msg['message']}", file=sys.stderr)
    return _refusal_exit(msg["code"])


def _refusal_exit(code: str) -> int:
    """A refused request: the request was wrong (2), the host is busy or in the wrong mode (1),
    or the daemon refused the caller or failed (3)."""
    if code in ("bad_request", "bad_json", "too_long", "unsupported_version"):
        return EXIT_USAGE
    if code in ("busy", "wrong_mode", "stopping", "no_capture"):
        return EXIT_FAILED
    return EXIT_UNREACHABLE


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
    folder = Path(args.summarize)
    try:
        summary, not_written = summarize_folder(folder)
    except OSError as e:
        print(f"kimi-mode: --summarize {folder}: {e.strerror}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps(summary))
    else:
        print(render_summary(summary))
        print(not_written or f"written to {folder / SUMMARY}")
    if not summary["ranks"]:
        return EXIT_FAILED
    return EXIT_OK


def cmd_capture(args: argparse.Namespace, sock: Path) -> int:
    if args.summarize:
        given = [f for f, v in (("--switch", args.switch), ("--seconds", args.seconds),
                                ("--out", args.out)) if v]  # fmt: skip
        if given:
            print(f"kimi-mode: --summarize takes no capture: drop {', '.join(given)}",
                  file=sys.stderr)  # fmt: skip
            return EXIT_USAGE
        return cmd_summarize(args)
    out_fd: int | None = None
    if args.out:
        opened = _open_out(args.out)
        if isinstance(opened, str):
            print(f"kimi-mode: --out {args.out}: {opened}", file=sys.stderr)
            return EXIT_USAGE
        out_fd = opened
    try:
        return _capture(args, sock, out_fd)
    finally:
        if out_fd is not None:
            os.close(out_fd)


def _capture(args: argparse.Namespace, sock: Path, out_fd: int | None) -> int:
    import threading

    if args.switch:
        sw = argparse.Namespace(
            mode="profile", no_wait=False, timeout=None, force=False, json=args.json, for_s=None
        )
        rc = cmd_switch(sw, sock)
        if rc != EXIT_OK:
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
                if (refused := _refused(msg, args.json)) is not None:
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
            return EXIT_INTERRUPTED
        print(
            "\nkimi-mode: stopped following; the capture goes on (`kimi-mode status`)",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    if ended is None:
        print(
            "kimi-mode: the daemon closed the connection before the capture ended", file=sys.stderr
        )
        return EXIT_UNREACHABLE
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
        rc = cmd_switch(back, sock)
        if rc != EXIT_OK:
            return rc
    return EXIT_OK if ended["ok"] else EXIT_FAILED


def _one_reply(
    sock: Path, req: dict[str, Any], timeout_s: float = 10.0
) -> tuple[bytes, dict[str, Any]]:
    try:
        for raw, msg in exchange(sock, req, timeout_s=timeout_s):
            return raw, msg
    except TimedOut:
        raise Unreachable(f"the daemon did not answer within {timeout_s:g} s") from None
    raise Unreachable("the daemon closed the connection without answering")


# A daemon in these states needs a person (STUCK: the GPUs are not clean; FAILED: it gave up).
NEEDS_A_PERSON = ("stuck", "failed")


def cmd_status(args: argparse.Namespace, sock: Path) -> int:
    """Exit 0, or 1 when the daemon is STUCK or FAILED, so that a script or a monitor can act on
    `kimi-mode status` alone; 3 when the daemon cannot be asked."""
    _raw, msg = _one_reply(sock, {"cmd": "status"})
    if not msg["ok"]:
        print(f"kimi-mode: {msg['message']}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(msg["data"], indent=2))
    else:
        print(format_status(msg["data"]))
    return EXIT_FAILED if msg["data"].get("state") in NEEDS_A_PERSON else EXIT_OK


def cmd_is_serving(args: argparse.Namespace, sock: Path) -> int:
    """Like `systemctl is-active`: prints the state and mode, and exits 0 only when vLLM serves
    (in MODE, if given), 1 otherwise, 3 when the daemon cannot be asked."""
    _raw, msg = _one_reply(sock, {"cmd": "status"})
    if not msg["ok"]:
        print(f"kimi-mode: {msg['message']}", file=sys.stderr)
        return EXIT_UNREACHABLE
    data = msg["data"]
    state, mode = data.get("state"), data.get("mode")
    if not args.quiet:
        print(f"{state} {mode}" if mode else str(state))
    serving = state == "serving" and (args.mode is None or mode == args.mode)
    return EXIT_OK if serving else EXIT_FAILED


def cmd_history(args: argparse.Namespace, sock: Path) -> int:
    _raw, msg = _one_reply(sock, {"cmd": "history", "n": args.n})
    if not msg["ok"]:
        print(f"kimi-mode: {msg['message']}", file=sys.stderr)
        return EXIT_UNREACHABLE
    entries = msg["data"]["entries"]
    if args.json:
        for e in entries:
            print(json.dumps(e))
    else:
        print(format_history(entries))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", help="the daemon's control socket (or KIMI_SUPERVISOR_SOCKET)")
    common.add_argument("--config", help="find the socket in this config file")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    p = argparse.ArgumentParser(
        prog="kimi-mode",
        description="Switch vLLM between production and profile mode, and see what it is doing.",
        epilog="exit codes: 0 done, 1 failed, STUCK or FAILED (status), not serving "
        "(is-serving), 2 usage, 3 daemon unreachable or refused, 4 timed out (the switch goes "
        "on), 130 Ctrl-C (the switch goes on)",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(
        dest="cmd",
        required=True,
        metavar="{production,profile,capture,status,is-serving,history}",
    )
    for mode in ("production", "profile"):
        c = sub.add_parser(mode, parents=[common], help=f"switch to {mode} mode and follow it")
        c.add_argument("--no-wait", action="store_true", help="ask for the switch and return")
        c.add_argument(
            "--timeout",
            type=float,
            default=None,
            metavar="S",
            help="stop following after S seconds (exit 4; the switch goes on)",
        )
        c.add_argument(
            "--force",
            action="store_true",
            help="take over from a switch to the other mode that is in progress, "
            "or cut a capture's flush short",
        )
        if mode == "profile":
            c.add_argument(
                "--for",
                dest="for_s",
                type=parse_duration,
                metavar="DURATION",
                help="go back to production after this long (2h, 90m, 1h30m); "
                "asking again extends it",
            )
        c.set_defaults(fn=cmd_switch, mode=mode)
    c = sub.add_parser("capture", parents=[common], help="take a torch profiler trace")
    c.add_argument(
        "--seconds",
        type=parse_duration,
        default=None,
        metavar="S",
        help="record this long (default: until Enter is pressed)",
    )
    c.add_argument(
        "--then",
        choices=["production", "stay"],
        default="production",
        help="afterwards: back to production (default), or stay in profile mode",
    )
    c.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="put the traces here (default: a new folder under profiling.captures_dir)",
    )
    c.add_argument(
        "--switch",
        action="store_true",
        help="switch to profile mode first if vLLM is in production",
    )
    c.add_argument(
        "--summarize",
        default=None,
        metavar="DIR",
        help="take no capture: summarize the one in DIR (steps, time per step, communication, "
        "GEMM and attention shares, top kernels) and write DIR/summary.json",
    )
    c.set_defaults(fn=cmd_capture)
    c = sub.add_parser("status", parents=[common], help="modes, state, unit, GPUs, last teardown")
    c.set_defaults(fn=cmd_status)
    c = sub.add_parser(
        "is-serving",
        parents=[common],
        help="exit 0 only when vLLM serves (in MODE, if given), like systemctl is-active",
    )
    c.add_argument("mode", nargs="?", choices=["production", "profile"], default=None)
    c.add_argument("-q", "--quiet", action="store_true", help="print nothing, only exit")
    c.set_defaults(fn=cmd_is_serving)
    c = sub.add_parser("history", parents=[common], help="past switches and teardowns")
    c.add_argument("-n", type=int, default=20, help="how many records (default 20)")
    c.set_defaults(fn=cmd_history)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "timeout", None) is not None and args.timeout <= 0:
        parser.error("--timeout must be positive")
    if getattr(args, "n", 1) < 1:
        parser.error("-n must be at least 1")
    try:
        # Summarizing a capture folder talks to no daemon: no socket, no config needed.
        sock = Path() if getattr(args, "summarize", None) else socket_path(args)
        return int(args.fn(args, sock))
    except UsageError as e:
        print(f"kimi-mode: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Unreachable as e:
        print(f"kimi-mode: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
