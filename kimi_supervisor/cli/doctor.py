"""`kimi-mode doctor`: is this host fit to run the daemon? Each precondition checked
(cli/checks.py), what is wrong and how to fix it; exit 1 if any check failed (a daemon that is
STUCK or FAILED fails its check, with the cause and the incident bundle's path), 0 otherwise (a
check that could not be made here is shown, and does not fail the run). Text wraps at the
terminal's width, 80 columns in a pipe, as every command's does."""

from __future__ import annotations

import argparse
from pathlib import Path

from kimi_supervisor.cli import checks
from kimi_supervisor.cli.ask import status
from kimi_supervisor.cli.exits import Exit
from kimi_supervisor.cli.output import CheckOut, DoctorOut, Output
from kimi_supervisor.cli.render import columns, wrap

MARK = {True: "ok", False: "FAIL", None: "?"}


def run_doctor(args: argparse.Namespace, sock: Path, o: Output) -> int:
    from kimi_supervisor.cli.compose import config_path
    from kimi_supervisor.config import ConfigError
    from kimi_supervisor.configfile import load_config

    path = config_path(args.config)
    results: list[CheckOut] = []
    try:
        config = load_config(path)
    except ConfigError as e:
        first = str(e).strip().splitlines()
        results.append(
            checks.bad(
                "config",
                f"{path}: {' '.join(first[:3])}",
                f"fix it (kimi-supervisor check-config {path} says what is wrong)",
            )
        )
        results.append(checks.unknown("the rest", "not checked without a valid config"))
        return _report(o, results)
    results.append(checks.ok("config", f"{path} is valid"))
    results += checks.config_checks(config, str(path))
    results += checks.check_systemd(config)
    results += checks.check_gpus(config)
    daemon, answered = checks.check_daemon(sock, status)
    results.append(daemon)
    if (m := checks.check_metrics(config, answered)) is not None:
        results.append(m)
    return _report(o, results)


def _report(o: Output, results: list[CheckOut]) -> int:
    failed = [c for c in results if c.ok is False]
    if o.json:
        o.line(DoctorOut(ok=not failed, checks=results))
    else:
        name_w = max(len(c.name) for c in results)
        hang = 4 + 2 + name_w + 2  # continuation rows under the message
        lines = []
        for c in results:
            lines.append(f"{MARK[c.ok]:<4}  {c.name:<{name_w}}  {c.message}")
            if c.fix:
                lines.append(f"{'':<4}  {'':<{name_w}}  fix: {c.fix}")
        unchecked = sum(1 for c in results if c.ok is None)
        verdict = (f"{len(failed)} check(s) failed" if failed else "every check passed") + (
            f", {unchecked} could not be made here" if unchecked else ""
        )
        width = columns(o.out) - 1
        print("\n".join([*wrap(lines, width, hang=min(hang, width // 2)), *wrap([verdict], width)]),
              file=o.out, flush=True)  # fmt: skip
    return Exit.FAILED if failed else Exit.OK
