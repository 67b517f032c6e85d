"""`kimi-mode`: what an operator types. Argument parsing and output only; the daemon does the
work. The exit codes every command shares are in cli/switch.py (and docs/control-protocol.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.render import (
    format_history,
    format_status,
)
from kimi_supervisor.cli.switch import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    cmd_switch,
)
from kimi_supervisor.control.client import TimedOut, Unreachable, exchange
from kimi_supervisor.control.protocol import MAX_PROFILE_S
from kimi_supervisor.version import package_version

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
    from kimi_supervisor.config import ConfigError, load_config

    try:
        return load_config(path).control.socket
    except ConfigError as e:
        if explicit:
            raise UsageError(f"cannot use the config to find the socket:\n{e}") from None
        return DEFAULT_SOCKET


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
    """Exit 0, or 1 when the daemon is STUCK or FAILED or waits for what it cannot go on
    without (the GPU driver, systemd), so that a script or a monitor can act on `kimi-mode
    status` alone; 3 when the daemon cannot be asked."""
    _raw, msg = _one_reply(sock, {"cmd": "status"})
    if not msg["ok"]:
        print(f"kimi-mode: {msg['message']}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(msg["data"], indent=2))
    else:
        print(format_status(msg["data"]))
    data = msg["data"]
    return (
        EXIT_FAILED if data.get("state") in NEEDS_A_PERSON or data.get("waiting_for") else EXIT_OK
    )


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
        if data.get("waiting_for"):
            print(f"kimi-mode: {data['waiting_for']}", file=sys.stderr)
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
    from kimi_supervisor.cli import (
        capture as capture_client,  # it imports this module (exit codes, switches)
    )

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", help="the daemon's control socket (or KIMI_SUPERVISOR_SOCKET)")
    common.add_argument("--config", help="find the socket in this config file")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    p = argparse.ArgumentParser(
        prog="kimi-mode",
        description="Switch vLLM between production and profile mode, and see what it is doing.",
        epilog="exit codes: 0 done, 1 failed, STUCK, FAILED or waiting for the driver or "
        "systemd (status), not serving (is-serving), 2 usage, 3 daemon unreachable or "
        "refused, 4 timed out (the switch goes on), 130 Ctrl-C (the switch goes on)",
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
    c.set_defaults(fn=capture_client.cmd_capture)
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
