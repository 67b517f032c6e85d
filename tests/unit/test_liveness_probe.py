"""The liveness probe (loop/liveness.py) as it reads a real process tree: an "API server" (this
test's process, the tree's root, as vLLM's MainPID is) with a `VLLM::EngineCore` child, and a
small HTTP server in vLLM's place whose /metrics says idle and whose /v1/completions never
answers in time. The canary is judged on the whole tree's CPU: an API server busy tokenizing a
long prompt holds the canary while its engine idles, and /metrics does not show that work yet
(an outside review got a false hang from it when the canary was judged on the engine alone)."""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.config import Config
from kimi_supervisor.decide.liveness import Hang
from kimi_supervisor.loop.liveness import Liveness, Reading
from kimi_supervisor.ports import processes

from .loophost import config_for

# The tree's root: busy (a tokenization that takes a core) or idle; its child is titled as
# vLLM 0.16 titles its engine core, and sleeps (an idle engine: /metrics says nothing runs).
API_SERVER = """
import subprocess, sys, time
child = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])
print(child.pid, flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    if sys.argv[1] != "busy":
        time.sleep(0.05)
"""

IDLE_METRICS = (
    "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    "vllm:generation_tokens_total 5\nvllm:prompt_tokens_total 9\n"
    "vllm:iteration_tokens_total_count 3\n"
)


class Vllm(http.server.ThreadingHTTPServer):
    daemon_threads = True
    released = threading.Event()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = IDLE_METRICS if self.path == "/metrics" else json.dumps({"data": [{"id": "m"}]})
        self.answer(body.encode())

    def do_POST(self) -> None:
        Vllm.released.wait(10)  # the canary waits behind whatever holds the server

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_a: object) -> None:
        pass


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Config]:
    """The loop's configuration, with this HTTP server listening where it says vLLM is."""
    config = config_for(tmp_path)
    server = Vllm(("127.0.0.1", config.vllm.port), Handler)
    Vllm.released.clear()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield config
    finally:
        Vllm.released.set()
        server.shutdown()
        server.server_close()


def verdict(config: Config, api_server: str) -> tuple[Hang | None, str, Reading]:
    """One canary against the tree whose root is `api_server` ("busy" or "idle"): the verdict,
    the doubt, and the reading."""
    api = subprocess.Popen(
        [sys.executable, "-c", API_SERVER, api_server], stdout=subprocess.PIPE, text=True
    )
    planted = [processes.ref_of(api.pid)]
    try:
        assert api.stdout is not None
        planted.append(processes.ref_of(int(api.stdout.readline())))
        readings: list[Reading] = []
        live = Liveness(config, readings.append)
        live.serving(api.pid, 0.0, capturing=False)  # the first reading: no canary yet
        deadline = time.monotonic() + 10
        while not readings and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.seen(readings.pop(), 0.1) is None
        live.serving(api.pid, config.liveness.canary_interval_s + 1, capturing=False)
        deadline = time.monotonic() + 10
        while not readings and time.monotonic() < deadline:
            time.sleep(0.01)
        reading = readings.pop()
        assert reading.canary is not None and not reading.canary.answered, reading
        hang = live.seen(reading, config.liveness.canary_interval_s + 3)
        return hang, live.judge.doubt, reading
    finally:
        for ref in planted:
            if ref is not None:
                processes.send_signal(ref, signal.SIGKILL)
        api.wait(10)


def test_a_canary_held_by_a_busy_api_server_while_the_engine_idles_is_a_doubt_not_a_hang(
    config: Config,
) -> None:
    hang, doubt, reading = verdict(config, "busy")
    assert hang is None, hang
    assert doubt.startswith("a one-token request got no answer in 1 s"), doubt
    assert "the engine's processes are busy: not hung" in doubt
    # The stall rule's reading is still the engine's alone: the idle child.
    assert reading.cpu is not None and reading.cpu.processes == 1


def test_a_canary_unanswered_while_the_whole_tree_idles_is_a_hang(
    config: Config,
) -> None:
    hang, _doubt, _reading = verdict(config, "idle")
    assert hang is not None
    assert hang.reason.startswith("a one-token request got no answer in 1 s; the engine: 2 proc")
