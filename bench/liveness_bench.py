"""Liveness: how long a frozen engine (VLLM::EngineCore SIGSTOPped, /health
still 200) takes to become an incident, idle (the canary) and under load (vLLM's /metrics), and a
deadlocked one (no step, no CPU), against the bound the configuration promises; how many false
verdicts a busy vLLM gets (a capture's flush blocking the engine under load, a prefill longer than
the stall and the canary's timeout, saturation with vLLM's stats off); and what liveness costs the
daemon in CPU, against the same daemon with it off, over the same idle time.

    .venv/bin/python -m bench.liveness_bench [--runs 3] [--write docs/performance.md]

The sandbox's liveness settings: /metrics every 1 s, a stall of 5 s, a canary every 5 s with a
5 s timeout; the shipped ones are 15, 120, 300 and 60 s, and scale the bounds the same way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import machine, poll
from bench.common import main as bench_main
from kimi_supervisor.config import LivenessConfig
from kimi_supervisor.control.client import exchange
from kimi_supervisor.ports import processes
from kimi_supervisor.sandbox.fake_options import FakeOptions
from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT, Sandbox
from tests.promtool import stuck_alert_fires_at

IDLE_WINDOW_S = 30.0


def status(sb: Sandbox) -> dict[str, Any]:
    (reply,) = [m for _raw, m in exchange(sb.config().control.socket, {"cmd": "status"}, 10)]
    return reply["data"]  # type: ignore[no-any-return]


def incidents(sb: Sandbox) -> list[dict[str, Any]]:
    req = {"cmd": "history", "n": 1000}
    (reply,) = [m for _raw, m in exchange(sb.config().control.socket, req, 10)]
    lost = ("vLLM hung", "vLLM unhealthy")
    return [e for e in reply["data"]["entries"] if e.get("what", "").startswith(lost)]


def serving(sb: Sandbox, timeout_s: float = 60) -> dict[str, Any]:
    poll(lambda: status(sb)["state"] == "serving", timeout_s)
    return status(sb)


def engine_of(main_pid: int) -> processes.ProcessRef:
    for pid in processes.all_pids():
        if processes.ppid_of(pid) == main_pid and processes.comm_of(pid).startswith("VLLM::Eng"):
            ref = processes.ref_of(pid)
            if ref is not None:
                return ref
    raise AssertionError(f"no engine under {main_pid}")


def hang_teardown_s(sb: Sandbox) -> float:
    """The last teardown of a hung vLLM (the one after it, of the backoff's retry, finds
    nothing to do)."""
    req = {"cmd": "history", "n": 200}
    (reply,) = [m for _raw, m in exchange(sb.config().control.socket, req, 10)]
    teardowns = [
        e for e in reply["data"]["entries"]
        if e["kind"] == "teardown" and e.get("reason", "").startswith("vLLM hung")
    ]  # fmt: skip
    return float(teardowns[-1]["duration_s"])


def freeze(sb: Sandbox) -> float:
    """Seconds from SIGSTOP of the serving vLLM's engine to its incident; then served again."""
    before = len(incidents(sb))
    main = status(sb)["unit"]["main_pid"]
    engine = engine_of(main)
    t0 = time.monotonic()
    processes.send_signal(engine, signal.SIGSTOP)
    try:
        poll(lambda: len(incidents(sb)) > before, 60, every_s=0.05)
        took = time.monotonic() - t0
    finally:
        if processes.is_alive(engine):
            processes.send_signal(engine, signal.SIGCONT)
    poll(lambda: status(sb)["state"] == "serving" and status(sb)["unit"]["main_pid"] != main, 90)
    return took


def load(sb: Sandbox, done: threading.Event) -> list[threading.Thread]:
    v = sb.config().vllm
    body = json.dumps({"model": v.command[2], "prompt": "hi", "max_tokens": 50}).encode()

    def send() -> None:
        while not done.is_set():
            req = urllib.request.Request(
                f"http://{v.host}:{v.port}/v1/completions", data=body, method="POST",
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
            except OSError:
                done.wait(0.2)

    threads = [threading.Thread(target=send, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    return threads


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(sb: Sandbox) -> tuple[float, int]:
    """The daemon's CPU seconds over IDLE_WINDOW_S of serving, and the canaries answered."""
    pid = int(sb.manager.systemctl("show", "-p", "MainPID", "--value", DAEMON_UNIT).stdout)
    seen: set[str] = set()
    c0, t_end = cpu_s(pid), time.monotonic() + IDLE_WINDOW_S
    while time.monotonic() < t_end:
        live = status(sb).get("liveness") or {}
        if live.get("canary_at"):
            seen.add(live["canary_at"])
        time.sleep(0.5)
    return cpu_s(pid) - c0, len(seen)


def stuck_to_alert(sb: Sandbox, samples: int = 40) -> tuple[float | None, int]:
    """Memory leaked on a GPU, then a switch: STUCK, retried. The daemon's own
    `kimi_supervisor_state{state="stuck"}`, sampled each second as one 15 s scrape, fed to
    promtool with the shipped alert rules: the first evaluation at which the STUCK alert fires
    (None: never, or no promtool), and the retries the samples spanned."""
    leak = sb.leak(1, 20_000)
    try:
        req = {"cmd": "switch", "mode": "profile", "follow": False}
        list(exchange(sb.config().control.socket, req, 10))
        poll(lambda: status(sb)["state"] == "stuck", 60)
        m = sb.config().metrics
        values = []
        for _ in range(samples):
            with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as r:
                text = r.read().decode()
            hit = re.search(r'^kimi_supervisor_state\{state="stuck"\} (\S+)$', text, re.M)
            values.append(str(int(float(hit.group(1)))) if hit else "0")
            time.sleep(1)
        retries = (status(sb).get("stuck") or {}).get("retries", 0)
    finally:
        leak.unlink()
    poll(lambda: status(sb)["state"] == "serving", 90)
    if shutil.which("promtool") is None:
        return None, retries
    return stuck_alert_fires_at([int(v) for v in values]), retries


def switch(sb: Sandbox, mode: str) -> None:
    list(exchange(sb.config().control.socket, {"cmd": "switch", "mode": mode, "follow": False}, 10))
    poll(lambda: status(sb)["state"] == "serving" and status(sb)["mode"] == mode, 90)


def deadlock(sb: Sandbox, stuck: Path) -> float:
    """Seconds from the engine's deadlock (no step, no CPU) under load to its incident."""
    before = len(incidents(sb))
    main = status(sb)["unit"]["main_pid"]
    done = threading.Event()
    threads = load(sb, done)
    poll(lambda: ((status(sb).get("liveness") or {}).get("running") or 0) > 0, 30)
    t0 = time.monotonic()
    stuck.touch()
    try:
        poll(lambda: len(incidents(sb)) > before, 60, every_s=0.05)
        took = time.monotonic() - t0
        poll(
            lambda: status(sb)["state"] == "serving" and status(sb)["unit"]["main_pid"] != main, 90
        )
    finally:
        stuck.unlink()
        done.set()
        for th in threads:
            th.join(35)
    return took


def busy_verdicts(sb: Sandbox, act: Any) -> int:
    """The hang verdicts (each a false one: the engine works) while `act` runs, and 3 s after."""
    before = len(incidents(sb))
    act()
    time.sleep(3)
    return len(incidents(sb)) - before


def prefill(sb: Sandbox) -> None:
    """One prompt of 4096 words, alone: at 3 ms a word, a 12 s prefill step."""
    v = sb.config().vllm
    body = json.dumps({"model": v.command[2], "prompt": " ".join(["a"] * 4096),
                       "max_tokens": 4}).encode()  # fmt: skip
    url = f"http://{v.host}:{v.port}/v1/completions"
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def flush_under_load(sb: Sandbox) -> None:
    """A 1 s capture whose flush blocks the engine for 12 s, under load."""
    done = threading.Event()
    threads = load(sb, done)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "kimi_supervisor.cli.kimi_mode", "capture", "--seconds", "1",
             "--then", "stay"],
            env={**os.environ, **sb.env}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        done.set()
        for th in threads:
            th.join(35)


def saturated(sb: Sandbox, seconds: float = 30) -> None:
    """8 clients, as fast as they are answered, for `seconds`."""
    done = threading.Event()
    threads = load(sb, done) + load(sb, done)
    time.sleep(seconds)
    done.set()
    for th in threads:
        th.join(35)


def slow_health(sb: Sandbox, busy: Path, graces: int = 4) -> int:
    """Restarts (each a false one: the API server works) while /health gives no answer for
    one probe interval and `graces` grace periods (sandbox/fake_options.py, api_busy_file)."""
    d = sb.config().daemon
    pid, before = status(sb)["unit"]["main_pid"], len(incidents(sb))
    busy.touch()
    try:
        time.sleep(d.health_interval_s + graces * d.health_grace_s)
    finally:
        busy.unlink()
    time.sleep(3)
    return len(incidents(sb)) - before + int(status(sb)["unit"]["main_pid"] != pid)


def api_frozen(sb: Sandbox) -> float:
    """Seconds from SIGSTOP of the API server (MainPID) to its `vLLM unhealthy` incident."""
    before, main = len(incidents(sb)), status(sb)["unit"]["main_pid"]
    ref = processes.ref_of(main)
    assert ref is not None
    t0 = time.monotonic()
    processes.send_signal(ref, signal.SIGSTOP)
    try:
        poll(lambda: len(incidents(sb)) > before, 120, every_s=0.1)
        took = time.monotonic() - t0
    finally:
        if processes.is_alive(ref):
            processes.send_signal(ref, signal.SIGCONT)
    poll(lambda: status(sb)["state"] == "serving" and status(sb)["unit"]["main_pid"] != main, 90)
    return took


def run(runs: int) -> str:
    root = Path(tempfile.mkdtemp(prefix="kimi-liveness-bench-"))
    # Every freeze is a failure in the window: room for all of them, or the third is FAILED.
    sb = Sandbox.up(root, gpus=2, daemon=True, overrides={"daemon": {"max_failures": 100},
                    "liveness": {"max_hang_restarts": 100}})  # fmt: skip
    try:
        serving(sb)
        c, d = sb.config().liveness, sb.config().daemon
        stuck = root / "deadlock"
        # Read by each new vLLM: the deadlock switch (off while the file is absent) and a
        # prefill of 3 ms a prompt word; the first freeze restarts vLLM with them.
        base = {"deadlock_file": str(stuck), "prefill_s_per_token": 0.003,
                "api_busy_file": str(root / "api-busy")}  # fmt: skip
        sb.set_fake_options(FakeOptions(**base))  # type: ignore[arg-type]
        idle = [freeze(sb) for _ in range(runs)]
        frozen_teardown = hang_teardown_s(sb)
        loaded = []
        for _ in range(runs):
            done = threading.Event()
            threads = load(sb, done)
            poll(lambda: ((status(sb).get("liveness") or {}).get("running") or 0) > 0, 30)
            loaded.append(freeze(sb))
            done.set()
            for t in threads:
                t.join(35)
        deadlocked = [deadlock(sb, stuck) for _ in range(runs)]
        false = {"prefill": sum(busy_verdicts(sb, lambda: prefill(sb))
                                for _ in range(runs))}  # fmt: skip
        false["slow_health"] = slow_health(sb, root / "api-busy")
        unhealthy = api_frozen(sb)
        sb.set_fake_options(FakeOptions(**base, profile_flush_s=12.0))  # type: ignore[arg-type]
        switch(sb, "profile")
        false["flush"] = sum(busy_verdicts(sb, lambda: flush_under_load(sb))
                             for _ in range(runs))  # fmt: skip
        sb.set_fake_options(FakeOptions(**base, disable_log_stats=True, engine_busy_fraction=0.6))  # type: ignore[arg-type]
        switch(sb, "production")
        false["stats_off"] = busy_verdicts(sb, lambda: saturated(sb))
        absent = (status(sb).get("liveness") or {}).get("metrics")
        sb.set_fake_options(FakeOptions())
        serving(sb)
        on_cpu, canaries = idle_cpu(sb)
        tokens = (status(sb).get("liveness") or {}).get("canary_tokens") or 0
        fired_at, retries = stuck_to_alert(sb)
        serving(sb)
    finally:
        sb.down()
        shutil.rmtree(root, ignore_errors=True)
    root2 = Path(tempfile.mkdtemp(prefix="kimi-liveness-off-"))
    off = Sandbox.up(root2, gpus=2, daemon=True, overrides={"liveness": {"enabled": False}})
    try:
        serving(off)
        off_cpu, _ = idle_cpu(off)
    finally:
        off.down()
        shutil.rmtree(root2, ignore_errors=True)
    # The canary goes with the next /metrics read once it is due.
    idle_bound = c.canary_interval_s + c.metrics_interval_s + c.canary_timeout_s
    load_bound = c.stall_s + c.metrics_interval_s
    # The probe that first fails, its timeout, the grace, and the pass after it.
    health_bound = d.health_interval_s + d.health_timeout_s + d.health_grace_s + d.tick_s
    probes = IDLE_WINDOW_S / c.metrics_interval_s
    per_probe_ms = max(on_cpu - off_cpu, 0.0) / probes * 1000
    shipped = LivenessConfig()
    per_hour = per_probe_ms / 1000 * 3600 / shipped.metrics_interval_s
    return (
        f"{machine()}; {runs} freezes each, the sandbox's fake vLLM (its engine frozen with "
        f"SIGSTOP; /health stays 200, as real vLLM 0.16's does). The sandbox's liveness: "
        f"/metrics every {c.metrics_interval_s:g} s, stall {c.stall_s:g} s, canary every "
        f"{c.canary_interval_s:g} s, timeout {c.canary_timeout_s:g} s.\n\n"
        "| figure | measured | bound (config) | ratio |\n|---|---|---|---|\n"
        f"| idle: frozen → incident (the canary), median of {runs} | "
        f"{statistics.median(idle):.1f} s (max {max(idle):.1f}) | {idle_bound:g} s | "
        f"{max(idle) / idle_bound:.2f} |\n"
        f"| under load: frozen → incident (/metrics stall), median of {runs} | "
        f"{statistics.median(loaded):.1f} s (max {max(loaded):.1f}) | {load_bound:g} s | "
        f"{max(loaded) / load_bound:.2f} |\n"
        f"| under load: deadlocked (no step, no CPU) → incident, median of {runs} | "
        f"{statistics.median(deadlocked):.1f} s (max {max(deadlocked):.1f}) | {load_bound:g} s | "
        f"{max(deadlocked) / load_bound:.2f} |\n"
        f"| daemon CPU over {IDLE_WINDOW_S:g} s serving idle, liveness on ({canaries} canaries) "
        f"| {on_cpu * 1000:.0f} ms | off: {off_cpu * 1000:.0f} ms | "
        f"{on_cpu / off_cpu if off_cpu else float('nan'):.2f} |\n"
        f"| the teardown of the frozen tree (continued, then stopped; the unit's "
        f"TimeoutStopSec would end it otherwise) | {frozen_teardown:.2f} s | - | - |\n"
        f"| the API server frozen (/health unanswered, MainPID in state T) → incident | "
        f"{unhealthy:.1f} s | {health_bound:g} s | {unhealthy / health_bound:.2f} |\n"
        f"| STUCK → the shipped STUCK alert firing (promtool, fed the daemon's own state series "
        f"through {retries} retries, one sample per 15 s scrape) | "
        f"{'never' if fired_at is None else f'{fired_at / 60:g} min'} | `for:` 5 min + one "
        f"scrape | {'-' if fired_at is None else f'{fired_at / 315:.2f}'} |\n\n"
        f"CPU per probe (a /metrics read, every {c.canary_interval_s / c.metrics_interval_s:g}th "
        f"with a canary): {per_probe_ms:.1f} ms; at the shipped cadence (/metrics every "
        f"{shipped.metrics_interval_s:g} s, a canary every {shipped.canary_interval_s:g} s) at "
        f"most {per_hour:.1f} s of CPU an hour. A canary is {tokens} token(s) as the fake "
        f"counts them; {3600 / shipped.canary_interval_s:g} canaries an hour when idle (real "
        "vLLM's count is in the real-vLLM table).\n\n"
        "False verdicts: each a hang called on a vLLM that works, which would cost a "
        "model load.\n\n"
        "| a busy vLLM | runs | hang or unhealthy verdicts |\n|---|---|---|\n"
        f"| a capture whose flush blocks the engine under load for 12 s ({12 / c.stall_s:g}x the "
        f"stall) | {runs} | {false['flush']} |\n"
        f"| a prefill of 4096 words at 3 ms each (12 s: past the stall and the canary's "
        f"timeout), alone | {runs} | {false['prefill']} |\n"
        f"| saturated (8 clients) for 30 s with vLLM's stats off (status: metrics {absent}) | 1 "
        f"| {false['stats_off']} |\n"
        f"| /health unanswered for {d.health_interval_s + 4 * d.health_grace_s:g} s (4 grace "
        f"periods past the first probe) while the API server works | 1 | "
        f"{false['slow_health']} |\n"
    )


if __name__ == "__main__":
    bench_main("liveness", run, runs=3)
