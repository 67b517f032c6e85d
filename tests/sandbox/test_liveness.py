"""A hung vLLM, as an operator would meet it: the engine frozen (SIGSTOP, as one stuck in a
collective or in the driver is), its API server still answering /health with 200. The daemon
must notice it by the work not done, record it, and serve again (issue 27)."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator

import pytest

from kimi_supervisor.ports import processes

from ..conftest import DaemonHelper, SandboxHelper, health, wait_until

pytestmark = pytest.mark.systemd


def engine_of(main_pid: int) -> int:
    (engine,) = [
        p for p in processes.all_pids()
        if processes.ppid_of(p) == main_pid and processes.comm_of(p).startswith("VLLM::Engine")
    ]  # fmt: skip
    return engine


def complete(url: str, model: str, timeout_s: float) -> None:
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 50}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


@pytest.fixture
def load(sandbox: SandboxHelper) -> Iterator[threading.Event]:
    """Requests, one after another, until the test ends (each may hang on a frozen engine)."""
    v = sandbox.config.vllm
    url, model = f"http://{v.host}:{v.port}", v.command[2]
    done = threading.Event()

    def send() -> None:
        while not done.is_set():
            try:
                complete(url, model, 30)
            except OSError:
                done.wait(0.2)

    threads = [threading.Thread(target=send, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        yield done
    finally:
        done.set()
        for t in threads:
            t.join(35)


def freeze_and_wait(sandbox: SandboxHelper, daemon: DaemonHelper, sign: str) -> dict[str, object]:
    main = daemon.vllm_pid()
    engine = engine_of(main)
    os.kill(engine, signal.SIGSTOP)  # a process of the sandbox's own vLLM, started for this test
    try:
        assert health(sandbox.config.vllm.health_url) == 200  # as real vLLM 0.16 answers
        wait_until(lambda: any(sign in e.get("what", "") for e in daemon.history()), 30, "the hang")
    finally:
        if processes.ref_of(engine) is not None:
            os.kill(engine, signal.SIGCONT)
    (incident,) = [e for e in daemon.history() if sign in e.get("what", "")]
    status = daemon.wait_serving("production", 60)
    assert status["unit"]["main_pid"] != main and processes.ref_of(engine) is None
    assert incident["main_pid"] == main
    return incident


def test_an_idle_vllm_whose_engine_froze_is_found_by_its_canary_and_served_again(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    freeze_and_wait(sandbox, daemon, "idle, and a one-token request got no answer within 5 s")
    assert any(t["trigger"] == "boot" for t in daemon.transitions())


def test_a_loaded_vllm_whose_engine_froze_is_found_by_its_metrics_and_served_again(
    sandbox: SandboxHelper, daemon: DaemonHelper, load: threading.Event
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    incident = freeze_and_wait(sandbox, daemon, "request(s) running and no token produced for")
    assert float(incident["running"]) >= 1  # type: ignore[arg-type]
