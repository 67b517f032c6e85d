"""The daemon's /metrics as systemd runs it, scraped by a real Prometheus while another user
keeps connections to it idle and trickling (one idle connection blinded every scrape).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from ..conftest import DaemonHelper, SandboxHelper, as_user
from ..floods import METRICS_HOLD
from ..promtool import PROMETHEUS, prometheus, query

pytestmark = pytest.mark.systemd

NOBODY = ("--reuid=65534", "--regid=65534", "--clear-groups")
HOLD_S = 10


def _query(web: int, promql: str, at: float) -> float | None:
    values = query(web, promql, at)
    return values[0] if values else None


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
    hold: subprocess.Popen[str] | None = None
    try:
        with prometheus(tmp_path, f"{m.address}:{m.port}") as web:
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
            scrapes = _query(web, f'count_over_time(up{{job="kimi-supervisor"}}{window})', ended)
            up = _query(web, f'min_over_time(up{{job="kimi-supervisor"}}{window})', ended)
            slowest = _query(
                web,
                f'max_over_time(scrape_duration_seconds{{job="kimi-supervisor"}}{window})',
                ended,
            )
    finally:
        if hold is not None and hold.poll() is None:
            hold.terminate()
            hold.wait(10)
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


ROOT = Path(__file__).resolve().parents[2]


def test_every_family_a_live_scrape_serves_is_in_an_alert_rule_or_a_dashboard_panel(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """A family that feeds no alert and no panel tells nobody anything (a bundle that could not
    be written alerted nobody): each is queried somewhere, or it is not exported."""
    daemon.start()
    daemon.wait_serving("production")
    m = sandbox.config.metrics
    with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    shipped = "\n".join(
        (ROOT / f).read_text()
        for f in ("config/grafana/kimi-supervisor.json",
                  "config/prometheus/kimi-supervisor-alerts.yml",
                  "config/prometheus/kimi-supervisor-fleet.yml")
    )  # fmt: skip
    named = re.findall(r"(?<![\w:])(?:kimi_supervisor|process)_\w+", shipped)
    queried = {re.sub(r"(_total|_bucket|_count|_sum)$", "", n) for n in named}
    unread = sorted(f for f in families if re.sub(r"_total$", "", f) not in queried)
    assert len(families) >= 30 and not unread, unread
    # The daemon's own resources and each GPU's health, from the start.
    assert {"process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds"} <= {
        re.sub(r"_total$", "", f) for f in families
    }
    health = [x for x in text.splitlines() if x.startswith("kimi_supervisor_gpu_health{")]
    assert len(health) == 6 * len(daemon.status()["gpus"]), health
