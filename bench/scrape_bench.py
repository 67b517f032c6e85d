"""The figures for /metrics: root's scrapes while another user holds connections to the
daemon's metrics server, idle and trickling, and while they reopen each one the server closes;
against the server /metrics had before (wsgiref, one request at a time, no timeout).

    .venv/bin/python -m bench.scrape_bench [--seconds 12] [--write docs/performance.md]

The server is the product's (ports/metrics.py, the shipped timeout and cap) in this process; the
holder runs as uid 65534 (tests/floods.py METRICS_HOLD, through setpriv); root scrapes with the
product's HTTP client (a 2 s timeout) one after another for `--seconds`, longer than the
timeout, so that a reopening holder opens its connections again. Run as root.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from bench.common import machine
from bench.common import main as bench_main
from kimi_supervisor.ports.http import request
from kimi_supervisor.ports.metrics import MAX_CONNECTIONS, TIMEOUT_S, Metrics
from tests.conftest import as_user
from tests.floods import METRICS_HOLD

NOBODY = ("--reuid=65534", "--regid=65534", "--clear-groups")


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def before_issue_42(metrics: Metrics) -> Iterator[int]:
    """The server /metrics had before: wsgiref's, one request at a time, no timeout."""
    server = make_server(
        "127.0.0.1", 0, make_wsgi_app(metrics.registry), WSGIServer, handler_class=_Quiet
    )
    server.timeout = None

    def serve() -> None:
        with contextlib.suppress(OSError, ValueError):
            while True:
                server.handle_request()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.server_close()


@contextlib.contextmanager
def today(metrics: Metrics) -> Iterator[int]:
    port = metrics.serve("127.0.0.1", 0)
    try:
        yield port
    finally:
        metrics.close()


def scrapes(port: int, seconds: float) -> list[tuple[float, int]]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        r = request(f"http://127.0.0.1:{port}/metrics", timeout_s=2.0, max_bytes=1 << 20)
        out.append((time.monotonic() - t0, r.status))
    return out


def one(
    server: Callable[[Metrics], contextlib.AbstractContextManager[int]],
    idle: int,
    trickling: int,
    mode: str,
    seconds: float,
) -> tuple[list[tuple[float, int]], dict[str, Any], int]:
    metrics = Metrics()
    threads0 = threading.active_count()
    with server(metrics) as port:
        hold = subprocess.Popen(
            [*as_user(*NOBODY), "-c", METRICS_HOLD, "127.0.0.1", str(port), str(idle),
             str(trickling), str(seconds + 1), mode],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert hold.stdout is not None
            assert hold.stdout.readline().startswith("held 65534")
            took = scrapes(port, seconds)
            threads = threading.active_count() - threads0
            held = json.loads(hold.stdout.read() or "{}")
            hold.wait(30)
        finally:
            if hold.poll() is None:
                hold.kill()
                hold.wait()
    return took, held, threads


def row(
    what: str, bound: bool, took: list[tuple[float, int]], held: dict[str, Any], threads: int
) -> str:
    """`bound`: the target is every scrape within 1 s; otherwise (a flood) it is measured only."""
    ms = sorted(t * 1000 for t, _ in took)
    failed = sum(1 for _, status in took if status != 200)
    p99 = ms[max(int(len(ms) * 0.99) - 1, 0)]
    met = ("met" if failed == 0 and ms[-1] < 1000 else "MISSED") if bound else "-"
    target = "every scrape, < 1 s" if bound else "none: a race for the CPU"
    return (
        f"| {what} | {len(ms)} scrapes: {failed} failed; p50 {statistics.median(ms):.1f} ms, "
        f"p99 {p99:.1f} ms, max {ms[-1]:.1f} ms | {held.get('opened', '?')} | {threads} | "
        f"{target} | {met} |\n"
    )


def run(runs: int, seconds: float) -> str:
    del runs
    rows = [
        ("before (wsgiref), 1 idle connection", before_issue_42, 1, 0, "once"),
        ("today, 100 idle + 10 trickling", today, 100, 10, "once"),
        ("today, 100 idle + 10 trickling, each reopened when closed", today, 100, 10, "reopen"),
        (f"today, 500 idle + 20 trickling reopened (past the cap of {MAX_CONNECTIONS})",
         today, 500, 20, "reopen"),
    ]  # fmt: skip
    body = ""
    for what, server, idle, trickling, mode in rows:
        body += row(
            what, idle + trickling <= MAX_CONNECTIONS, *one(server, idle, trickling, mode, seconds)
        )
    return (
        f"Measured {machine()}: the metrics server in one process, uid 65534 holding the "
        f"connections, the shipped `metrics.timeout_s` ({TIMEOUT_S:g} s) and "
        f"`max_connections` ({MAX_CONNECTIONS}); root's scrapes with a 2 s timeout for "
        f"{seconds:g} s each.\n\n"
        "| holder | root's scrapes | connections the holder opened | server threads | "
        "target | |\n|---|---|---|---|---|---|\n" + body
    )


if __name__ == "__main__":
    bench_main("scrape-bench", run, 1, seconds=(float, 12.0))
