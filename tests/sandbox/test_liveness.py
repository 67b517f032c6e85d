"""A hung vLLM, as an operator would meet it: the engine frozen (SIGSTOP, as one stuck in a
collective or in the driver is) or deadlocked, its API server still answering /health with 200.
The daemon must notice it by two signals of no progress, record what each saw, and serve
again; and it must never call a busy vLLM hung: a capture's flush, a long prefill, load with
vLLM's stats off. The sandbox's liveness values are scaled (config/sandbox.toml:
metrics every 1 s, stall 5 s, canary every 5 s with 5 s to answer)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.ports import processes

from ..conftest import DaemonHelper, SandboxHelper, health, wait_until
from ..promtool import PROMETHEUS, dashboard_queries, prometheus, query

pytestmark = pytest.mark.systemd


def engine_of(main_pid: int) -> int:
    (engine,) = [
        p for p in processes.all_pids()
        if processes.ppid_of(p) == main_pid and processes.comm_of(p).startswith("VLLM::Engine")
    ]  # fmt: skip
    return engine


def complete(url: str, model: str, timeout_s: float, prompt: str = "hi") -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 50}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


class Answers:
    """When the load's requests were answered (time.monotonic), as a client outside sees it."""

    def __init__(self) -> None:
        self.at: list[float] = []
        self.lock = threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.at.append(time.monotonic())

    def gap(self) -> float:
        """The longest time between two answers."""
        with self.lock:
            at = sorted(self.at)
        return max((b - a for a, b in itertools.pairwise(at)), default=0.0)


@pytest.fixture
def answers() -> Answers:
    return Answers()


def clients(
    sandbox: SandboxHelper, answers: Answers, n: int, timeout_s: float
) -> tuple[threading.Event, list[threading.Thread]]:
    """`n` clients sending requests one after another until the event is set."""
    v = sandbox.config.vllm
    url, model = f"http://{v.host}:{v.port}", v.command[2]
    done = threading.Event()

    def send() -> None:
        while not done.is_set():
            try:
                complete(url, model, timeout_s)
                answers.add()
            except OSError:
                done.wait(0.2)

    threads = [threading.Thread(target=send, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return done, threads


@pytest.fixture
def load(sandbox: SandboxHelper, answers: Answers) -> Iterator[threading.Event]:
    """Requests, one after another, until the test ends (each may hang on a frozen engine)."""
    done, threads = clients(sandbox, answers, 4, 30)
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
    daemon.wait_serving_anew("production", main)
    assert processes.ref_of(engine) is None
    assert incident["main_pid"] == main
    return incident


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus (the set-up takes it from Debian's)")
def test_an_idle_vllm_whose_engine_froze_is_found_by_its_canary_and_served_again(
    sandbox: SandboxHelper, daemon: DaemonHelper, tmp_path: Path
) -> None:
    """And a real Prometheus, scraping the daemon with the shipped rules through the hang, a
    STUCK and a switch, gets data for every query of the shipped dashboard (two
    counters had no series until their first event, so their panels were empty), and fires the
    hang's alert on the daemon's own series."""
    daemon.start()
    daemon.wait_serving("production")
    m = sandbox.config.metrics
    with prometheus(tmp_path, f"{m.address}:{m.port}", rules=True) as web:
        incident = freeze_and_wait(sandbox, daemon, "a one-token request got no answer in 5 s")
        assert "the engine: stopped: PID" in str(incident["what"])
        assert any(t["trigger"] == "boot" for t in daemon.transitions())
        hang = 'ALERTS{alertname="KimiSupervisorVllmHangRestarted",alertstate="firing"}'
        wait_until(lambda: query(web, hang) == [1.0], 20, "the hang's alert to fire")
        leak = sandbox.sb.leak(1, 20_000)  # memory no teardown can free: STUCK
        assert daemon.kimi_mode("profile").returncode == 6
        leak.unlink()
        daemon.wait_serving("profile", 60)
        empty: list[str] = []

        def every_query_answers() -> bool:
            empty[:] = [f"{t}: {q}" for t, q in dashboard_queries() if not query(web, q)]
            return not empty

        try:
            # The fleet's recording rules answer a rule evaluation after their inputs (CI, at
            # load: not within 20 s once).
            wait_until(every_query_answers, 60, "every dashboard query to return data")
        except AssertionError:
            raise AssertionError(f"no data for {empty}") from None
    assert len(dashboard_queries()) >= 25


def test_a_loaded_vllm_whose_engine_froze_is_found_by_its_metrics_and_served_again(
    sandbox: SandboxHelper, daemon: DaemonHelper, load: threading.Event, answers: Answers
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    # Frozen once the load has reached the engine: vLLM's gauges move only when a step ends,
    # so a vLLM frozen before its first step reads idle, and its canary finds it instead.
    wait_until(lambda: len(answers.at) > 8, 30, "the load to be answered")
    incident = freeze_and_wait(sandbox, daemon, "waiting, and no engine step, prompt or generated")
    assert float(incident["running"]) >= 1  # type: ignore[arg-type]


def _sample(text: str, series: str) -> str:
    """The value of one series in a /metrics answer."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(series + " ")]
    return line.split()[-1]


def hangs(daemon: DaemonHelper) -> list[dict[str, object]]:
    return [e for e in daemon.history() if "vLLM hung" in str(e.get("what", ""))]


def test_a_capture_whose_flush_blocks_the_engine_under_load_past_the_stall_is_saved_not_hung(
    sandbox: SandboxHelper, profiling: DaemonHelper, load: threading.Event, answers: Answers
) -> None:
    """Real vLLM 0.16 stops the profiler and exports its traces on the engine core's loop: no
    step, no token, the requests waiting, for as long as the flush takes (150 s on the seed's
    host). Here 12 s, more than twice the stall time: no verdict while the capture is under
    way, and the capture is saved."""
    sandbox.fake(profile_flush_s=12.0)
    pid = profiling.vllm_pid()
    wait_until(lambda: len(answers.at) > 8, 30, "the load to be answered")
    time.sleep(6)  # a liveness reading old enough to open the "before" window (stall.py)
    r = profiling.kimi_mode("capture", "--seconds", "2", "--then", "stay", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    (rec,) = [e for e in profiling.history() if e["kind"] == "capture"]
    assert rec["ok"], rec
    # What the clients got meanwhile, from vLLM's own counters: served before and while
    # recording, next to nothing while the engine wrote its traces, served again after; and
    # the same vLLM all along (a capture in profile mode takes no restart).
    st = rec["stall"]
    assert st["before"]["tokens_per_s"] > 0 and st["recording"]["tokens_per_s"] > 0, st
    assert st["flush"]["seconds"] >= 12, st
    assert st["flush"]["tokens_per_s"] < st["recording"]["tokens_per_s"] / 4, st
    assert st["after"]["seconds"] >= 3 and st["after"]["tokens_per_s"] > 0, st
    assert st["failed"] == 0 and st["aborted"] == 0, st
    assert "tokens/s in the 1" in r.stdout and "s flush" in r.stdout, r.stdout
    assert "no request failed" in r.stdout, r.stdout
    m = sandbox.config.metrics
    with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as f:
        text = f.read().decode()
    flush_s = float(_sample(text, 'kimi_supervisor_capture_window_seconds{window="flush"}'))
    assert flush_s == pytest.approx(st["flush"]["seconds"], abs=0.01), text
    assert "kimi_supervisor_capture_failed_requests_total 0.0" in text
    # The stall counts again from the capture's end: a few stall times of normal load after it.
    time.sleep(3 * 5)
    assert not hangs(profiling) and profiling.vllm_pid() == pid
    assert profiling.status()["state"] == "serving"


def test_another_users_kernel_on_a_gpu_during_a_flush_past_the_bound_is_no_hang(
    sandbox: SandboxHelper, profiling: DaemonHelper, load: threading.Event, answers: Answers
) -> None:
    """Any user may open the GPUs' device nodes (0666): a process of theirs spinning a kernel on
    one managed GPU reads, while a capture's flush leaves vLLM's GPUs idle, as a rank stuck in
    a collective beside ranks that never reached it. NVML lists that process on the GPU: the
    GPU is set aside, and the flush, longer than hang_bound_s (15 s), is no verdict."""
    from kimi_supervisor.sandbox import simgpu

    sandbox.fake(profile_flush_s=25.0)
    pid = profiling.vllm_pid()
    ghost = sandbox.ghost(gpu="1", mib=100, title="python", spin=True)
    try:
        wait_until(lambda: len(answers.at) > 8, 30, "the load to be answered")
        r = profiling.kimi_mode("capture", "--seconds", "2", "--then", "stay", timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        (rec,) = [e for e in profiling.history() if e["kind"] == "capture"]
        assert rec["ok"] and rec["stall"]["flush"]["seconds"] >= 25, rec
        assert not hangs(profiling) and profiling.vllm_pid() == pid, hangs(profiling)
    finally:
        processes.send_signal(ghost, signal.SIGKILL)  # the ghost this test planted, ended
        sandbox.started.remove(ghost)  # here, so that its spin is undone after it
        wait_until(lambda: not processes.is_alive(ghost), 10, "the ghost to end")
        simgpu.set_activity(Path(sandbox.sb.gpu_dir), [1], "idle")


def test_a_vllm_saturated_with_its_stats_off_is_never_called_hung_and_status_says_no_metrics(
    sandbox: SandboxHelper, daemon: DaemonHelper, answers: Answers
) -> None:
    """`--disable-log-stats` (or a renamed metric): no vllm:* series. That is no reading, never
    "idle": the canary, which waits behind the load, is judged with the engine's CPU, which the
    load keeps busy."""
    sandbox.fake(disable_log_stats=True, engine_busy_fraction=0.6)
    daemon.start()
    daemon.wait_serving("production")
    pid = daemon.vllm_pid()
    done, threads = clients(sandbox, answers, 8, 60)
    try:
        # Six stall times and more than four canaries' worth of saturation.
        status = daemon.wait_status(
            lambda s: (s.get("liveness") or {}).get("canary_at") is not None, 30, "a canary"
        )
        time.sleep(30)
        status = daemon.status()
    finally:
        done.set()
        for th in threads:
            th.join(65)
    assert not hangs(daemon) and daemon.vllm_pid() == pid, hangs(daemon)
    assert status["liveness"]["metrics"] == "absent" and status["liveness"]["running"] is None
    assert any("no vllm:* series" in w for w in status["warnings"])
    assert len(answers.at) > 100  # it served all along
    text = daemon.kimi_mode("status").stdout
    assert "no vllm:* metrics (judged by the engine's CPU and the canary)" in text


def test_a_prefill_longer_than_the_stall_and_the_canary_timeout_completes_and_is_no_hang(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """vLLM updates /metrics only when a step ends: during one long prefill step it reads idle,
    the canary waits behind it, and no counter moves (real vLLM 0.16, 4096 tokens: judged hung
    40 s after it was sent). 4096 words at 3 ms each: about 12 s, more than the stall
    (5 s) and the canary's timeout (5 s)."""
    sandbox.fake(prefill_s_per_token=0.003)
    daemon.start()
    daemon.wait_serving("production")
    pid = daemon.vllm_pid()
    v = sandbox.config.vllm
    url, model = f"http://{v.host}:{v.port}", v.command[2]
    t0 = time.monotonic()
    complete(url, model, 120, prompt=" ".join(["word"] * 4096))
    took = time.monotonic() - t0
    assert took > 10, took
    time.sleep(2)  # the reading after it
    assert not hangs(daemon) and daemon.vllm_pid() == pid


def test_a_deadlocked_engine_under_load_is_found_and_its_window_is_what_clients_saw(
    sandbox: SandboxHelper, daemon: DaemonHelper, load: threading.Event, answers: Answers
) -> None:
    """A deadlock: the engine runs (state S), takes no step and uses no CPU; /health says 200.
    Found by the stalled counters and the idle CPU together; the unavailable window the daemon
    reports starts at the last proof of progress, not at the verdict, so it matches the gap
    the clients saw, within one metrics interval (1 s here) and the clients' own retry."""
    stuck = Path(sandbox.sb.root) / "deadlock"
    sandbox.fake(deadlock_file=str(stuck))
    daemon.start()
    daemon.wait_serving("production")
    main = daemon.vllm_pid()
    wait_until(lambda: len(answers.at) > 20, 30, "the load to be answered")
    stuck.touch()
    try:
        wait_until(lambda: bool(hangs(daemon)), 30, "the hang")
        # The old engine stays deadlocked until the teardown ends it (as a real one would);
        # the new one starts without the fault.
        sandbox.fake()
        status = daemon.wait_status(
            lambda s: s["state"] == "serving" and s["unit"]["main_pid"] not in (0, main),
            60,
            "a new vLLM serving",
        )
    finally:
        stuck.unlink()
    (incident,) = hangs(daemon)
    assert incident["main_pid"] == main and float(incident["running"]) >= 1  # type: ignore[arg-type]
    assert "process(es) used" in str(incident["what"]) and "of CPU in" in str(incident["what"])
    n = len(answers.at)
    wait_until(lambda: len(answers.at) > n + 5, 30, "clients to be answered again")
    window = daemon.status()["downtime"]["window_s"]
    seen = answers.gap()
    assert abs(window - seen) <= 1.0 + 0.5, (window, seen)
    assert status["unit"]["main_pid"] != main


def test_a_deadlock_beside_a_sidecar_busy_in_the_units_cgroup_is_found_at_the_stall(
    sandbox: SandboxHelper, daemon: DaemonHelper, load: threading.Event, answers: Answers
) -> None:
    """A process of vLLM's user out of its tree, in the unit's cgroup, spinning a core (a
    sidecar, a double fork): no compile's client waits on it, so its CPU is not the engine's,
    and a deadlock beside it is found at the stall as without it (not held as a doubt)."""
    stuck = Path(sandbox.sb.root) / "deadlock"
    sandbox.fake(deadlock_file=str(stuck), sidecar=True)
    daemon.start()
    daemon.wait_serving("production")
    c = sandbox.sb.config().liveness
    wait_until(lambda: len(answers.at) > 20, 30, "the load to be answered")
    stuck.touch()
    try:
        wait_until(lambda: bool(hangs(daemon)), c.stall_s + 30, "the hang")
    finally:
        stuck.unlink()
    (incident,) = hangs(daemon)
    assert "of CPU in" in str(incident["what"]), incident


def test_the_second_hang_within_the_window_is_not_restarted_but_failed_with_its_evidence(
    sandbox: SandboxHelper, daemon: DaemonHelper, load: threading.Event, answers: Answers
) -> None:
    """Hang restarts are bounded (liveness.max_hang_restarts = 2 in the sandbox): a vLLM that
    hangs again after its restart is torn down and left FAILED for an operator, no restart
    loop (each one costs a 30-minute load on the real host)."""
    daemon.start()
    daemon.wait_serving("production")
    # Frozen once the load has reached the engine (as the loaded freeze's test does): frozen
    # before its first step, vLLM reads idle and the canary finds it, with another sign (a
    # CI run froze it too early and waited 30 s for the stall's sign).
    wait_until(lambda: len(answers.at) > 8, 30, "the load to be answered")
    freeze_and_wait(sandbox, daemon, "waiting, and no engine step, prompt or generated")
    engine = engine_of(daemon.vllm_pid())
    os.kill(engine, signal.SIGSTOP)  # the sandbox's own vLLM, started for this test
    try:
        status = daemon.wait_state("failed", 60)
    finally:
        if processes.ref_of(engine) is not None:
            os.kill(engine, signal.SIGCONT)
    assert status["status_line"].startswith("FAILED: production gave up")
    first, second = hangs(daemon)
    assert "hang_limit" not in first
    assert str(second["hang_limit"]).startswith("2 hangs or unhealthy restarts within 86400 s")
    # Named by its comm (15 bytes): a stopped process's cmdline is not read.
    assert f"PID {engine} (VLLM::EngineCor, state T)" in str(second["stopped"])
    assert "liveness.max_hang_restarts = 2" in daemon.log()
    assert daemon.unit() == "active" and processes.ref_of(engine) is None
    # Its bundle keeps what explains the hang that was not restarted: the stacks too.
    status = daemon.wait_status(
        lambda s: (s.get("incident_bundle") or {}).get("trigger") == "failed", 30, "its bundle"
    )
    text = Path(status["incident_bundle"]["path"]).read_text()
    assert f"-- PID {engine} (VLLM::EngineCor), state T" in text, text[:3000]


def test_a_health_that_answers_late_from_a_busy_api_server_is_never_restarted(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """Slow is not hung: /health gives no answer in its timeout for four grace periods while
    the API server works (its event loop held, a core in use). No restart; status says why.
    Once it answers again, the warning goes."""
    busy = Path(sandbox.sb.root) / "api-busy"
    sandbox.fake(api_busy_file=str(busy))
    with daemon.configured(daemon={"health_interval_s": 2}):  # 30 s in the sandbox's config
        daemon.start()
    daemon.wait_serving("production")
    pid = daemon.vllm_pid()
    grace = sandbox.config.daemon.health_grace_s
    busy.touch()
    try:
        status = daemon.wait_status(
            lambda s: any("but vLLM's processes are busy" in w for w in s["warnings"]),
            30 + 2 * grace,
            "the daemon to say /health is slow and the API server busy",
        )
        time.sleep(3 * grace)  # three more grace periods of no answer
        status = daemon.status()
        m = sandbox.config.metrics
        with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as r:
            exported = r.read().decode()
    finally:
        busy.unlink()
    # The doubt is exported (the alert KimiSupervisorVllmMaybeHung reads it), since the first
    # failed answer at the latest.
    (line,) = [
        ln for ln in exported.splitlines() if ln.startswith("kimi_supervisor_liveness_doubt")
    ]
    assert 0 < float(line.split()[1]) <= time.time() - 3 * grace, line
    assert daemon.vllm_pid() == pid and status["state"] == "serving", status["status_line"]
    assert not any(e.get("kind") == "incident" for e in daemon.history())
    daemon.wait_status(
        lambda s: not any("/health has given no answer" in w for w in s["warnings"]),
        60,
        "the warning to go once /health answers",
    )


def test_an_api_server_frozen_with_health_unanswered_is_restarted_and_bounded_with_hangs(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """The API server stopped (SIGSTOP, as one wedged in the kernel): /health gets no answer
    and the process is stopped throughout the grace: two signs, so it is restarted, and the
    reason names both. The same again is the second within the window (the sandbox's
    max_hang_restarts, 2, counts hangs and unhealthy restarts together): FAILED, no loop.
    /health is asked every 2 s here (30 s in the sandbox's config): two freezes, one minute
    less of CI."""
    with daemon.configured(daemon={"health_interval_s": 2}):
        daemon.start()
    daemon.wait_serving("production")

    def freeze() -> tuple[int, dict[str, object]]:
        main = daemon.vllm_pid()
        os.kill(main, signal.SIGSTOP)  # the sandbox's own vLLM, started for this test
        try:
            wait_until(lambda: daemon.status()["state"] != "serving", 90, "the restart to begin")
        finally:
            if processes.ref_of(main) is not None:
                os.kill(main, signal.SIGCONT)
        lost = [e for e in daemon.history() if "vLLM unhealthy" in str(e.get("what", ""))]
        return main, lost[-1]

    main, incident = freeze()
    status = daemon.wait_serving("production", 60)
    assert status["unit"]["main_pid"] != main
    what = str(incident["what"])
    assert "/health gave no answer" in what and f"PID {main} (" in what and "state T)" in what
    assert incident["main_pid"] == main and incident["health_slow"] is True
    # The window opens at the last /health 200, before the freeze, not at the restart.
    assert status["downtime"]["window_s"] >= sandbox.config.daemon.health_grace_s, status
    _main, again = freeze()
    assert str(again["hang_limit"]).startswith("2 hangs or unhealthy restarts within"), again
    status = daemon.wait_state("failed", 60)
    assert status["status_line"].startswith("FAILED: production gave up"), status
    assert "liveness.max_hang_restarts = 2" in daemon.log()


# The bound on a doubt, with the sandbox's values and with the shipped ones scaled down by one
# factor (every duration of liveness and the unit's grace over SCALED; the fraction kept).
SCALED = 30


def _scaled() -> dict[str, dict[str, object]]:
    from kimi_supervisor.config import LivenessConfig, TeardownConfig

    c = LivenessConfig()
    keys = ("metrics_interval_s", "stall_s", "canary_interval_s", "canary_timeout_s",
            "hang_bound_s", "hang_term_grace_s")  # fmt: skip
    return {
        "liveness": {k: getattr(c, k) / SCALED for k in keys},
        "teardown": {"term_grace_s": TeardownConfig().term_grace_s / SCALED},
    }


VALUES = {"with the sandbox's values": {}, f"with the shipped values over {SCALED}": _scaled()}


def started(sandbox: SandboxHelper, daemon: DaemonHelper, values: dict[str, Any]) -> Any:
    """The daemon started with `values`, serving; the liveness values it runs with."""
    from kimi_supervisor.configfile import load_config

    with daemon.configured(**values):
        config = load_config(sandbox.sb.config_path)
        daemon.start()
    daemon.wait_serving("production")
    return config


@pytest.mark.parametrize("values", VALUES.values(), ids=list(VALUES))
def test_a_collective_stuck_under_load_is_hung_at_the_bound_and_its_stacks_are_kept(
    sandbox: SandboxHelper, daemon: DaemonHelper, answers: Answers, values: dict[str, Any]
) -> None:
    """The deadlock that looks busy: no step, a thread of the engine spinning a core, every GPU
    reading a kernel that spins (busy, no memory traffic, idle power), client requests open.
    Past hang_bound_s it is a hang: restarted, the verdict naming what it read, the incident
    bundle holding every vLLM process's stacks from before the teardown, which does not wait
    out teardown.term_grace_s for an API server that would finish its requests (30 s here)."""
    stuck = Path(sandbox.sb.root) / "stuck-collective"
    sandbox.fake(stuck_collective_file=str(stuck), shutdown_delay_s=30)
    config = started(sandbox, daemon, values)
    c = config.liveness
    main = daemon.vllm_pid()
    tree = [main, *processes.descendants(main)]
    done, threads = clients(sandbox, answers, 4, 120)
    try:
        wait_until(lambda: len(answers.at) > 8, 30, "the load to be answered")
        stuck.touch()
        wait_until(lambda: bool(hangs(daemon)), 3 * c.hang_bound_s + 60, "the hang")
        sandbox.fake()  # the next vLLM starts without the fault
        served = daemon.wait_serving_anew("production", main)
    finally:
        stuck.unlink(missing_ok=True)
        done.set()
        for t in threads:
            t.join(125)
    (incident,) = hangs(daemon)
    what = str(incident["what"])
    assert f"(liveness.hang_bound_s = {c.hang_bound_s:g} s) with no sign of real work" in what
    assert "GPU 0: busy 100 %, memory 0 %" in what
    assert "vLLM's helpers and ended children used" in what
    assert float(incident["doubt_s"]) >= c.hang_bound_s  # type: ignore[arg-type]
    # Stuck right after a step that ended every request in flight, the gauges read idle (they
    # move only when a step ends, as vLLM 0.16's): the unanswered canary is the sign then (seen
    # in CI under load), the gauges read last shown with their age.
    if "waiting, and no engine step" in what:
        pending = float(incident["running"]) + float(incident["waiting"])  # type: ignore[arg-type]
        assert pending >= 1, incident
    else:
        assert "a one-token request" in what, incident
    # One attempt: the window's first part is the hang, its teardown and the backoff.
    text = served["downtime"]["text"]
    assert "the lost vLLM until found, its teardown and the backoff" in text, text
    assert "earlier attempts" not in text, text
    status = daemon.wait_status(
        lambda s: (s.get("incident_bundle") or {}).get("trigger") == "hang", 30, "its bundle"
    )
    text = Path(status["incident_bundle"]["path"]).read_text()
    for pid in tree:
        assert f"-- PID {pid} (" in text, f"no stack of PID {pid}"
    assert "wchan" in text and "vllm:num_requests_running" in text
    grace = min(c.hang_term_grace_s, config.teardown.term_grace_s)
    assert f"unit still active after term_grace_s={grace} s" in text


@pytest.mark.parametrize("values", VALUES.values(), ids=list(VALUES))
def test_a_thread_spinning_in_an_engine_that_steps_is_never_hung(
    sandbox: SandboxHelper, daemon: DaemonHelper, answers: Answers, values: dict[str, Any]
) -> None:
    """The same spinning thread, but the engine steps: twice the bound and more, no verdict."""
    spin = Path(sandbox.sb.root) / "spinning-thread"
    spin.touch()
    sandbox.fake(spinning_thread_file=str(spin))
    c = started(sandbox, daemon, values).liveness
    pid = daemon.vllm_pid()
    done, threads = clients(sandbox, answers, 4, 60)
    try:
        wait_until(lambda: len(answers.at) > 8, 30, "the load to be answered")
        n = len(answers.at)
        time.sleep(2 * (c.hang_bound_s + c.metrics_interval_s))
    finally:
        spin.unlink()
        done.set()
        for t in threads:
            t.join(65)
    assert not hangs(daemon) and daemon.vllm_pid() == pid, hangs(daemon)
    assert len(answers.at) > n + 20  # it served all along


COMPILES = {
    **{f"a compile child {k}": (v, False) for k, v in VALUES.items()},
    # sccache's server, double forked: out of the tree, in the unit's cgroup
    "a compile server out of vLLM's tree with the sandbox's values": ({}, True),
}


@pytest.mark.parametrize(("values", "server"), COMPILES.values(), ids=list(COMPILES))
def test_a_compile_using_a_core_longer_than_the_bound_is_never_hung(
    sandbox: SandboxHelper,
    daemon: DaemonHelper,
    answers: Answers,
    values: dict[str, Any],
    server: bool,
) -> None:
    """FlashInfer compiles its kernels at their first call, in ninja and nvcc under a worker,
    for up to 10 minutes with no log and no step: requests wait, the engine is busy, the GPUs
    idle. The compiler's CPU is real work: a doubt that says so past the bound, never a hang.
    So is a compiler's server that left the tree (sccache's), found in the unit's cgroup."""
    jit = Path(sandbox.sb.root) / "compile"
    sandbox.fake(compile_file=str(jit), compile_server=server)
    c = started(sandbox, daemon, values).liveness
    pid = daemon.vllm_pid()
    done, threads = clients(sandbox, answers, 4, 300)
    try:
        wait_until(lambda: len(answers.at) > 8, 30, "the load to be answered")
        jit.touch()
        status = daemon.wait_status(
            lambda s: "ended children used" in str((s.get("liveness") or {}).get("doubt")),
            3 * c.hang_bound_s + 60,
            "the doubt past the bound to name the compiler",
        )
        time.sleep(c.hang_bound_s / 2)  # the compile goes on: 1.5 times the bound and more
        assert "(cc1plus)" in status["liveness"]["doubt"], status["liveness"]
        n = len(answers.at)
    finally:
        jit.unlink(missing_ok=True)
    try:
        wait_until(lambda: len(answers.at) > n + 8, 60, "the load to be answered again")
    finally:
        done.set()
        for t in threads:
            t.join(305)
    assert not hangs(daemon) and daemon.vllm_pid() == pid, hangs(daemon)


def test_a_worker_frozen_during_a_captures_flush_is_hung_and_the_capture_says_why(
    sandbox: SandboxHelper, profiling: DaemonHelper, load: threading.Event, answers: Answers
) -> None:
    """A flush is bounded by profiling.flush_timeout_s (30 minutes shipped) because it works;
    a worker stopped on the serving path does not: the verdict comes a stall time after it
    stopped, as without a capture, and the capture fails saying why."""
    sandbox.fake(profile_flush_s=120.0)
    main = profiling.vllm_pid()
    worker = next(p for p in processes.descendants(main)
                  if processes.comm_of(p).startswith("VLLM::Worker"))  # fmt: skip
    wait_until(lambda: len(answers.at) > 8, 30, "the load to be answered")
    out: list[subprocess.CompletedProcess[str]] = []
    capture = threading.Thread(
        target=lambda: out.append(
            profiling.kimi_mode("capture", "--seconds", "1", "--then", "stay", timeout=150)
        )
    )
    capture.start()
    try:
        profiling.wait_status(
            lambda s: (s.get("capture") or {}).get("phase") == "flushing", 30, "the flush"
        )
        os.kill(worker, signal.SIGSTOP)  # a process of the sandbox's own vLLM
        wait_until(lambda: bool(hangs(profiling)), 60, "the hang")
    finally:
        if processes.ref_of(worker) is not None:
            os.kill(worker, signal.SIGCONT)
        capture.join(150)
    (incident,) = hangs(profiling)
    assert "a capture is under way, and the engine: stopped: PID" in str(incident["what"])
    (rec,) = [e for e in profiling.history() if e["kind"] == "capture"]
    assert not rec["ok"] and "the capture failed: vLLM hung: a capture is under way" in str(
        rec["message"]
    ), rec
    assert out and out[0].returncode != 0 and "vLLM hung" in out[0].stdout + out[0].stderr
