"""`kimi-mode doctor`: is this host fit to run the daemon? Each precondition checked
(cli/checks.py), what is wrong and how to fix it; exit 1 if any check failed, 0 otherwise (a
check that could not be made here is shown, and does not fail the run)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kimi_supervisor.cli import checks
from kimi_supervisor.cli.ask import status
from kimi_supervisor.cli.exits import Exit
from kimi_supervisor.cli.output import CheckOut, DoctorOut, Output

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
    daemon = checks.check_daemon(sock, status)
    results.append(daemon)
    if (m := checks.check_metrics(config, bool(daemon.ok))) is not None:
        results.append(m)
    return _report(o, results)


def _report(o: Output, results: list[CheckOut]) -> int:
    failed = [c for c in results if c.ok is False]
    if o.json:
        o.line(DoctorOut(ok=not failed, checks=results))
    else:
        width = max(len(c.name) for c in results)
        for c in results:
            print(f"{MARK[c.ok]:<4}  {c.name:<{width}}  {c.message}", file=o.out)
            if c.fix:
                print(f"{'':<4}  {'':<{width}}  fix: {c.fix}", file=o.out)
        unchecked = sum(1 for c in results if c.ok is None)
        verdict = (f"{len(failed)} check(s) failed" if failed else "every check passed") + (
            f", {unchecked} could not be made here" if unchecked else ""
        )
        print(verdict, file=o.out, flush=True)
    return Exit.FAILED if failed else Exit.OK
