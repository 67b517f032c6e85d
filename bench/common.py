"""What every benchmark shares: polling, formatting, the machine line and the doc sections
(each benchmark owns the part of docs/performance.md between its two markers)."""

from __future__ import annotations

import datetime
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def poll(cond: Callable[[], object], timeout_s: float = 30.0, every_s: float = 0.005) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        time.sleep(every_s)


def health(url: str) -> int:
    """GET /health through the product's own HTTP port: the status code, 0 for no answer."""
    from kimi_supervisor.ports.http import request

    return request(url, timeout_s=1).status


def fmt_ms(xs: list[float]) -> str:
    """Seconds -> 'median (min–max)' in milliseconds."""
    ms = [x * 1000 for x in xs]
    return f"{statistics.median(ms):.0f} ({min(ms):.0f}–{max(ms):.0f})"


def machine() -> str:
    return (
        f"{datetime.date.today()} on {platform.node()} ({platform.machine()}, "
        f"{os.cpu_count() or 0} CPUs)"
    )


def main(
    section: str | Callable[[dict[str, Any]], str],
    run: Callable[..., str],
    runs: int,
    **options: tuple[type, object],
) -> None:
    """A benchmark's command line: --runs, its own options (name -> (type, default)) and
    --write DOC, which replaces the benchmark's section of DOC with the table it printed (the
    section may depend on the options: a callable of them)."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=runs)
    for name, (kind, default) in options.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    p.add_argument("--write", type=Path, default=None)
    args = vars(p.parse_args())
    doc = args.pop("write")
    name = section(args) if callable(section) else section
    body = run(**args)
    print(body)
    if doc:
        write_section(doc, name, body)


def write_section(doc: Path, name: str, body: str) -> None:
    """Record this run's section NAME in bench/results/ (bench/perf_tables.py) and fill DOC's
    sections from the newest records; a section DOC has no markers for is added at its end."""
    from bench import perf_tables

    perf_tables.record(name, body, command=command_line())
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = doc.read_text() if doc.exists() else ""
    if begin not in text or end not in text:
        doc.write_text(f"{text}\n## {name}\n\n{begin}\n{end}\n")
    perf_tables.write(doc)


def command_line() -> str:
    """How this benchmark was run, as one would type it again in the checkout."""
    import shlex
    import sys

    import __main__

    spec = getattr(__main__, "__spec__", None)
    program = f"-m {spec.name}" if spec is not None else shlex.quote(sys.argv[0])
    return f".venv/bin/python {program} {shlex.join(sys.argv[1:])}".rstrip()


def grow_idle(idle: list[subprocess.Popen[bytes]], n: int) -> None:
    """Start `sleep` children until `idle` holds `n`: idle processes for a scan to wade through."""
    while len(idle) < n:
        idle.append(subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL))


def reap_idle(idle: list[subprocess.Popen[bytes]]) -> None:
    """End and reap what `grow_idle` started (in a `finally`: also on failure)."""
    for p in idle:
        p.send_signal(signal.SIGKILL)
    for p in idle:
        p.wait()
