"""The shipped STUCK alert, as promtool evaluates it over a series of the daemon's own state
(one sample per 15 s scrape): for the sandbox test and bench/liveness_bench.py. And a real
Prometheus scraping a sandbox's daemon, with the shipped rules, to query as the dashboard does."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kimi_supervisor.ports.http import request

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "config/prometheus/kimi-supervisor-alerts.yml"
SCRAPE_S = 15
TEST = """rule_files: ["{rules}"]
evaluation_interval: {scrape}s
tests:
  - interval: {scrape}s
    input_series:
      - series: 'kimi_supervisor_state{{instance="h:9464",job="kimi",state="stuck"}}'
        values: '{values}'
    alert_rule_test:
      - {{eval_time: {at}s, alertname: KimiSupervisorStuckOrFailed, exp_alerts: []}}
"""


def stuck_alert_fires_at(stuck: list[int]) -> float | None:
    """The first evaluation (seconds after the first sample) at which the STUCK alert fires
    for `stuck` (`kimi_supervisor_state{state="stuck"}`, one value per scrape); None: never."""
    values = " ".join(str(v) for v in stuck)
    with tempfile.TemporaryDirectory() as d:
        test = Path(d, "stuck_test.yml")
        for at in range(0, SCRAPE_S * len(stuck), SCRAPE_S):
            test.write_text(TEST.format(rules=RULES, scrape=SCRAPE_S, values=values, at=at))
            r = subprocess.run(["promtool", "test", "rules", str(test)], capture_output=True)
            if r.returncode != 0:  # "no alert" is wrong at `at`: it fires
                return float(at)
    return None


# ------------------------------------------------------------------------------ a real Prometheus
PROMETHEUS = shutil.which("prometheus")
ALERT_RULES = ("kimi-supervisor-alerts.yml", "kimi-supervisor-fleet.yml")
JOB = "kimi-supervisor"  # as config/prometheus/prometheus-fleet.yml names it; the rules read it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def prometheus(tmp_path: Path, target: str, rules: bool = False) -> Iterator[int]:
    """A real Prometheus scraping `target` (host:port) every second as the shipped job, with the
    shipped alert and fleet rules evaluated every second when `rules`; yields its web port once
    it has scraped once, and stops it at the end."""
    from tests.conftest import wait_until

    assert PROMETHEUS is not None
    web = free_port()
    conf = tmp_path / "prometheus.yml"
    rule_files = [str(RULES.parent / r) for r in ALERT_RULES] if rules else []
    conf.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        f"rule_files: {json.dumps(rule_files)}\n"
        "scrape_configs:\n"
        f"  - job_name: {JOB}\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{web}"],
            stdout=log, stderr=log,
        )  # fmt: skip
    try:
        ready = f"http://127.0.0.1:{web}/-/ready"
        wait_until(lambda: request(ready, timeout_s=1).ok, 60, "Prometheus to be ready")
        wait_until(lambda: query(web, f'up{{job="{JOB}"}}') == [1.0], 30, "a first scrape")
        yield web
    finally:
        prom.terminate()
        try:
            prom.wait(10)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()


def query(web: int, promql: str, at: float | None = None) -> list[float]:
    """The values of an instant query (at `at`, Unix time; now by default), one per series."""
    q = urllib.parse.urlencode({"query": promql, "time": f"{at or time.time():.3f}"})
    r = request(f"http://127.0.0.1:{web}/api/v1/query?{q}", timeout_s=5, max_bytes=1 << 20)
    assert r.ok, (promql, r)
    return [float(x["value"][1]) for x in json.loads(r.body)["data"]["result"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every query in the shipped dashboard, for every host."""
    d = json.loads((RULES.parents[1] / "grafana/kimi-supervisor.json").read_text())
    return [
        (p["title"], t["expr"].replace("$instance", ".*"))
        for p in d["panels"]
        for t in p.get("targets", [])
    ]
