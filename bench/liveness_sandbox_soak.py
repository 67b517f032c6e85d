"""The liveness soak in the sandbox: the whole daemon (its loop, probe, judge and restarts) watching
the fake vLLM saturated for `--minutes` (default 10) with vLLM's stats off, twice side by side:
one sandbox with the shipped liveness values (metrics every 15 s, stall 120 s, canary every 300 s
with 60 s to answer), one with the sandbox's scaled ones (1, 5, 5, 5 s). The real-vLLM soak
(bench/liveness_soak.py) runs the product's probe and judge on real vLLM 0.16; this one runs the
daemon itself, restarts included, on the fake that copies what real vLLM showed
(bench/liveness_real.py): no `vllm:*` series with stats off, a prefill as one engine step.

Each sandbox: 8 clients without a pause, a ninth sending 4096- and 8192-word prompts in turn (a
12 s and a 24 s prefill at 3 ms a word: past the scaled stall and the canary's timeout). Every
verdict is a false one, a 30-minute reload on the seed's host.

    .venv/bin/python -m bench.liveness_sandbox_soak --write docs/performance.md   # about 12 min
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import machine, write_section
from bench.liveness_bench import incidents, serving, status
from kimi_supervisor.config import LivenessConfig
from kimi_supervisor.sandbox.fake_options import FakeOptions
from kimi_supervisor.sandbox.sandbox import Sandbox

RESULTS = Path(__file__).parent / "results"
SHIPPED = LivenessConfig()
VALUES: dict[str, dict[str, Any]] = {
    "shipped": {
        "liveness": {
            "metrics_interval_s": SHIPPED.metrics_interval_s,
            "stall_s": SHIPPED.stall_s,
            "canary_interval_s": SHIPPED.canary_interval_s,
            "canary_timeout_s": SHIPPED.canary_timeout_s,
            "max_hang_restarts": SHIPPED.max_hang_restarts,
        }
    },
    "scaled": {},  # config/sandbox.toml's
}
PREFILL_S_PER_WORD = 0.003


class Clients:
    """8 clients as fast as they are answered and one sending long prompts in turn."""

    def __init__(self, sb: Sandbox) -> None:
        v = sb.config().vllm
        self.url = f"http://{v.host}:{v.port}/v1/completions"
        self.model = v.command[2]
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.answered = self.failed = 0
        self.longest_s = 0.0
        self.threads = [threading.Thread(target=self.send, args=(None,), daemon=True)
                        for _ in range(8)]  # fmt: skip
        self.threads.append(threading.Thread(target=self.send, args=((4096, 8192),), daemon=True))
        for t in self.threads:
            t.start()

    def send(self, long: tuple[int, ...] | None) -> None:
        turn = 0
        while not self.done.is_set():
            words = long[turn % len(long)] if long else 1
            turn += 1
            body = json.dumps({"model": self.model, "prompt": " ".join(["a"] * words),
                               "max_tokens": 4 if long else 50}).encode()  # fmt: skip
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
                ok = True
            except OSError:
                ok = False
            took = time.monotonic() - t0
            with self.lock:
                if ok:
                    self.answered += 1
                    self.longest_s = max(self.longest_s, took)
                else:
                    self.failed += 1
            if not ok:
                self.done.wait(0.2)

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(130)


class Watch:
    """What one sandbox's daemon said through the soak: its verdicts, its readings' state, the
    canaries it sent and their answers, and the longest doubt it held."""

    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb
        self.before = len(incidents(sb))
        self.pid = status(sb)["unit"]["main_pid"]
        self.metrics: set[str] = set()
        self.canaries: dict[str, bool] = {}
        self.longest_doubt_s = 0.0

    def look(self) -> None:
        live = status(self.sb).get("liveness") or {}
        if live.get("metrics"):
            self.metrics.add(str(live["metrics"]))
        if live.get("canary_at"):
            self.canaries[live["canary_at"]] = bool(live.get("canary_ok"))
        if live.get("doubt_since"):
            since = datetime.fromisoformat(live["doubt_since"])
            held = (datetime.now(since.tzinfo) - since).total_seconds()
            self.longest_doubt_s = max(self.longest_doubt_s, held)

    def row(self) -> dict[str, Any]:
        st = status(self.sb)
        return {
            "verdicts": len(incidents(self.sb)) - self.before,
            "restarted": st["unit"]["main_pid"] != self.pid,
            "metrics": sorted(self.metrics),
            "canaries": len(self.canaries),
            "canaries_answered": sum(self.canaries.values()),
            "longest_doubt_s": round(self.longest_doubt_s, 1),
        }


def soak(minutes: float) -> dict[str, Any]:
    roots: dict[str, Path] = {}
    boxes: dict[str, Sandbox] = {}
    result: dict[str, Any] = {"minutes": minutes, "values": {}}
    try:
        for name, overrides in VALUES.items():
            roots[name] = Path(tempfile.mkdtemp(prefix=f"kimi-soak-{name}-"))
            sb = Sandbox.up(roots[name], gpus=2, daemon=False, overrides=overrides or None)
            boxes[name] = sb
            sb.set_fake_options(FakeOptions(disable_log_stats=True, engine_busy_fraction=0.6,
                                            prefill_s_per_token=PREFILL_S_PER_WORD))  # fmt: skip
            sb.start_daemon()
            serving(sb, 120)
        watches = {name: Watch(sb) for name, sb in boxes.items()}
        clients = {name: Clients(sb) for name, sb in boxes.items()}
        t_end = time.monotonic() + minutes * 60
        try:
            while time.monotonic() < t_end:
                for w in watches.values():
                    w.look()
                time.sleep(1)
        finally:
            for c in clients.values():
                c.stop()
        time.sleep(3)
        for name, w in watches.items():
            c = clients[name]
            cfg = boxes[name].config().liveness
            result["values"][name] = {
                **w.row(),
                "answered": c.answered, "failed": c.failed, "longest_s": round(c.longest_s, 2),
                "liveness": {"metrics_interval_s": cfg.metrics_interval_s, "stall_s": cfg.stall_s,
                             "canary_interval_s": cfg.canary_interval_s,
                             "canary_timeout_s": cfg.canary_timeout_s},
            }  # fmt: skip
    finally:
        for sb in boxes.values():
            sb.down()
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)
    return result


def table(result: dict[str, Any], when: str) -> str:
    lines = [
        f"{machine()} (bench/liveness_sandbox_soak.py): the whole daemon in two "
        f"sandboxes at once, the fake vLLM saturated for {result['minutes']:g} min with its stats "
        "off, 4096- and 8192-word prompts (12 s and 24 s prefills) mixed in. Every verdict here "
        "is a false one.\n",
        "| values | metrics / stall / canary every / canary timeout | load | readings (metrics) "
        "| canaries answered | verdicts | vLLM restarted | longest doubt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in result["values"].items():
        lv = v["liveness"]
        lines.append(
            f"| {name} | {lv['metrics_interval_s']:g} / {lv['stall_s']:g} / "
            f"{lv['canary_interval_s']:g} / {lv['canary_timeout_s']:g} s | "
            f"{v['answered']} answered, {v['failed']} failed, longest {v['longest_s']:g} s | "
            f"{', '.join(v['metrics']) or '-'} | {v['canaries_answered']} of {v['canaries']} | "
            f"{v['verdicts']} | {'yes' if v['restarted'] else 'no'} | {v['longest_doubt_s']:g} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--write", type=Path, default=None)
    args = p.parse_args()
    result = soak(args.minutes)
    when = time.strftime("%Y-%m-%d")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"liveness-sandbox-soak-{when}.json").write_text(json.dumps(result, indent=1))
    body = table(result, when)
    print(body)
    if args.write:
        write_section(args.write, "liveness-sandbox-soak", body)


if __name__ == "__main__":
    main()
