"""`kimi-mode`: what an operator types. Argument parsing and output only; the daemon does the
work. Every command keeps one output contract (cli/output.py, docs/control-protocol.md) and one
table of exit codes (cli/exits.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from kimi_supervisor.cli.ask import history, understood
from kimi_supervisor.cli.ask import status as _status
from kimi_supervisor.cli.examples import Formatter, epilog, exit_codes, global_options
from kimi_supervisor.cli.exits import KIMI_MODE, Exit, refusal_exit
from kimi_supervisor.cli.output import IsServingOut, Output
from kimi_supervisor.cli.render import columns, format_history
from kimi_supervisor.cli.switch import cmd_switch
from kimi_supervisor.cli.watch import print_status, status_exit
from kimi_supervisor.control.client import Unreachable
from kimi_supervisor.control.protocol import MAX_PROFILE_S
from kimi_supervisor.version import package_version

DEFAULT_SOCKET = Path("/run/kimi-supervisor/control.sock")
DEFAULT_CONFIG = "/etc/kimi-supervisor/kimi-supervisor.toml"


class UsageError(Exception):
    """The command line is wrong: what, and (from the parser) the usage of the command that
    was given it."""

    def __init__(self, message: str, usage: str = "", prog: str = "kimi-mode") -> None:
        super().__init__(message)
        self.usage = usage
        self.prog = prog


def did_you_mean(value: str, choices: Sequence[str]) -> str | None:
    """What `value` most likely meant: the choices it begins (`prod`: production; `pro`:
    production or profile), else the closest spelling (`prodcution`, `stauts`); None when
    none is near."""
    import difflib

    starts = [c for c in choices if value and c.startswith(value)]
    if starts:
        return " or ".join(starts)
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.75)
    return close[0] if close else None


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are raised with its own usage (a command's error shows
    that command's usage, not kimi-mode's), and whose wrong choices say what was meant."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.format_usage(), self.prog)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is None or value in action.choices:
            return
        choices = [str(c) for c in action.choices]
        guess = did_you_mean(str(value), choices)
        if guess:
            said = f"{value!r}: did you mean {guess}?"
        else:
            said = f"{value!r} is not one of {', '.join(choices)}"
        raise argparse.ArgumentError(action, said)


def wants_json(argv: Sequence[str]) -> bool:
    """Whether a command line asks for JSON output, read before (or without) parsing it: an
    error in parsing is then said as a JSON line too."""
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a in ("--json", "-ojson", "-o=json", "--output=json") or (
            a in ("-o", "--output") and argv[i + 1 : i + 2] == ["json"]
        ):
            return True
    return False


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return n


def positive_seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not s > 0 or s == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive number of seconds")
    return s


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


def _config(args: argparse.Namespace) -> Any:
    """The config named by --config or KIMI_SUPERVISOR_CONFIG (a UsageError if it is broken),
    else the default one if it exists and can be read, else None."""
    explicit = args.config or os.environ.get("KIMI_SUPERVISOR_CONFIG")
    path = Path(explicit or DEFAULT_CONFIG)
    from kimi_supervisor.config import ConfigError
    from kimi_supervisor.configfile import load_config

    try:
        return load_config(path)
    except ConfigError as e:
        if explicit:
            raise UsageError(f"cannot use the config {path}:\n{e}") from None
        return None


def socket_path(args: argparse.Namespace) -> Path:
    """--socket, then KIMI_SUPERVISOR_SOCKET, then the config's control.socket, then default."""
    if args.socket:
        return Path(args.socket)
    env = os.environ.get("KIMI_SUPERVISOR_SOCKET")
    if env:
        return Path(env)
    explicit = args.config or os.environ.get("KIMI_SUPERVISOR_CONFIG")
    if not explicit and not Path(DEFAULT_CONFIG).exists():
        return DEFAULT_SOCKET
    config = _config(args)
    return config.control.socket if config is not None else DEFAULT_SOCKET


def cmd_status(args: argparse.Namespace, sock: Path) -> int:
    """Exit 0; 6 when STUCK; 1 when FAILED or waiting for the driver or systemd; 3 when the
    daemon cannot be asked: a script or a monitor can act on `kimi-mode status` alone."""
    o = Output(args.output)
    if args.watch:
        from kimi_supervisor.cli.watch import watch

        return watch(args, sock, o)
    data = _status(sock)
    print_status(o, data)
    return status_exit(data)


def cmd_is_serving(args: argparse.Namespace, sock: Path) -> int:
    """Like `systemctl is-active`: prints the state and mode, and exits 0 only when vLLM serves
    (in MODE, if given), 1 otherwise, 3 when the daemon cannot be asked."""
    o = Output(args.output)
    data = _status(sock)
    state, mode = data.get("state"), data.get("mode")
    serving = state == "serving" and (args.mode is None or mode == args.mode)
    if o.json:
        o.line(
            IsServingOut(
                serving=serving, state=str(state), mode=mode, waiting_for=data.get("waiting_for")
            )
        )
    elif not args.quiet:
        print(f"{state} {mode}" if mode else str(state), file=o.out)
        if data.get("waiting_for"):
            print(f"kimi-mode: {data['waiting_for']}", file=sys.stderr)
    return Exit.OK if serving else Exit.FAILED


def cmd_history(args: argparse.Namespace, sock: Path) -> int:
    o = Output(args.output)
    msg, entries = history(sock, args.n)
    if not msg["ok"]:
        return o.fail(refusal_exit(str(msg.get("code"))), str(msg.get("message", "")))
    if o.json:
        for e in entries:
            o.line({"v": 1, "type": "record", **e})
    else:
        with understood("its history"):
            text = format_history(entries, columns(o.out))
        print(text, file=o.out)
    return Exit.OK


def cmd_wait(args: argparse.Namespace, sock: Path) -> int:
    from kimi_supervisor.cli.watch import wait

    return wait(args, sock, Output(args.output))


def cmd_logs(args: argparse.Namespace, sock: Path) -> int:
    from kimi_supervisor.cli.logs import show_logs

    return show_logs(args, _config(args), Output(args.output))


def cmd_doctor(args: argparse.Namespace, sock: Path) -> int:
    from kimi_supervisor.cli.doctor import run_doctor

    return run_doctor(args, sock, Output(args.output))


# ------------------------------------------------------------------------------ the parser
def mode_argument(c: argparse.ArgumentParser, what: str) -> None:
    c.add_argument(
        "mode",
        nargs="?",
        choices=["production", "profile"],
        default=None,
        metavar="MODE",
        help=f"production or profile: {what}",
    )


def build_parser() -> argparse.ArgumentParser:
    from kimi_supervisor.cli import capture  # it imports this module's neighbours (switches)

    common = Parser(add_help=False)
    global_options(common, suppress=True)
    p = Parser(
        prog="kimi-mode",
        description="Switch vLLM between production and profile mode, and see what it is doing.",
        epilog=exit_codes(KIMI_MODE),
        formatter_class=Formatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    global_options(p, suppress=False)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            parents=[common],
            help=summary,
            description=description,
            epilog=epilog(name),
            formatter_class=Formatter,
        )

    for mode in ("production", "profile"):
        c = command(
            mode,
            f"switch to {mode} mode and follow it",
            f"Ask the daemon to switch vLLM to {mode} mode and follow the switch: the "
            "teardown's steps, what was killed and why, vLLM's load. Ctrl-C stops following; "
            "the switch goes on (kimi-mode wait follows it again). Asking for the mode that "
            "serves does nothing; asking for the mode being switched to joins that switch.",
        )
        c.add_argument("--no-wait", action="store_true", help="ask for the switch and return")
        c.add_argument(
            "--timeout",
            type=parse_duration,
            default=None,
            metavar="DURATION",
            help=f"stop following after this long (90s, 45m; exit {Exit.TIMEOUT}; the switch "
            "goes on)",
        )
        c.add_argument(
            "--force",
            action="store_true",
            help="take over from a switch to the other mode that is in progress, "
            "or cut a capture's flush short",
        )
        c.add_argument(
            "--apply",
            action="store_true",
            help=f"restart {mode} if it runs an earlier config's argv (after vllm.command was "
            "edited and the daemon reloaded): a full model load",
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
    c = command(
        "capture",
        "take a torch profiler trace",
        "Record a torch profiler trace of the vLLM in profile mode, wait for its flush, and "
        "summarize it; then go back to production (or stay). With --summarize, summarize a "
        "capture already taken, here, without the daemon; with --compare, two of them.",
    )
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
    c.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="A",
        help="take no capture: compare captures' folders, A B or several a side (A1 A2 -- B1 B2; "
        "a folder of capture folders stands for those): per class, top kernel, the collectives' "
        "wait and transfer and the late rank, each change judged against the noise",
    )
    c.add_argument("compare_b", nargs="*", default=[], help=argparse.SUPPRESS)
    c.set_defaults(fn=capture.cmd_capture)
    c = command(
        "status",
        "modes, state, unit, GPUs, last teardown",
        "What the daemon sees and does now: the desired and actual mode, the state, vLLM's "
        "unit and /health, each GPU's memory and holders, the last teardown and what it "
        f"killed, and, while vLLM does not serve, its last lines of output. Exit {Exit.STUCK} "
        f"while STUCK, {Exit.FAILED} when FAILED or waiting for the driver or systemd.",
    )
    c.add_argument(
        "-w", "--watch", action="store_true", help="show it again every --interval, until Ctrl-C"
    )
    c.add_argument(
        "--interval",
        type=positive_seconds,
        default=2.0,
        metavar="S",
        help="--watch's period (default 2)",
    )
    c.set_defaults(fn=cmd_status)
    c = command(
        "is-serving",
        f"exit {Exit.OK} only when vLLM serves (in MODE, if given), like systemctl is-active",
        f"Print the state and mode; exit {Exit.OK} only when vLLM serves (in MODE, if given), "
        f"else {Exit.FAILED}.",
    )
    mode_argument(c, "only that mode counts")
    c.add_argument("-q", "--quiet", action="store_true", help="print nothing, only exit")
    c.set_defaults(fn=cmd_is_serving)
    c = command(
        "history",
        "past switches and teardowns",
        "Past switches, teardowns (with every process killed and the evidence), captures "
        "and incidents, oldest first.",
    )
    c.add_argument("-n", type=positive_int, default=20, help="how many records (default 20)")
    c.set_defaults(fn=cmd_history)
    c = command(
        "wait",
        "follow the switch under way, or wait until MODE serves",
        "Without MODE: follow the switch in progress from its real start (after Ctrl-C, "
        "--no-wait, or from another terminal) until it ends, or return at once when there is "
        f"nothing to wait for; exit {Exit.OK} serving, {Exit.STUCK} STUCK, {Exit.FAILED} "
        f"failed, {Exit.TIMEOUT} at --timeout. With MODE, as kubectl wait: wait until vLLM "
        "serves in MODE or --timeout runs out, through STUCK retries, rollbacks, other "
        "people's switches and a restart of the daemon; the last line (a `verdict` object "
        "with -o json) says which: "
        f"exit {Exit.OK} MODE serves; {Exit.FAILED} the switch to MODE failed and was rolled "
        f"back, or the daemon gave up (FAILED); {Exit.STUCK} still STUCK at --timeout; "
        f"{Exit.TIMEOUT} --timeout ran out otherwise (nobody asked for MODE, or it still "
        f"loads); {Exit.UNREACHABLE} no daemon answered for 60 s after it had; "
        f"{Exit.INTERRUPTED} Ctrl-C, with the status last known. A switch to MODE "
        "that failed and was rolled back, with no switch asked since, is that verdict even "
        "for a wait begun after it. --timeout is a deadline for the whole wait; without it, "
        "it waits as long as that takes. Never asks for a switch.",
    )
    mode_argument(c, "wait until it serves")
    c.add_argument(
        "--timeout",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help=f"give up after this long (90s, 45m; exit {Exit.TIMEOUT}, or {Exit.STUCK} if "
        "STUCK then)",
    )
    c.set_defaults(fn=cmd_wait)
    c = command(
        "logs",
        "vLLM's output, or the daemon's (--daemon), from the journal",
        "The last lines of vLLM's unit, or of the daemon's, as journalctl -u shows them "
        "(the sandbox: from its log files); -f follows. Reading the system journal needs "
        "root or the group systemd-journal (or adm).",
    )
    c.add_argument("-f", "--follow", action="store_true", help="go on printing new lines")
    c.add_argument(
        "-n", "--lines", type=positive_int, default=50, metavar="N", help="last N (default 50)"
    )
    c.add_argument("--daemon", action="store_true", help="the daemon's log instead of vLLM's")
    c.set_defaults(fn=cmd_logs)
    c = command(
        "doctor",
        "check that this host can run the daemon, and say what to fix",
        "Check each precondition the daemon needs: the config, the GPU driver and NVML, the "
        "system bus and systemd, vLLM's unit and executable, the control group, the state "
        "directory and the stored baseline, the metrics address, nvidia-persistenced. Each "
        f"failed check says what is wrong and how to fix it. Exit {Exit.FAILED} if any failed.",
    )
    c.set_defaults(fn=cmd_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return usage_error(e, Output("json" if wants_json(argv) else "text"))
    o = Output(args.output)
    try:
        if args.fn is cmd_doctor:
            sock = _doctor_socket(args)
        elif getattr(args, "summarize", None) or getattr(args, "compare", None):
            sock = Path()  # summarizing or comparing capture folders asks no daemon
        elif args.fn is cmd_logs:
            sock = Path()  # reading logs asks no daemon
        else:
            sock = socket_path(args)
        return int(args.fn(args, sock))
    except UsageError as e:
        return o.fail(Exit.USAGE, str(e))
    except Unreachable as e:
        return o.fail(Exit.UNREACHABLE, str(e))
    except KeyboardInterrupt:  # before anything was followed (a follow says its own)
        return o.fail(Exit.INTERRUPTED, "interrupted")
    except BrokenPipeError:
        # The reader left (`| head`): never "done" for what was not seen to the end. Python
        # flushes stdout again at exit: into /dev/null, not into the closed pipe.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OUTPUT_CLOSED


def usage_error(e: UsageError, o: Output) -> int:
    """A wrong command line: in json mode one `error` line (and the message on stderr);
    otherwise the usage of the command given, and the error, as argparse says them."""
    if o.json:
        command = e.prog.removeprefix("kimi-mode").strip()
        return o.fail(Exit.USAGE, f"{command}: {e}" if command else str(e))
    print(f"{e.usage}{e.prog}: error: {e}", file=o.err, flush=True)
    return Exit.USAGE


def _doctor_socket(args: argparse.Namespace) -> Path:
    try:
        return socket_path(args)
    except UsageError:
        return DEFAULT_SOCKET  # doctor reports the broken config itself


if __name__ == "__main__":
    sys.exit(main())
