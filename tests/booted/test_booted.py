"""The installed daemon under a booted systemd (PID 1) in a Debian 12 container, as on a real
host: `make install`, `systemctl enable --now`, switches, restart, reload, stop and reboot.
One host is booted for the whole module; the tests run in order and build on each other."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .host import BootedHost, Unavailable, unavailable

pytestmark = pytest.mark.booted

PYTHON = "/opt/kimi-supervisor/bin/python"  # the installed package's


@pytest.fixture(scope="module")
def host() -> Iterator[BootedHost]:
    why = unavailable()
    if why:
        pytest.skip(f"no booted host: {why}")
    work = Path(tempfile.mkdtemp(prefix="kimi-booted-"))
    h = BootedHost(work)
    try:
        try:
            h.prepare()
            h.boot()
        except Unavailable as e:
            pytest.skip(f"no booted host: {e}")
        yield h
    finally:
        h.poweroff()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def status(h: BootedHost) -> dict[str, Any]:
    r = h.sh("kimi-mode status --json", check=False)
    return json.loads(r.stdout) if r.returncode in (0, 1) and r.stdout.strip() else {}


def wait_serving(h: BootedHost, mode: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = status(h)
        if last.get("state") == "serving" and last.get("mode") == mode:
            return last
        time.sleep(0.2)
    journal = h.sh(
        "journalctl -b -u vllm-kimi-k25 --no-pager | grep -v Loading | tail -25; "
        "journalctl -b -u kimi-supervisor --no-pager -o cat | grep -E "
        "'transition_finished|start_failed|vllm_died|exiting|reconcile' | cut -c1-400 | tail -12",
        check=False,
    ).stdout
    raise AssertionError(
        f"not serving {mode} in {timeout_s:g} s: {last.get('status_line')}\n{journal}"
    )


def history(h: BootedHost, n: int = 200) -> list[dict[str, Any]]:
    out = h.sh(f"kimi-mode history -n {n} --json").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def vllm_pid(h: BootedHost) -> int:
    return int(h.sh("systemctl show -p MainPID --value vllm-kimi-k25").stdout.strip())


def test_enable_now_returns_before_the_driver_is_there_and_production_comes_up_with_it(
    host: BootedHost,
) -> None:
    """Issue 27: install first, driver later (a common provisioning order) hung `systemctl
    enable --now` for TimeoutStartSec (20 min) while status exited 0."""
    gpu = "/var/lib/kimi-sim/gpu"
    host.sh(f"mv {gpu}/host.json {gpu}/host.json.away")  # the driver is not loaded yet
    try:
        host.sh("systemctl enable --now kimi-supervisor", timeout=60)  # returns, not hangs
        assert host.sh("systemctl is-active kimi-supervisor").stdout.strip() == "active"
        r = host.sh("kimi-mode status", check=False)
        assert r.returncode == 1 and "waiting for the GPU driver" in r.stdout, r.stdout
        text = host.sh("systemctl show -p StatusText --value kimi-supervisor").stdout
        assert "waiting for the GPU driver" in text, text
    finally:
        host.sh(f"mv {gpu}/host.json.away {gpu}/host.json")  # the driver is loaded
    wait_serving(host, "production")
    assert host.sh("kimi-mode status", check=False).returncode == 0


def test_a_kimi_member_may_switch_others_not(host: BootedHost) -> None:
    host.sh("useradd -m -G kimi alice && useradd -m bob")
    r = host.sh("runuser -u alice -- kimi-mode profile", check=False, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_serving(host, "profile")
    r = host.sh("runuser -u bob -- kimi-mode production", check=False)
    assert r.returncode == 3 and "permission denied" in r.stderr, r.stderr
    assert status(host)["desired_mode"] == "profile"


def test_the_hardened_daemon_kills_a_ghost_and_hands_captures_to_a_member_in_tmp_and_home(
    host: BootedHost,
) -> None:
    ghost = host.sh(
        f"KIMI_SIM_GPU_DIR=/var/lib/kimi-sim/gpu {PYTHON} -m kimi_supervisor.sandbox.ghost "
        "--detach --gpu all --mib 3000 --title python"
    ).stdout.split()[1]
    r = host.sh("runuser -u alice -- kimi-mode production", check=False, timeout=120)
    assert r.returncode == 0 and f"killed PID {ghost} python" in r.stdout, r.stdout + r.stderr
    assert host.sh(f"test -d /proc/{ghost}", check=False).returncode != 0
    # The daemon's /tmp is private and /home read-only to it: the traces still land in the
    # directories alice opened, and are hers.
    host.sh("runuser -u alice -- mkdir /tmp/alice-traces /home/alice/traces")
    for out in ("/tmp/alice-traces", "/home/alice/traces"):
        r = host.sh(
            f"runuser -u alice -- kimi-mode capture --switch --seconds 0.5 --then stay --out {out}",
            check=False,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        traces = host.sh(f"find {out} -type f -user alice -name '*rank*'").stdout.split()
        assert len(traces) == 4, host.sh(f"ls -laR {out}").stdout
    wait_serving(host, "profile")


def test_vllms_output_reaches_the_journal_and_the_daemon_follows_its_progress(
    host: BootedHost,
) -> None:
    out = host.sh("journalctl -u vllm-kimi-k25 --no-pager -o cat").stdout
    assert "Loading safetensors checkpoint shards" in out
    daemon = host.sh("journalctl -u kimi-supervisor --no-pager -o cat").stdout
    assert '"vllm_progress"' in daemon and '"phase": "loading"' in daemon


def test_warnings_and_errors_reach_the_journal_at_their_priority(host: BootedHost) -> None:
    # vLLM's main process dies: the daemon warns (vllm_main_exited), logs an error (vllm_died)
    # and serves again; `journalctl -p warning` shows those and none of the info lines.
    host.sh(f"kill -9 {vllm_pid(host)}")
    wait_serving(host, "profile", 120)
    warned = host.sh("journalctl -u kimi-supervisor -p warning --no-pager -o cat").stdout
    assert '"event": "vllm_main_exited"' in warned and '"event": "vllm_died"' in warned, warned
    assert '"level": "info"' not in warned
    entry = json.loads(
        host.sh("journalctl -u kimi-supervisor -p err -o json -n 1 --no-pager").stdout
    )
    assert entry["PRIORITY"] == "3" and entry["MESSAGE"].startswith("{")  # the prefix is gone


def test_restart_of_the_daemon_keeps_vllm_and_runs_no_teardown(host: BootedHost) -> None:
    vllm, teardowns = vllm_pid(host), len([e for e in history(host) if e["kind"] == "teardown"])
    host.sh("systemctl restart kimi-supervisor")
    wait_serving(host, "profile")
    assert vllm_pid(host) == vllm
    assert len([e for e in history(host) if e["kind"] == "teardown"]) == teardowns


def test_reload_returns_with_the_new_daemon_answering(host: BootedHost) -> None:
    vllm = vllm_pid(host)
    host.sh("systemctl reload kimi-supervisor")
    assert host.sh("systemctl is-active kimi-supervisor").stdout.strip() == "active"
    wait_serving(host, "profile", 20)
    assert vllm_pid(host) == vllm


def test_a_reboot_stops_vllm_gracefully_and_the_desired_mode_serves_again(
    host: BootedHost,
) -> None:
    before = len(history(host))
    code = host.reboot()
    assert code == 133, code
    wait_serving(host, "profile", 90)
    shutdown = [
        e for e in history(host)[before:] if e["kind"] == "teardown"
    ]  # the teardowns since: the one at shutdown, the one at boot
    killed = [k for e in shutdown for k in e["kills"] if k["signal"] == "SIGKILL"]
    assert not killed, killed
    notes = " ".join(s["note"] for e in shutdown for s in e["steps"])
    assert "systemd:" not in notes, notes  # no lost bus


def test_stop_tears_down_to_clean_with_vllm_exiting_on_its_own(host: BootedHost) -> None:
    host.sh("systemctl stop kimi-supervisor", timeout=120)
    assert host.sh("systemctl is-active vllm-kimi-k25", check=False).stdout.strip() == "inactive"
    line = host.sh('grep \'"kind": "teardown"\' /var/lib/kimi-supervisor/history.jsonl | tail -1')
    last = json.loads(line.stdout)
    assert last["outcome"] == "clean" and last["reason"] == "the supervisor is stopping"
    assert not [k for k in last["kills"] if k["signal"] == "SIGKILL"], last["kills"]
    stop = next(s for s in last["steps"] if s["step"] == "stop_unit")
    assert stop["note"] == "unit stopped", stop
