"""The daemon as systemd runs it: `kimi-supervisor.service` of the sandbox's real user manager,
owning `vllm-kimi-k25.service` (the fake vLLM) on simulated GPUs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from kimi_supervisor.model import Mode
from kimi_supervisor.ports import launcher, processes
from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT, UNIT
from kimi_supervisor.store.state import StateStore

from ..conftest import DaemonHelper, SandboxHelper, flat, health, too_wide, wait_until
from ..promtool import stuck_alert_fires_at

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.systemd

WORKER_MIB = 90_000


def vllm_argv(daemon: DaemonHelper) -> list[str]:
    return processes.cmdline_of(daemon.vllm_pid())


def only_vllm_on_gpus(sandbox: SandboxHelper) -> bool:
    return all(u == b + WORKER_MIB for u, b in zip(sandbox.used(), sandbox.baseline(), strict=True))


def test_boot_brings_up_the_persisted_profile_mode_with_the_profiler_arguments_byte_exact(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.reset_state(desired="profile")
    daemon.start()
    status = daemon.wait_serving("profile")
    # The mode's argv byte for byte, then the launcher's profile guard (ports/launcher.py)
    expected = [*sandbox.config.launch_argv(Mode.PROFILE), *launcher.GUARD_ARGS]
    assert vllm_argv(daemon)[-len(expected) :] == expected
    assert status["desired_mode"] == "profile"
    assert status["unit"]["health"] == 200
    assert only_vllm_on_gpus(sandbox)


def test_a_restarted_daemon_adopts_the_healthy_vllm_without_restarting_it(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    vllm, first = daemon.vllm_pid(), daemon.pid()
    teardowns = daemon.teardown_count()

    # A crash: systemd restarts the daemon (Restart=on-failure) and it finds vLLM serving.
    sandbox.systemd.kill(DAEMON_UNIT, "main", signal.SIGKILL)
    wait_until(lambda: daemon.pid() not in (0, first), 20, "systemd to restart the daemon")
    status = daemon.wait_serving("production")
    assert daemon.vllm_pid() == vllm == status["unit"]["main_pid"]

    # An upgrade: `systemctl reload` re-executes the daemon in place; vLLM is left alone again.
    sandbox.sb.manager.systemctl("reload", DAEMON_UNIT)
    wait_until(lambda: "reexec" in daemon.log(), 10, "the daemon to re-execute")
    daemon.wait_serving("production")
    assert daemon.vllm_pid() == vllm
    assert daemon.teardown_count() == teardowns
    assert '"adopted"' in daemon.log()


def test_a_daemon_killed_in_the_middle_of_a_teardown_converges_to_the_desired_mode_when_restarted(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    # vLLM will ignore SIGTERM: the teardown spends term_grace_s in stop_unit, long enough on a
    # busy host for the kill below to land in it (the restarted daemon reads the sandbox's 2 s).
    with daemon.configured(teardown={"term_grace_s": 10}):
        daemon.start()
    daemon.wait_serving("production")
    sandbox.fake(ignore_sigterm=True)
    r = daemon.kimi_mode("profile", "--no-wait")
    assert r.returncode == 0, r.stderr
    status = daemon.wait_state("tearing_down", 10)
    assert status["desired_mode"] == "profile"
    first = daemon.pid()
    sandbox.systemd.kill(DAEMON_UNIT, "main", signal.SIGKILL)
    wait_until(lambda: daemon.pid() not in (0, first), 20, "systemd to restart the daemon")
    sandbox.fake()
    status = daemon.wait_serving("profile", 40)
    assert "--profiler-config" in vllm_argv(daemon)
    assert only_vllm_on_gpus(sandbox)
    redone = [t for t in daemon.transitions() if t["reason"].startswith("redoing")]
    assert redone and redone[-1]["outcome"] == "ready"


def test_a_corrupt_state_file_is_moved_aside_and_production_comes_up(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    state_file = sandbox.config.state.dir / "state.json"
    state_file.write_text('{"version": 1, "desired_mode": "prof')
    daemon.start()
    status = daemon.wait_serving("production")
    aside = list(sandbox.config.state.dir.glob("state.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text().startswith('{"version": 1')
    assert any("was unusable" in w for w in status["warnings"])
    assert json.loads(state_file.read_text())["desired_mode"] == "production"


def test_a_profile_mode_that_crashes_while_loading_rolls_back_to_production_and_says_why(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    sandbox.fake(crash_during_load_at=40, load_faults_only_when_profiling=True)
    r = daemon.kimi_mode("profile")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rolling back to production" in flat(r.stdout), r.stdout
    assert "simulated crash while loading at" in flat(r.stdout)  # the unit's last lines, shown
    status = daemon.wait_serving("production")
    assert status["desired_mode"] == "production"
    assert "--profiler-config" not in vllm_argv(daemon)
    outcomes = [(t["target"], t["outcome"]) for t in daemon.transitions()]
    assert ("profile", "rolled_back") in outcomes
    failed = next(t for t in daemon.transitions() if t["outcome"] == "rolled_back")
    assert any("simulated crash" in line for line in failed["output_tail"])
    assert outcomes[-1] == ("production", "ready")


def test_vllm_killed_while_serving_with_a_ghost_left_behind_is_cleaned_up_and_brought_back(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    # Worker 0 starts a ghost that escapes the unit's cgroup and holds memory.
    sandbox.fake(
        ghost_title="python3", ghost_mib=4000, ghost_cgroup_procs=sandbox.sb.ghost_cgroup_procs()
    )
    daemon.start()
    daemon.wait_serving("production")
    sandbox.fake()
    old = daemon.vllm_pid()
    # The API server dies. systemd kills what is left in the unit's cgroup (KillMode=mixed, main
    # process gone); the ghost that escaped the cgroup lives on, holding memory on every GPU.
    processes.send_signal(processes.ref_of(old), signal.SIGKILL)  # type: ignore[arg-type]
    wait_until(lambda: daemon.vllm_pid() not in (0, old), 30, "vLLM to be started again")
    status = daemon.wait_serving("production")
    assert only_vllm_on_gpus(sandbox)
    assert status["failures_in_window"] == 1
    incidents = [e for e in daemon.history() if e["kind"] == "incident"]
    assert incidents and "is gone" in incidents[-1]["what"]
    after_death = next(
        e for e in daemon.history() if e["kind"] == "teardown" and "died" in e["reason"]
    )
    assert after_death["outcome"] == "clean"
    killed = [k["process"]["cmdline"] for k in after_death["kills"] if k["signal"] == "SIGKILL"]
    assert ["python3"] in killed  # the ghost, outside the unit


def test_stopping_the_daemon_leaves_the_unit_inactive_and_the_gpus_at_baseline(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    sandbox.ghost(gpu="1", mib=3000, title="jupyter-kernel")
    daemon.stop()  # returns when systemd has seen the daemon exit
    assert sandbox.systemd.status(UNIT).inactive
    assert sandbox.used() == sandbox.baseline()
    assert daemon.unit() == "inactive"
    assert health(sandbox.config.vllm.health_url) == 0


WEDGE = """import signal, threading
def _wedge(*_):
    print("fault_wedge: the loop is blocked on purpose", file=sys.stderr, flush=True)
    threading.Event().wait()
signal.signal(signal.SIGUSR2, _wedge)
"""


def test_a_daemon_whose_loop_is_blocked_is_restarted_by_the_systemd_watchdog(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    # The product has no fault hook: this test's own entry point plants one, a SIGUSR2 handler
    # that blocks the main thread (the loop's) for good.
    launcher = sandbox.sb.root / "bin" / "kimi-supervisor"
    wedged = launcher.with_name("kimi-supervisor-wedged")
    main = "from kimi_supervisor.cli.admin import main\n"
    wedged.write_text(launcher.read_text().replace(main, WEDGE + main))
    wedged.chmod(0o755)
    daemon.override(
        f"WatchdogSec=2\nExecStart=\nExecStart={wedged} run --config {sandbox.sb.config_path}\n"
    )
    daemon.start()
    daemon.wait_serving("production")
    vllm, first = daemon.vllm_pid(), daemon.pid()
    sandbox.systemd.kill(DAEMON_UNIT, "main", signal.SIGUSR2)  # the loop blocks for good
    wait_until(lambda: "fault_wedge" in daemon.log(), 5, "the loop to block")
    wait_until(lambda: daemon.pid() not in (0, first), 30, "the watchdog to restart the daemon")
    daemon.wait_serving("production")
    assert daemon.vllm_pid() == vllm


def test_metrics_follow_prometheus_naming_and_every_shipped_query_finds_its_metric(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    m = sandbox.config.metrics
    with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    uuid = "GPU-5e1f0000-0000-4000-8000-000000000000"  # the simulated GPU 0's, as NVML names it
    baseline = sandbox.baseline()[0] * (1 << 20)
    assert 'kimi_supervisor_mode{mode="production"} 1.0' in text
    assert 'kimi_supervisor_state{state="serving"} 1.0' in text
    line = f'kimi_supervisor_gpu_baseline_bytes{{gpu="0",uuid="{uuid}"}} '
    (value,) = [x.removeprefix(line) for x in text.splitlines() if x.startswith(line)]
    assert float(value) == baseline
    assert 'kimi_supervisor_transitions_total{outcome="ready",target="production"} 1.0' in text
    assert 'kimi_supervisor_start_duration_seconds_count{mode="production"} 1.0' in text
    assert "kimi_supervisor_teardown_duration_seconds_bucket" in text
    assert 'kimi_supervisor_build_info{python="' in text and "_mib" not in text
    # Every metric the dashboard and the alert rules query is one this daemon serves.
    served = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    dashboard = (ROOT / "config/grafana/kimi-supervisor.json").read_text()
    fleet = (ROOT / "config/prometheus/kimi-supervisor-fleet.yml").read_text()
    alerts = (ROOT / "config/prometheus/kimi-supervisor-alerts.yml").read_text()
    shipped = dashboard + fleet + alerts
    queried = {re.sub(r"_(bucket|sum|count)$", "", n)
               for n in re.findall(r"(?<![\w:])kimi_supervisor_\w+", shipped)}  # fmt: skip
    assert len(queried) >= 10 and queried <= served, queried - served
    # The dashboard's fleet row reads recording rules: each one is recorded by the fleet rules.
    recorded = set(re.findall(r"record: (\S+)", fleet))
    used = set(re.findall(r"\w+:kimi_supervisor_\w+:\w+", dashboard))
    assert len(used) >= 5 and used <= recorded, used - recorded


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (the set-up installs it)")
def test_the_shipped_alert_fleet_and_dcgm_rules_pass_promtool_and_their_unit_tests() -> None:
    prom = ROOT / "config/prometheus"
    r = subprocess.run(["promtool", "check", "config", "prometheus-fleet.yml"], cwd=prom,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0 and "SUCCESS: 3 rule files found" in r.stdout, r.stdout + r.stderr
    assert "SUCCESS: 15 rules found" in r.stdout and "SUCCESS: 10 rules found" in r.stdout
    assert "SUCCESS: 2 rules found" in r.stdout  # the dcgm-exporter join
    for test in ("alerts_test.yml", "fleet_test.yml", "dcgm_test.yml"):
        r = subprocess.run(["promtool", "test", "rules", test], capture_output=True, text=True,
                           cwd=ROOT / "tests/prometheus")  # fmt: skip
        assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_a_vllm_that_keeps_failing_is_retried_with_backoff_then_failed_until_asked_again(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    sandbox.fake(crash_during_load_at=30)  # every start crashes, production included
    daemon.start()
    status = daemon.wait_state("failed", 60)
    assert status["failures_in_window"] == 3  # max_failures in the sandbox
    assert "kimi-mode production" in status["status_line"]
    outcomes = [t["outcome"] for t in daemon.transitions()]
    assert outcomes.count("failed") == 3
    assert sandbox.used() == sandbox.baseline()  # torn down after each failure
    # A monitor or a script sees it from the exit codes alone.
    assert daemon.kimi_mode("status").returncode == 1
    r = daemon.kimi_mode("is-serving")
    assert (r.returncode, r.stdout) == (1, "failed\n")  # nothing runs, so no mode
    sandbox.fake()
    r = daemon.kimi_mode("production")
    assert r.returncode == 0, r.stdout + r.stderr
    assert daemon.wait_serving("production")["failures_in_window"] == 0
    assert daemon.kimi_mode("status").returncode == 0


def test_at_boot_the_daemon_waits_for_the_gpu_driver_without_holding_systemctl_and_says_so(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """Before, READY=1 came only once the driver answered, so `systemctl start` (and an
    install that enables the unit before the driver is there) hung for TimeoutStartSec, while
    status exited 0; a stop meanwhile crashed three teardowns."""
    host = sandbox.sb.gpu_dir / "host.json"
    hidden = host.with_name("host.json.away")
    host.rename(hidden)  # the "driver" is not loaded yet
    try:
        daemon.start()  # returns: the daemon has started, and waits running
        assert sandbox.systemd.status(DAEMON_UNIT).active_state == "active"
        status = daemon.wait_status(lambda s: s["waiting_for"] is not None, 20, "waiting")
        assert status["state"] == "booting"
        assert status["waiting_for"].startswith("waiting for the GPU driver")
        assert status["status_line"] == f"booting: {status['waiting_for']}"
        text = sandbox.sb.manager.systemctl("show", "-p", "StatusText", DAEMON_UNIT).stdout
        assert "waiting for the GPU driver" in text
        r = daemon.kimi_mode("status")
        assert r.returncode == 1 and "waiting for the GPU driver" in r.stdout
        r = daemon.kimi_mode("is-serving")
        assert (r.returncode, r.stdout) == (1, "booting\n")
        assert "waiting for the GPU driver" in r.stderr
        # A stop while waiting ends at once, cleanly: nothing was started, no GPU can be read.
        since = len(daemon.log())
        daemon.stop()
        assert sandbox.systemd.status(DAEMON_UNIT).active_state == "inactive"
        assert "teardown_crashed" not in daemon.log()[since:]
        daemon.start()
    finally:
        hidden.rename(host)
    status = daemon.wait_serving("production", 30)
    assert status["waiting_for"] is None
    assert not any("GPU driver" in w for w in status["warnings"])
    assert daemon.kimi_mode("status").returncode == 0


def test_without_a_stored_baseline_and_busy_gpus_a_provisional_one_is_used_until_calibrated(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    # (A daemon that finds the GPUs idle calibrates at boot, so a failure here heals itself.)
    store = StateStore(sandbox.config.state.dir)
    store.update(lambda st: st.model_copy(update={"baseline": None}))
    sandbox.start_vllm("production")  # the GPUs are busy when the daemon starts
    daemon.start()
    status = daemon.wait_serving("production")
    assert status["baseline_provisional"]
    assert any("no baseline" in w for w in status["warnings"])
    assert store.read()[0].baseline is None
    daemon.kimi_mode("profile")  # its teardown leaves the GPUs idle: calibrated then
    status = daemon.wait_serving("profile")
    assert not status["baseline_provisional"]
    assert [g["baseline_mib"] for g in status["gpus"]] == sandbox.baseline()
    calibrated = store.read()[0].baseline
    assert calibrated is not None and calibrated.devices == dict(enumerate(sandbox.baseline()))


def test_a_process_that_takes_a_managed_gpu_while_vllm_loads_is_noticed_killed_and_the_load_redone(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    sandbox.fake(load_s=10.0)  # a load long enough, on a busy host, to plant both during it
    r = daemon.kimi_mode("profile", "--no-wait")
    assert r.returncode == 0, r.stderr
    daemon.wait_state("starting", 15)
    monitor = sandbox.ghost(gpu="all", mib=0, title="nvtop")  # an NVML client: a bystander
    intruder = sandbox.ghost(gpu="1", mib=30_000, title="python train.py")
    status = daemon.wait_serving("profile", 60)
    assert not processes.is_alive(intruder)
    assert processes.is_alive(monitor)
    assert only_vllm_on_gpus(sandbox), "vLLM loaded again, onto GPUs with nothing else on them"
    seen = status["last_intrusion"]
    assert seen["processes"] == [{"pid": intruder.pid, "gpu": 1, "name": "python train.py"}]
    history = daemon.history()
    assert any(e.get("incident") == "gpu_intrusion" for e in history)
    outcomes = [t["outcome"] for t in daemon.transitions()]
    assert outcomes[-2:] == ["intruded", "ready"]
    killed = [
        k["process"]["pid"]
        for e in history
        if e["kind"] == "teardown"
        for k in e["kills"]
        if k["signal"] == "SIGKILL" and k["evidence"].startswith("NVML lists it")
    ]
    assert killed == [intruder.pid]
    m = sandbox.config.metrics
    with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as resp:
        assert 'kimi_supervisor_gpu_intrusions_total{gpu="1"} 1.0' in resp.read().decode()


def test_vllms_death_while_serving_wakes_the_daemon_through_its_pidfd_not_at_the_next_tick(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    old = daemon.vllm_pid()
    processes.send_signal(processes.ref_of(old), signal.SIGKILL)  # type: ignore[arg-type]

    def lines() -> list[dict[str, object]]:
        # Each record, also where two share a line: CI once saw a record written before the
        # newline of the one before it in the sandbox's log file (unexplained; the journal,
        # on a real host, takes each record as a datagram of its own).
        out, decoder = [], json.JSONDecoder()
        for x in daemon.log().splitlines():
            at = 0
            while x.startswith("{", at):
                record, at = decoder.raw_decode(x, at)
                out.append(record)
        return out

    wait_until(
        lambda: any(e["event"] == "vllm_main_exited" and e["main_pid"] == old for e in lines()),
        10,
        "the daemon to log vLLM's MainPID exit",
    )
    exited = next(i for i, e in enumerate(lines()) if e["event"] == "vllm_main_exited")
    died = next(i for i, e in enumerate(lines()) if e["event"] == "vllm_died")
    assert exited < died, "the pidfd woke the loop before any tick observed the death"
    daemon.wait_serving("production", 30)
    assert daemon.vllm_pid() != old


def test_a_manual_teardown_is_refused_while_the_daemon_runs_and_says_how_to_stop_it(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    from .test_cli import cli

    daemon.start()
    daemon.wait_serving("production")
    vllm = daemon.vllm_pid()
    r = cli(sandbox, "teardown")
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"the daemon is running (PID {daemon.pid()})" in r.stderr
    assert "systemctl stop kimi-supervisor" in r.stderr
    assert daemon.vllm_pid() == vllm and daemon.status()["state"] == "serving"


def test_systemctl_restart_of_the_daemon_adopts_vllm_instead_of_tearing_it_down(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    vllm, first = daemon.vllm_pid(), daemon.pid()
    teardowns = daemon.teardown_count()
    sandbox.sb.manager.systemctl("restart", DAEMON_UNIT)
    wait_until(lambda: daemon.pid() not in (0, first), 20, "the new daemon")
    status = daemon.wait_serving("production")
    assert daemon.vllm_pid() == vllm == status["unit"]["main_pid"]  # never reloaded
    assert daemon.teardown_count() == teardowns
    # A stop still tears down: only a restart leaves vLLM running.
    daemon.stop()
    assert sandbox.systemd.status("vllm-kimi-k25.service").inactive


def test_a_serving_vllm_whose_unit_file_is_moved_away_serves_on_and_status_says_so(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """An operator moves vLLM's unit file away and runs `daemon-reload`: systemd then reads
    the running unit as "not-found", and its MainPID runs on. Read as gone, a healthy vLLM was
    torn down and could not start again (the file missing): a booted host's doctor test, with
    its file away a few seconds longer on a loaded machine, ended FAILED so."""
    daemon.start()
    daemon.wait_serving("production")
    vllm, teardowns = daemon.vllm_pid(), daemon.teardown_count()
    since = len(daemon.log())  # the session's earlier tests wrote to it too
    unit_file = sandbox.sb.manager.unit_dir / UNIT
    away = unit_file.with_name(f"{UNIT}.away")
    unit_file.rename(away)
    try:
        sandbox.sb.manager.systemctl("daemon-reload")
        st = daemon.wait_status(lambda s: s["unit"]["load_state"] == "not-found", 30, "not-found")
        assert st["state"] == "serving" and st["unit"]["main_pid"] == vllm, st
        assert any("unit file gone or broken (systemd: not-found)" in w for w in st["warnings"])
        # Its processes are still listed, for the liveness readings and a teardown's kills.
        assert vllm in sandbox.systemd.cgroup_pids(UNIT)
        # A switch would stop it and fail to start the next: refused before anything stops.
        r = daemon.kimi_mode("profile")
        assert r.returncode == 5 and "systemd reads vllm-kimi-k25.service as not-found" in flat(
            r.stdout + r.stderr
        ), r.stdout + r.stderr
        assert daemon.status()["state"] == "serving" and daemon.vllm_pid() == vllm
    finally:
        away.rename(unit_file)
        sandbox.sb.manager.systemctl("daemon-reload")
    st = daemon.wait_status(lambda s: s["unit"]["load_state"] == "loaded", 30, "loaded again")
    assert st["state"] == "serving" and daemon.vllm_pid() == vllm and not st["warnings"], st
    assert daemon.teardown_count() == teardowns and "vllm_died" not in daemon.log()[since:]


def test_the_daemon_runs_confined_by_its_units_hardening(daemon: DaemonHelper) -> None:
    """The unit's hardening is in force on the running daemon (what /proc says of it), and vLLM
    runs with no capability at all (the sandbox runs it as root, so the bounding set is what
    holds it)."""
    daemon.start()
    daemon.wait_serving("production")

    def status_of(pid: int) -> dict[str, str]:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        return dict(line.split(":\t", 1) for line in lines if ":\t" in line)

    def caps(mask: str) -> set[str]:
        names = {0: "chown", 1: "dac_override", 2: "dac_read_search", 3: "fowner", 5: "kill",
                 14: "ipc_lock", 19: "sys_ptrace", 21: "sys_admin", 23: "sys_nice",
                 24: "sys_resource"}  # fmt: skip
        bits = int(mask, 16)
        return {names.get(i, str(i)) for i in range(64) if bits >> i & 1}

    here = caps(status_of(os.getpid())["CapBnd"])  # a container may hold fewer to begin with
    own = status_of(daemon.pid())
    assert own["NoNewPrivs"].strip() == "1" and own["Seccomp"].strip() == "2"  # a filter
    expected = {"kill", "sys_ptrace", "dac_override", "dac_read_search", "fowner", "chown"}
    assert caps(own["CapBnd"]) == expected & here
    vllm = status_of(daemon.vllm_pid())
    assert caps(vllm["CapBnd"]) == set() and caps(vllm["CapEff"]) == set()


def _state_metric(sandbox: SandboxHelper) -> dict[str, float]:
    m = sandbox.config.metrics
    with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = re.findall(r'^kimi_supervisor_state\{state="(\w+)"\} (\S+)$', text, re.M)
    since = re.search(r"^kimi_supervisor_stuck_since_timestamp_seconds (\S+)$", text, re.M)
    assert since is not None
    return {k: float(v) for k, v in found} | {"stuck_since": float(since.group(1))}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (the set-up installs it)")
def test_stuck_stays_stuck_through_its_retries_in_status_metrics_exit_codes_and_the_alert(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """Before, each retry of a STUCK teardown showed `tearing_down`, so the STUCK alert never
    fired, status exited 0 half the time, and the retries filled the history."""
    daemon.start()
    daemon.wait_serving("production")
    leak = sandbox.sb.leak(1, 20_000)  # memory no teardown can free
    r = daemon.kimi_mode("profile")
    assert r.returncode == 6 and "STUCK" in r.stdout + r.stderr, r.stdout + r.stderr
    samples: list[tuple[str, int, float, float]] = []
    retrying_seen = False
    while len(samples) < 40 or daemon.status()["stuck"]["retries"] < 3:
        assert len(samples) < 200, samples[-3:]
        status = daemon.status()
        rc = daemon.kimi_mode("status").returncode
        metric = _state_metric(sandbox)
        samples.append((status["state"], rc, metric["stuck"], metric["stuck_since"]))
        retrying_seen |= bool(status["stuck"] and status["stuck"]["retrying"])
    assert retrying_seen
    assert {(state, rc, stuck) for state, rc, stuck, _ in samples} == {("stuck", 6, 1.0)}
    assert len({since for *_, since in samples}) == 1 and samples[0][3] > 0
    # The shipped alert, fed the daemon's own series one sample per scrape, fires at its
    # `for:` (5 min) plus at most one scrape.
    fired = stuck_alert_fires_at([int(stuck) for _, _, stuck, _ in samples])
    assert fired is not None and 300 <= fired <= 315, fired
    history = daemon.history()
    assert [e["trigger"] for e in history if e["kind"] == "transition"][-1] == "switch"
    leak.unlink()  # the driver lets go
    daemon.wait_serving("profile", 60)
    (incident,) = [e for e in daemon.history() if "STUCK for" in e.get("what", "")]
    assert incident["retries"] >= 3
    assert daemon.status()["stuck"] is None and _state_metric(sandbox)["stuck_since"] == 0


def test_a_missing_vllm_binary_is_named_in_status_history_and_the_switch_that_failed(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """Before, status and history said only "the unit stopped during start (… exit status
    1)"; the cause was in the journal, and nothing pointed there."""
    vllm = sandbox.config.vllm.command[0]
    away = Path(f"{vllm}.away")
    daemon.start()
    daemon.wait_serving("production")
    os.rename(vllm, away)
    try:
        r = daemon.kimi_mode("profile")
        status = daemon.wait_state("failed", 90)
    finally:
        os.rename(away, vllm)
    said = f"cannot execute {vllm}: [Errno 2] No such file or directory"
    assert r.returncode == 1 and said in flat(r.stdout + r.stderr), r.stdout + r.stderr
    failure = status["last_failure"]
    assert any(said in line for line in failure["said"]), failure
    assert failure["more"] == str(sandbox.config.vllm.log_file)
    text = daemon.kimi_mode("status").stdout
    assert not too_wide(text), text  # wrapped, not cut
    shown = flat(text)
    assert f"vLLM said: kimi-supervisor launch-vllm: {said}" in shown, text
    assert f"all of vLLM's output: {failure['more']}" in shown, text
    assert f"| kimi-supervisor launch-vllm: {said}" in shown, text  # its last lines, too
    assert said in daemon.transitions()[-1]["message"]
    assert daemon.kimi_mode("production").returncode == 0
    assert daemon.wait_serving("production")["last_failure"] is None
