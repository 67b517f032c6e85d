"""The shipped STUCK alert, as promtool evaluates it over a series of the daemon's own state
(one sample per 15 s scrape): for the sandbox test and bench/liveness_bench.py."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

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
