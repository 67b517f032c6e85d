"""The daemon's /metrics server (ports/metrics.py) with real sockets: idle, trickling, many and
slow clients of another user never hold back root's scrapes; its threads and connections stay
bounded; every connection is closed at its deadline."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kimi_supervisor.ports.http import request
from kimi_supervisor.ports.metrics import (
    GPU_HEALTH_SIGNALS,
    MAX_REQUEST_BYTES,
    Metrics,
    MetricsServer,
)
from tests.conftest import as_user
from tests.floods import METRICS_HOLD

NOBODY = ("--reuid=65534", "--regid=65534", "--clear-groups")
TIMEOUT_S = 1.0
CAP = 64


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics()
    try:
        yield m
    finally:
        m.close()


def _serve(m: Metrics, timeout_s: float = TIMEOUT_S, cap: int = CAP) -> int:
    return m.serve("127.0.0.1", 0, timeout_s, max_connections=cap)


def _scrape(port: int, path: str = "/metrics") -> tuple[float, int, str]:
    t0 = time.monotonic()
    r = request(f"http://127.0.0.1:{port}{path}", timeout_s=10, max_bytes=1 << 22)
    return time.monotonic() - t0, r.status, r.body


def _dropped(body: str, reason: str) -> float:
    line = f'kimi_supervisor_metrics_connections_dropped_total{{reason="{reason}"}} '
    values = [float(x.removeprefix(line)) for x in body.splitlines() if x.startswith(line)]
    return values[0] if values else 0.0


def _metrics_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "metrics"]


@pytest.mark.skipif(os.geteuid() != 0, reason="holds the connections as another user (setpriv)")
def test_root_scrapes_answer_at_once_while_another_user_holds_100_idle_and_10_trickling_connections(
    metrics: Metrics,
) -> None:
    before = threading.active_count()
    # The held connections' deadline is long: a scrape that waited behind one would take it
    # whole (10 s), one served at once takes a fraction of that even on a loaded host.
    deadline_s = 10.0
    port = _serve(metrics, timeout_s=deadline_s)
    hold = subprocess.Popen(
        [*as_user(*NOBODY), "-c", METRICS_HOLD, "127.0.0.1", str(port), "100", "10", "30", "once"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert hold.stdout is not None
        assert hold.stdout.readline() == "held 65534\n"  # all 110 open, as nobody
        scrapes = [_scrape(port) for _ in range(10)]
        open_then = metrics._server.open_connections() if metrics._server else -1
        threads_then = threading.active_count()
        out = hold.stdout.read()  # the client ends once the server has closed them all
        hold.wait(30)
    finally:
        if hold.poll() is None:
            hold.kill()
            hold.wait()
    assert all(status == 200 for _took, status, _body in scrapes), scrapes
    assert max(took for took, _s, _b in scrapes) < 5.0, [round(t, 3) for t, _s, _b in scrapes]
    assert 0 < open_then <= CAP  # the rest were closed for newer ones: bounded
    # One thread, whatever comes (another test's thread may still be ending: at most one more).
    assert threads_then <= before + 1 and len(_metrics_threads()) == 1
    held = json.loads(out)
    assert held["opened"] == 110 and held["still_open"] == 0, held
    closed = held["closed_after_s"]
    assert len(closed) == 110 and max(closed) < deadline_s + 5.0, sorted(closed)[-5:]
    # The trickling ones (opened last, never evicted) lasted until their deadline, no longer.
    assert sum(1 for s in closed if s >= deadline_s - 0.2) >= 10, sorted(closed)
    _took, _status, body = _scrape(port)
    assert _dropped(body, "timeout") >= 10 and _dropped(body, "evicted") >= 110 - CAP, body


def test_a_scraper_that_never_reads_is_closed_at_its_deadline_and_holds_back_no_scrape() -> None:
    big = b"x" * (16 << 20)  # more than the kernel's buffers on both ends hold

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [big if environ["PATH_INFO"] == "/big" else b"small\n"]

    dropped: list[str] = []
    server = MetricsServer(
        app, "127.0.0.1", 0, timeout_s=TIMEOUT_S, max_connections=CAP, dropped=dropped.append
    )
    slow = socket.socket()
    try:
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", server.port))
        slow.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = time.monotonic()
        took, status, body = _scrape(server.port)
        assert (status, body) == (200, "small\n") and took < 1.0, took
        # The slow one reads nothing until past its deadline, then all it can.
        time.sleep(max(0.0, TIMEOUT_S + 0.5 - (time.monotonic() - t0)))
        assert dropped == ["timeout"] and server.open_connections() == 0
        slow.settimeout(10)
        got = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := slow.recv(1 << 20):
                got += len(chunk)
    finally:
        slow.close()
        server.close()
    assert 0 < got < len(big), got  # its answer ends short: closed, not waited for


def test_a_connection_past_the_cap_closes_the_oldest_and_a_late_scraper_is_still_answered(
    metrics: Metrics,
) -> None:
    port = _serve(metrics, timeout_s=60, cap=4)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    try:
        took, status, body = _scrape(port)
        assert status == 200 and took < 1.0
        for s in idle[:3]:  # the three oldest made room for the three after the cap
            s.settimeout(5)
            assert s.recv(1) == b""
        assert metrics._server is not None and metrics._server.open_connections() <= 4
    finally:
        for s in idle:
            s.close()
    assert _dropped(body, "evicted") == 3


def test_a_request_over_8_kib_is_refused_with_431_and_closed(metrics: Metrics) -> None:
    port = _serve(metrics)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * MAX_REQUEST_BYTES)
        answer = s.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]


def test_scrapers_get_prometheus_clients_own_answers_gzip_openmetrics_and_405(
    metrics: Metrics,
) -> None:
    port = _serve(metrics)

    def ask(raw: bytes) -> tuple[bytes, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(raw)
            head, _, body = s.makefile("rb").read().partition(b"\r\n\r\n")
        return head, body

    head, body = ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
    assert b"Content-Encoding: gzip" in head and b"Connection: close" in head
    assert b"kimi_supervisor_build_info" in gzip.decompress(body)
    head, body = ask(
        b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n"
    )
    assert b"application/openmetrics-text" in head and body.endswith(b"# EOF\n")
    head, _ = ask(b"GET /metrics?name[]=kimi_supervisor_build_info HTTP/1.0\n\n")  # printf | nc
    assert head.startswith(b"HTTP/1.1 200 OK")
    head, _ = ask(b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405 ")
    head, _ = ask(b"nonsense\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")


def test_closing_stops_listening_closes_every_connection_and_ends_the_thread(
    metrics: Metrics,
) -> None:
    port = _serve(metrics, timeout_s=60)
    held = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        assert _scrape(port)[1] == 200
        metrics.close()
        assert held.recv(1) == b""
    finally:
        held.close()
    assert _metrics_threads() == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    # The port is free again at once (a re-exec listens on it anew).
    again = Metrics()
    try:
        assert again.serve("127.0.0.1", port) == port
    finally:
        again.close()


SERVER = """
import os, resource, sys, time
from kimi_supervisor.ports.metrics import Metrics
m = Metrics()
print(m.serve("127.0.0.1", 0, 30.0, max_connections=8), flush=True)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("exhausted", flush=True)
sys.stdin.readline()  # a scraper waits in the queue
cpu = time.process_time()
sys.stdin.readline()
print(time.process_time() - cpu, flush=True)
for fd in held:
    os.close(fd)
sys.stdin.readline()
"""


def test_out_of_descriptors_the_metrics_server_waits_instead_of_spinning_and_then_answers() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        port = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "exhausted"
        answers: list[tuple[float, int, str]] = []
        scraper = threading.Thread(target=lambda: answers.append(_scrape(port)), daemon=True)
        scraper.start()
        proc.stdin.write("\n")
        proc.stdin.flush()
        time.sleep(1.0)  # a second of the server out of descriptors, a scraper waiting
        proc.stdin.write("\n")  # measure, then free the descriptors
        proc.stdin.flush()
        cpu_s = float(proc.stdout.readline())
        scraper.join(10)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert cpu_s < 0.3, f"{cpu_s:.2f} s of CPU in one second: it spun"
    (answer,) = answers
    assert answer[1] == 200, answer[:2]


def test_a_collector_that_fails_answers_that_scrape_500_and_the_next_one_is_served() -> None:
    calls: list[str] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        calls.append(environ["PATH_INFO"])
        if len(calls) == 1:
            raise RuntimeError("a collector's bug")
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"fine\n"]

    server = MetricsServer(app, "127.0.0.1", 0, timeout_s=TIMEOUT_S, max_connections=CAP)
    try:
        first = request(f"http://127.0.0.1:{server.port}/metrics", timeout_s=5)
        second = request(f"http://127.0.0.1:{server.port}/metrics", timeout_s=5)
    finally:
        server.close()
    assert first.status == 500 and "a collector's bug" in first.body, first
    assert (second.status, second.body) == (200, "fine\n")


def test_a_flood_of_whole_requests_renders_the_registry_once_per_interval_not_once_each() -> None:
    """Another user sending complete requests without a pause had the one thread render the
    registry for each (an outside review: root's scrapes then took up to 1.6 s). The same
    request within RENDER_REUSE_S gets the answer already made; another request is its own."""
    from kimi_supervisor.ports.metrics import RENDER_REUSE_S

    renders: list[str] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        renders.append(environ["PATH_INFO"])
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [f"rendered {len(renders)}\n".encode()]

    server = MetricsServer(app, "127.0.0.1", 0, timeout_s=TIMEOUT_S, max_connections=CAP)
    try:
        t0 = time.monotonic()
        bodies = {_scrape(server.port)[2] for _ in range(200)}
        took = time.monotonic() - t0
        assert len(renders) <= 1 + took / RENDER_REUSE_S, (len(renders), took)
        assert len(bodies) == len(renders)  # each answer whole, from one render
        assert _scrape(server.port, "/other")[1] == 200 and renders[-1] == "/other"
    finally:
        server.close()


def test_every_counter_is_present_at_0_from_the_start_with_short_label_values() -> None:
    """Before, two counters had no series until their first event (their panels were empty,
    and increase() cannot see the event that creates a series), and kills_total's evidence
    label was a whole sentence."""
    import re

    from prometheus_client import generate_latest

    from kimi_supervisor.model import Evidence
    from kimi_supervisor.ports.metrics import evidence_label

    m = Metrics()
    m.set_gpu(3, "GPU-3", 600, baseline_mib=500)  # a managed GPU's first reading
    text = generate_latest(m.registry).decode()
    counters = re.findall(r"^# TYPE (kimi_supervisor_\S+) counter$", text, re.M)
    assert len(counters) >= 8, counters
    for name in counters:
        samples = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        assert samples and set(samples) == {"0.0"}, (name, samples)
    assert 'kimi_supervisor_gpu_intrusions_total{gpu="3"} 0.0' in text
    assert 'kimi_supervisor_persist_failures_total{file="state.json"} 0.0' in text
    assert 'kimi_supervisor_captures_total{outcome="failed"} 0.0' in text
    values = set(re.findall(r'[{,]\w+="([^"]*)"', text)) - {"GPU-3"}
    assert all(re.fullmatch(r"[\w.:-]+", v) for v in values), values  # no sentence
    assert {evidence_label(e) for e in Evidence} <= values
    assert 'kimi_supervisor_liveness{verdict="not_judged"} 1.0' in text


HEALTHY = {"index": 3, "remap_pending": False, "remap_failed": False, "retired_pending": None,
           "ecc_uncorrected": 0, "nvlink_errors": None, "xids": [], "unread": []}  # fmt: skip


@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        pytest.param(None, dict.fromkeys(GPU_HEALTH_SIGNALS, "0.0"),
                     id="before the first reading every signal is there at 0, as DCGM's are"),
        pytest.param(HEALTHY, {"xid_errors": "0.0", "row_remap_pending": "0.0",
                               "row_remap_failure": "0.0", "retired_pending": "NaN",
                               "ecc_dbe_vol_total": "0.0", "nvlink_errors": "NaN"},
                     id="a healthy GPU reads 0 and the signals it cannot give NaN"),
        pytest.param({**HEALTHY, "remap_pending": True, "xids": [79]},
                     {"xid_errors": "1.0", "row_remap_pending": "1.0"},
                     id="xid 79 and a pending row remap read 1"),
        pytest.param({**HEALTHY, "xids": [13, 31]}, {"xid_errors": "0.0"},
                     id="an application's Xid is no sign of a failing GPU"),
        pytest.param({**HEALTHY, "xids": None}, {"xid_errors": "NaN"},
                     id="an Xid log that cannot be read is NaN"),
        pytest.param({**HEALTHY, "ecc_uncorrected": 2, "nvlink_errors": 5},
                     {"ecc_dbe_vol_total": "1.0", "nvlink_errors": "1.0"},
                     id="uncorrected ECC and NVLink errors read 1"),
    ],
)  # fmt: skip
def test_each_gpu_health_signal_reads_1_0_or_nan_named_after_dcgms_field(
    signals: dict[str, object] | None, expected: dict[str, str]
) -> None:
    import re

    from prometheus_client import generate_latest

    from kimi_supervisor.decide.gpuhealth import dcgm_flags

    m = Metrics()
    m.set_gpu(3, "GPU-3", 600, baseline_mib=500)
    if signals is not None:
        m.set_gpu_health(3, "GPU-3", dcgm_flags(signals))
    text = generate_latest(m.registry).decode()
    got = dict(re.findall(r'^kimi_supervisor_gpu_health\{gpu="3",signal="(\w+)",uuid="GPU-3"\} '
                          r"(\S+)$", text, re.M))  # fmt: skip
    assert set(got) == set(GPU_HEALTH_SIGNALS), got
    assert {k: got[k] for k in expected} == expected
