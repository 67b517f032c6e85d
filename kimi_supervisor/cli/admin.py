"""`kimi-supervisor`: the daemon's admin subcommands. Argument parsing and output only."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kimi_supervisor.cli.compose import config_path, managed_indices, ports
from kimi_supervisor.cli.exits import KIMI_SUPERVISOR, Exit
from kimi_supervisor.cli.run import cmd_reload, cmd_run
from kimi_supervisor.config import ConfigError
from kimi_supervisor.configfile import load_config
from kimi_supervisor.model import program
from kimi_supervisor.version import package_version

if TYPE_CHECKING:
    from kimi_supervisor.model import TeardownReport


STARTABLE = ("vllm executable", "control group")


def cmd_check_config(args: argparse.Namespace) -> int:
    """The config's syntax and values (exit 2 if invalid), then what can be checked of this host
    against it: the vLLM executable, the group, the directories (exit 1 if one fails). The
    checks are TOML comments, so the output stays a valid config."""
    from kimi_supervisor.cli.checks import NOT_CHECKED, config_checks

    config = load_config(args.path)
    print(f"# {args.path}: valid. Effective configuration, defaults included:")
    print(config.effective_toml(), end="")
    if args.no_host_checks:
        return Exit.OK
    results = config_checks(config, str(args.path))
    print("\n# What this host has of it:")
    for c in results:
        mark = {True: "ok  ", False: "FAIL", None: "?   "}[c.ok]
        print(f"# {mark} {c.name}: {c.message}" + (f"\n#      fix: {c.fix}" if c.fix else ""))
    print("# Not checked here: " + "; ".join(NOT_CHECKED) + ".")
    failed = [c for c in results if c.ok is False]
    for c in failed:  # what the package's postinst says when it does not start the daemon
        print(f"{c.message} ({c.fix})", file=sys.stderr)
    if args.startable:
        # The package's postinst starts the daemon on a first install only when this holds:
        # what stops it from serving (no vLLM to run, no group for the socket); the rest is
        # reported above and fails a plain check-config.
        failed = [c for c in failed if c.name in STARTABLE]
    return Exit.FAILED if failed else Exit.OK


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kimi_supervisor.store import baseline

    config = load_config(config_path(args.config))
    _, gpu = ports(config)
    try:
        fresh = baseline.calibrate(gpu, managed_indices(config, gpu))
    except baseline.BaselineError as e:
        print(f"kimi-supervisor calibrate: {e}", file=sys.stderr)
        return Exit.FAILED
    baseline.save(config.state.dir, fresh)
    for index, mib in sorted(fresh.devices.items()):
        print(f"GPU {index}: baseline {mib} MiB")
    print(f"driver {fresh.driver_version}; saved to {baseline.baseline_path(config.state.dir)}")
    return Exit.OK


def cmd_teardown(args: argparse.Namespace) -> int:
    from kimi_supervisor import log
    from kimi_supervisor.ports.clock import SystemClock
    from kimi_supervisor.store import baseline, history
    from kimi_supervisor.teardown.escalation import Teardown

    config = load_config(config_path(args.config))
    from kimi_supervisor.control.server import running_daemon

    pid = running_daemon(config.control.socket)
    if pid is not None:
        print(
            f"kimi-supervisor teardown: the daemon is running (PID {pid}) and would bring vLLM "
            "back: `systemctl stop kimi-supervisor` tears down by itself; run this only while "
            "it is stopped",
            file=sys.stderr,
        )
        return Exit.USAGE
    systemd, gpu = ports(config)
    indices = managed_indices(config, gpu)
    base, fresh = baseline.resolve(
        gpu, indices, config.gpus.baseline_mib, state_dir=config.state.dir
    )
    if fresh is not None:
        baseline.save(config.state.dir, fresh)
    log.configure(stream=sys.stderr)
    logger = log.get()
    report = Teardown(
        config,
        systemd,
        gpu,
        SystemClock(),
        base,
        on_event=lambda e: logger.info(e.kind, **e.data()),
    ).run()
    history.append(config.state.dir, "teardown", report)
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(format_report(report))
    return Exit.OK if report.outcome.value == "clean" else Exit.FAILED


def format_report(report: TeardownReport) -> str:
    lines = [
        f"teardown of {report.unit}: {report.outcome.value.upper()} in {report.duration_s:.2f} s"
    ]
    for s in report.steps:
        lines.append(f"  {s.step.value:<17} {s.duration_s:6.2f} s  {s.note}")
    for k in report.kills:
        if k.signal == "SIGKILL":
            name = program(k.process.cmdline, k.process.comm)
            lines.append(
                f"  killed PID {k.process.pid} ({name}) in {k.step.value}: "
                f"{k.evidence.value}; {k.result}"
            )
    for d in report.devices:
        lines.append(f"  GPU {d.index}: {d.used_mib} MiB used, baseline {d.baseline_mib} MiB")
    if report.shm_removed:
        lines.append(f"  removed from /dev/shm: {', '.join(report.shm_removed)}")
    if report.outcome.value != "clean":
        lines.append(f"  diagnosis: {report.diagnosis}")
        from kimi_supervisor.cli.render import format_remaining

        remaining = report.model_dump(mode="json")["remaining"]
        lines += ["  " + x for x in format_remaining(remaining)]
        lines.append(f"  next: {report.next_action}")
    from kimi_supervisor.cli.render import columns, wrap

    return "\n".join(wrap(lines, columns(sys.stdout) - 1))


def cmd_launch_vllm(args: argparse.Namespace) -> int:
    from kimi_supervisor.ports.launcher import LaunchError, exec_vllm

    try:
        exec_vllm(Path(args.argv_file))
    except LaunchError as e:
        print(f"kimi-supervisor launch-vllm: {e}", file=sys.stderr)
        return Exit.FAILED
    return Exit.FAILED  # not reached: exec replaced this process


def cmd_launch_record(args: argparse.Namespace) -> int:
    from kimi_supervisor.ports.launcher import LaunchError, record_launch

    try:
        why = record_launch(Path(args.argv_file), args.pid)
    except (LaunchError, OSError) as e:
        why = str(e)
    if why:
        print(f"kimi-supervisor launch-record: {why}", file=sys.stderr)
        return Exit.FAILED
    return Exit.OK


def cmd_sandbox(args: argparse.Namespace) -> int:
    from kimi_supervisor.sandbox import simgpu
    from kimi_supervisor.sandbox.sandbox import Sandbox

    root = Path(args.dir)
    if args.sandbox_cmd == "up":
        sb = Sandbox.up(
            root,
            gpus=args.gpus,
            release_delay_s=(
                simgpu.DRIVER_RELEASE_S if args.release_delay is None else args.release_delay
            ),
            daemon=not args.no_daemon,
            real_gpus=args.real_gpus,
        )
        print(
            f"# sandbox up in {sb.root}: systemd --user PID {sb.manager.pid}, "
            f"{len(sb.config().gpus.managed) if sb.real_gpus else args.gpus} "
            f"{'real' if sb.real_gpus else 'simulated'} GPU(s), config {sb.config_path}"
            + ("" if args.no_daemon else f", daemon {sb.socket_path}"),
            file=sys.stderr,
        )
        print(f'# `eval "$(cat {sb.root}/env.sh)"` or paste these:', file=sys.stderr)
        print(sb.exports(), end="")
    elif args.sandbox_cmd == "ghost":
        sb = Sandbox.attach(root)
        refs = sb.start_ghost_tree(
            args.gpu, args.mib, args.title, hidden=args.hidden, fork_helper=args.helper
        )
        if args.helper:
            import signal

            from kimi_supervisor.ports import processes

            # The incident: the process that took the memory dies; its forked helper keeps it.
            processes.send_signal(refs[0], signal.SIGKILL)
        print(refs[-1].pid)
    elif args.sandbox_cmd == "down":
        Sandbox.attach(root).down()
        print(f"# sandbox in {root} is down", file=sys.stderr)
    return Exit.OK


CONFIG_HELP = (
    "the config file (default: $KIMI_SUPERVISOR_CONFIG, else "
    "/etc/kimi-supervisor/kimi-supervisor.toml)"
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kimi-supervisor",
        description="The daemon that owns vllm-kimi-k25.service and its GPUs (`run`, started by "
        "kimi-supervisor.service), and the operator's commands around it. Switch modes with "
        "kimi-mode.",
        epilog="exit codes: "
        + ", ".join(f"{code} {what}" for code, what in KIMI_SUPERVISOR.items()),
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser(
        "check-config",
        help="validate a config file, print the effective config and check this host against it",
    )
    c.add_argument("path", type=Path, help="the config file to check")
    c.add_argument(
        "--startable",
        action="store_true",
        help=f"exit {Exit.FAILED} only for what keeps the daemon from serving (vllm.command[0] "
        "not an executable file, no control group); the other checks are still shown",
    )
    c.add_argument(
        "--no-host-checks",
        action="store_true",
        help="validate the file alone, check nothing of this host (a file written for another "
        "host, or before vLLM is installed: an ansible validate)",
    )
    c.set_defaults(fn=cmd_check_config)

    c = sub.add_parser("calibrate", help="measure each managed GPU's baseline footprint")
    c.add_argument("--config", default=None, help=CONFIG_HELP)
    c.set_defaults(fn=cmd_calibrate)

    c = sub.add_parser("teardown", help="tear the unit down now until the GPUs are verified clean")
    c.add_argument("--config", default=None, help=CONFIG_HELP)
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.set_defaults(fn=cmd_teardown)

    c = sub.add_parser(
        "reload", help="re-execute the daemon and wait until it is back (the unit's ExecReload)"
    )
    c.add_argument("--config", default=None, help=CONFIG_HELP)
    c.add_argument("--pid", type=int, required=True, help="the daemon's PID ($MAINPID)")
    c.set_defaults(fn=cmd_reload)

    c = sub.add_parser("run", help="the daemon (started by kimi-supervisor.service)")
    c.add_argument("--config", default=None, help=CONFIG_HELP)
    c.set_defaults(fn=cmd_run)

    c = sub.add_parser("launch-vllm", help="(used by the unit) exec vLLM with the argv from a file")
    c.add_argument("--argv-file", required=True, help="the JSON list the daemon wrote")
    c.set_defaults(fn=cmd_launch_vllm)

    c = sub.add_parser(
        "launch-record", help="(used by the unit, as root) record which mode vLLM's MainPID runs"
    )
    c.add_argument("--argv-file", required=True, help="the JSON list the daemon wrote")
    c.add_argument("--pid", type=int, required=True, help="vLLM's MainPID ($MAINPID)")
    c.set_defaults(fn=cmd_launch_record)

    sb = sub.add_parser("sandbox", help="an isolated systemd manager, simulated GPUs, fake vLLM")
    sbs = sb.add_subparsers(dest="sandbox_cmd", required=True)
    up = sbs.add_parser("up", help="start a sandbox and print its shell exports")
    up.add_argument(
        "--dir",
        required=True,
        metavar="DIR",
        help="the sandbox's own folder (made if missing): its config, state, simulated GPUs, "
        "logs and the user manager's runtime; `ghost` and `down` take the same",
    )
    up.add_argument(
        "--gpus",
        type=int,
        default=8,
        metavar="N",
        help="how many simulated GPUs, each an H200 of 143,771 MiB (default 8)",
    )
    up.add_argument(
        "--release-delay",
        type=float,
        default=None,
        metavar="S",
        help="seconds the simulated driver takes to free a dead process's memory "
        "(default: 0.15, as measured on an H200)",
    )
    up.add_argument(
        "--no-daemon", action="store_true", help="do not start kimi-supervisor.service in it"
    )
    up.add_argument(
        "--real-gpus",
        action="store_true",
        help="use this host's NVIDIA GPUs (NVML; the fake vLLM allocates with CUDA) instead of "
        "simulated ones; --gpus caps how many",
    )
    gh = sbs.add_parser("ghost", help="start a detached process outside every unit holding memory")
    gh.add_argument("--dir", required=True, metavar="DIR", help="the folder given to `up`")
    gh.add_argument("--gpu", default="all", help="an index, a list like 0,1, or all")
    gh.add_argument("--mib", type=int, default=1024, help="MiB per GPU; 0 holds the files only")
    gh.add_argument("--title", default="python", help="its process title (argv and comm)")
    gh.add_argument("--hidden", action="store_true", help="hide it from the GPU process lists")
    gh.add_argument(
        "--helper",
        metavar="TITLE",
        help="fork a helper titled TITLE that inherits the memory, then kill the ghost: NVML "
        "lists the dead PID and the helper holds the GPUs (the seed's incident); prints the "
        "helper's PID",
    )
    dn = sbs.add_parser("down", help="stop everything the sandbox started")
    dn.add_argument("--dir", required=True, metavar="DIR", help="the folder given to `up`")
    sb.set_defaults(fn=cmd_sandbox)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"kimi-supervisor: configuration error:\n{e}", file=sys.stderr)
        return Exit.USAGE
    except Exception as e:
        from kimi_supervisor.ports.gpu import GpuUnavailable
        from kimi_supervisor.ports.systemd import SystemdError
        from kimi_supervisor.sandbox.sandboxconfig import SandboxError
        from kimi_supervisor.sandbox.usermanager import ManagerUnavailable
        from kimi_supervisor.store.baseline import BaselineError

        known = (GpuUnavailable, SystemdError, SandboxError, ManagerUnavailable, BaselineError)
        if isinstance(e, known):
            print(f"kimi-supervisor: {e}", file=sys.stderr)
            return Exit.FAILED
        raise


if __name__ == "__main__":
    sys.exit(main())
