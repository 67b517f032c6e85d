"""The daemon's HTTP client (ports/http.py) against real servers on loopback: `timeout_s` bounds
the whole exchange, so a vLLM that trickles its answer holds the loop's /health no longer than
it; without a timeout, a slow answer (a profiler flush) is waited for whole."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from kimi_supervisor.loop.liveness import canary
from kimi_supervisor.ports.http import HttpResult, request

# Each byte comes sooner than the timeout: a per-read timeout (urllib's) never fires.
TRICKLE_S = 0.2
TIMEOUT_S = 1.0
# A loaded 2-core host's scheduler (load 20: a process gets a tenth of a core). What is timed
# out here would otherwise last 200 s (the trickle) or for ever: returning within the deadline
# and this slack is the deadline holding, on any host.
SLACK_S = 30.0


Answer = Callable[[socket.socket, threading.Event], object]


@dataclass
class Server:
    """One listening socket; each connection gets `answer(conn, stop)` on a thread of its own."""

    port: int
    stop: threading.Event
    threads: list[threading.Thread] = field(default_factory=list)


Serve = Callable[[Answer], Server]


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _trickle(conn: socket.socket, data: bytes, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.wait(TRICKLE_S):
            return
        conn.sendall(data[i : i + 1])


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Servers started by the test, stopped (listener closed, their threads joined) after it."""
    servers: list[tuple[socket.socket, Server]] = []

    def start(answer: Answer) -> Server:
        listener = socket.create_server(("127.0.0.1", 0))
        srv = Server(listener.getsockname()[1], threading.Event())

        def one(conn: socket.socket) -> None:
            with conn, contextlib.suppress(OSError):
                answer(conn, srv.stop)

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return  # closed: the test is over
                t = threading.Thread(target=one, args=(conn,), daemon=True)
                srv.threads.append(t)
                t.start()

        threading.Thread(target=accept, daemon=True).start()
        servers.append((listener, srv))
        return srv

    yield start
    for listener, srv in servers:
        srv.stop.set()
        listener.close()
        for t in srv.threads:
            t.join(5)


def _timed(
    url: str, timeout_s: float | None = TIMEOUT_S, method: str = "GET", max_bytes: int = 4096
) -> tuple[float, HttpResult]:
    t0 = time.monotonic()
    r = request(
        url,
        method,
        timeout_s,
        json_body={"x": 1} if method == "POST" else None,
        max_bytes=max_bytes,
    )
    return time.monotonic() - t0, r


def test_a_server_that_trickles_its_status_line_a_byte_at_a_time_is_given_up_at_the_deadline(
    serve: Serve,
) -> None:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        _read_request(conn)
        _trickle(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" * 10, stop)

    srv = serve(answer)
    took, r = _timed(f"http://127.0.0.1:{srv.port}/health")
    assert r.status == 0 and "timed out" in r.error, r
    assert TIMEOUT_S - 0.05 <= took < TIMEOUT_S + SLACK_S, took


def test_a_server_that_trickles_its_body_is_given_up_at_the_deadline(serve: Serve) -> None:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        _read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        _trickle(conn, b"x" * 1000, stop)

    srv = serve(answer)
    took, r = _timed(f"http://127.0.0.1:{srv.port}/metrics", max_bytes=1000)
    assert r.status == 0 and "timed out" in r.error, r
    assert took < TIMEOUT_S + SLACK_S, took


def test_a_server_that_accepts_and_never_answers_is_given_up_at_the_deadline(
    serve: Serve,
) -> None:
    srv = serve(lambda conn, stop: stop.wait())
    took, r = _timed(f"http://127.0.0.1:{srv.port}/v1/completions", method="POST")
    assert r.status == 0 and "timed out" in r.error, r
    assert took < TIMEOUT_S + SLACK_S, took


def test_an_idle_canary_that_times_out_against_a_trickling_vllm_still_reads_as_unanswered(
    serve: Serve,
) -> None:
    """liveness tells "unanswered" (a hang's signal) from an error by "timed out"."""

    def answer(conn: socket.socket, stop: threading.Event) -> None:
        _read_request(conn)
        _trickle(conn, b"HTTP/1.1 200 OK\r\n" * 100, stop)

    srv = serve(answer)
    t0 = time.monotonic()
    c = canary(f"http://127.0.0.1:{srv.port}", "hi", TIMEOUT_S)
    assert not c.answered and time.monotonic() - t0 < TIMEOUT_S + SLACK_S, c


def test_without_a_timeout_a_slow_answer_like_a_profiler_flush_is_waited_for_whole(
    serve: Serve,
) -> None:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        _read_request(conn)
        if stop.wait(TIMEOUT_S + 0.2):  # silent past what a timeout would allow
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nflush")

    srv = serve(answer)
    took, r = _timed(f"http://127.0.0.1:{srv.port}/stop_profile", None, "POST")
    assert (r.status, r.body) == (200, "flush"), r
    assert took >= TIMEOUT_S + 0.2


def test_an_answer_in_time_is_read_up_to_max_bytes_and_errors_keep_status_and_body(
    serve: Serve,
) -> None:
    def answer(conn: socket.socket, stop: threading.Event) -> None:
        path = _read_request(conn).split(b" ")[1]
        if path == b"/big":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10000\r\n\r\n" + b"y" * 10000)
        else:
            body = b'{"error": "no profiler"}'
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    srv = serve(answer)
    r = request(f"http://127.0.0.1:{srv.port}/big", timeout_s=5, max_bytes=100)
    assert (r.status, r.body, r.error) == (200, "y" * 100, "")
    r = request(f"http://127.0.0.1:{srv.port}/start_profile", "POST", 5)
    assert (r.status, r.body, r.error) == (404, '{"error": "no profiler"}', "HTTP 404")


def test_nothing_listening_is_no_answer_at_once_and_never_an_exception() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        took, r = _timed(f"http://127.0.0.1:{port}/health")
    assert r.status == 0 and "refused" in r.error, r
    assert took < SLACK_S
    assert request("ftp://127.0.0.1/x").status == 0
    assert request("http://127.0.0.1:99999/x").status == 0
