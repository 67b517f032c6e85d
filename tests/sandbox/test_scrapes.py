"""The daemon's /metrics as systemd runs it, scraped by a real Prometheus while another user
keeps connections to it idle and trickling (issue 42: one idle connection blinded every scrape).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path

import pytest

from kimi_supervisor.ports.http import request

from ..conftest import DaemonHelper, SandboxHelper, as_user, wait_until
from ..floods import METRICS_HOLD

pytestmark = pytest.mark.systemd

NOBODY = ("--reuid=65534", "--regid=65534", "--clear-groups")
PROMETHEUS = shutil.which("prometheus")
HOLD_S = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(web: int, promql: str, at: float) -> float | None:
    q = urllib.parse.urlencode({"query": promql, "time": f"{at:.3f}"})
    r = request(f"http://127.0.0.1:{web}/api/v1/query?{q}", timeout_s=5, max_bytes=1 << 16)
    assert r.ok, (promql, r)
    result = json.loads(r.body)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus (the set-up takes it from Debian's)")
@pytest.mark.skipif(os.geteuid() != 0, reason="holds the connections as another user (setpriv)")
def test_a_real_prometheus_scrapes_every_second_while_another_user_keeps_110_connections_idle_and_trickling(  # noqa: E501
    sandbox: SandboxHelper, daemon: DaemonHelper, tmp_path: Path
) -> None:
    assert PROMETHEUS is not None
    daemon.start()
    daemon.wait_serving("production")
    vllm, pid = daemon.vllm_pid(), daemon.pid()
    m = sandbox.config.metrics
    web = _free_port()
    conf = tmp_path / "prometheus.yml"
    conf.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: kimi\n    static_configs: [{{targets: ['{m.address}:{m.port}']}}]\n"
    )
    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{web}"],
            stdout=log, stderr=log,
        )  # fmt: skip
    hold: subprocess.Popen[str] | None = None
    try:
        ready = f"http://127.0.0.1:{web}/-/ready"
        wait_until(lambda: request(ready, timeout_s=1).ok, 60, "Prometheus to be ready")
        wait_until(lambda: _query(web, 'up{job="kimi"}', time.time()) == 1, 30, "a first scrape")
        threads_before = _threads(pid)
        hold = subprocess.Popen(
            [*as_user(*NOBODY), "-c", METRICS_HOLD, m.address, str(m.port), "100", "10",
             str(HOLD_S), "reopen"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert hold.stdout is not None
        assert hold.stdout.readline() == "held 65534\n"
        began = time.time()
        threads_during = max(_threads(pid) for _ in range(5))
        held = json.loads(hold.stdout.read())  # at HOLD_S
        hold.wait(10)
        ended = time.time()
        window = f"[{int(ended - began)}s]"
        scrapes = _query(web, f'count_over_time(up{{job="kimi"}}{window})', ended)
        up = _query(web, f'min_over_time(up{{job="kimi"}}{window})', ended)
        slowest = _query(
            web, f'max_over_time(scrape_duration_seconds{{job="kimi"}}{window})', ended
        )
    finally:
        for p in (hold, prom):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    # Every second's scrape answered, each within a second, all along.
    assert scrapes is not None and scrapes >= HOLD_S - 2, (scrapes, window)
    assert up == 1 and slowest is not None and slowest < 1.0, (up, slowest)
    # The attacker's connections were closed at metrics.timeout_s (2 s here), and opened again.
    closed = held["closed_after_s"]
    assert held["opened"] >= 200 and max(closed) < m.timeout_s + 1.0, held["opened"]
    assert threads_during <= threads_before + 2, (threads_before, threads_during)
    # Nothing else moved: the same daemon serves the same vLLM.
    assert daemon.pid() == pid and daemon.vllm_pid() == vllm
    assert daemon.status()["state"] == "serving"
