"""The Debian package under a booted systemd (PID 1) in a Debian 12 container, as on a real host:
`apt install` with no package index and no compiler, `systemctl enable --now`, switches,
restart, reload, reboot, an upgrade (and a broken one), stop, `apt remove`, a reinstall and
`apt purge`. One host is booted for the whole module; the tests run in order and build on each
other."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import debs

from .host import APT, CONFIGURE, PACKAGE_PYTHON, BootedHost, Unavailable, unavailable

pytestmark = pytest.mark.booted

PYTHON = PACKAGE_PYTHON
BROKEN = "0.1.0-3"  # a build whose daemon cannot import (kimi_supervisor/loop/daemon.py)
# What a listing of the host's files leaves out: the kernel's file systems, and /run/user.
LIST_FILES = (
    "find / -xdev \\( -path /proc -o -path /sys -o -path /dev -o -path /run/user \\) -prune "
    "-o -print 2>/dev/null; find /run -xdev -path /run/user -prune -o -print 2>/dev/null"
)


@pytest.fixture(scope="module")
def host(debian_package: Path, debian_package_2: Path) -> Iterator[BootedHost]:
    why = unavailable()
    if why:
        pytest.skip(f"no booted host: {why}")
    work = Path(tempfile.mkdtemp(prefix="kimi-booted-"))
    broken = debs.repack(
        debian_package_2, BROKEN, work,
        lambda tree: debs.break_module(tree, BROKEN, "kimi_supervisor/loop/daemon"),
    )  # fmt: skip
    h = BootedHost(work)
    try:
        try:
            h.prepare(debs=(debian_package, debian_package_2, broken))
            h.boot()
        except Unavailable as e:
            pytest.skip(f"no booted host: {e}")
        yield h
    finally:
        h.poweroff()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def files(h: BootedHost) -> set[str]:
    return set(h.sh(LIST_FILES, check=False).stdout.splitlines())


BEFORE: dict[str, set[str]] = {}  # the host's files before the package, for the purge test


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


def test_apt_install_needs_no_index_nor_compiler_and_enables_the_daemon_alone(
    host: BootedHost, debian_package: Path
) -> None:
    BEFORE["files"] = files(host)
    enabled = host.sh("systemctl list-unit-files --state=enabled --no-legend").stdout.split("\n")
    packages = host.sh("dpkg-query -W -f '${Package}\\n'").stdout.split()
    r = host.install_package(debian_package.name)
    # Nothing was fetched (there is no index) and nothing else was installed: no compiler.
    assert host.sh("dpkg-query -W -f '${Package}\\n'").stdout.split() == sorted(
        [*packages, "kimi-supervisor"]
    ), r.stdout
    assert host.sh("command -v cc gcc make pip3", check=False).stdout == ""
    now = host.sh("systemctl list-unit-files --state=enabled --no-legend").stdout.split("\n")
    assert [u.split()[0] for u in set(now) - set(enabled)] == ["kimi-supervisor.service"], now
    # Enabled, not started: the shipped config names a vLLM that is not installed here.
    assert host.sh("systemctl is-active kimi-supervisor", check=False).stdout.strip() == "inactive"
    assert "enabled, not started: vllm.command[0] /opt/vllm/bin/vllm" in r.stdout, r.stdout
    assert host.sh("getent group kimi", check=False).returncode == 0
    assert host.sh("stat -c '%a %U' /var/lib/kimi-supervisor").stdout.split() == ["751", "root"]
    # vLLM's own user, which owns nothing else and cannot log in.
    vllm = host.sh("getent passwd kimi-vllm").stdout.strip().split(":")
    assert vllm[5:] == ["/var/lib/kimi-vllm", "/usr/sbin/nologin"], vllm
    assert host.sh("kimi-supervisor --version").returncode == 0
    host.sh(" ".join(CONFIGURE))  # the simulated GPUs, the fake vLLM and their config


def test_enable_now_returns_before_the_driver_is_there_and_production_comes_up_with_it(
    host: BootedHost,
) -> None:
    """Before, install first, driver later (a common provisioning order) hung `systemctl
    enable --now` for TimeoutStartSec (20 min) while status exited 0."""
    gpu = "/var/lib/kimi-sim/gpu"
    host.sh(f"mv {gpu}/host.json {gpu}/host.json.away")  # the driver is not loaded yet
    try:
        host.sh("systemctl enable --now kimi-supervisor", timeout=60)  # returns, not hangs
        assert host.sh("systemctl is-active kimi-supervisor").stdout.strip() == "active"
        # READY=1 comes before the daemon's first look for the driver (Daemon.boot), which asks
        # NVML through a process of its own: until that answers, status says "booting" (seen
        # in CI at "up 0s"). The look comes within seconds, and then says why it waits.
        deadline, r = time.monotonic() + 30, host.sh("kimi-mode status", check=False)
        while "waiting for the GPU driver" not in r.stdout and time.monotonic() < deadline:
            time.sleep(0.2)
            r = host.sh("kimi-mode status", check=False)
        assert r.returncode == 1 and "waiting for the GPU driver" in r.stdout, r.stdout
        text = host.sh("systemctl show -p StatusText --value kimi-supervisor").stdout
        assert "waiting for the GPU driver" in text, text
    finally:
        host.sh(f"mv {gpu}/host.json.away {gpu}/host.json")  # the driver is loaded
        wait_serving(host, "production")  # the next tests start from production, whatever failed
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


def proc_ids(h: BootedHost, pid: int) -> tuple[int, set[int]]:
    """A process's filesystem uid (what owns the files it makes) and its groups."""
    status = dict(
        line.split(":", 1) for line in h.sh(f"cat /proc/{pid}/status").stdout.splitlines()
    )
    return int(status["Uid"].split()[3]), {int(g) for g in status["Groups"].split()}


def test_vllm_runs_as_its_own_user_on_its_gpus_and_a_switch_takes_its_leftovers_not_roots(
    host: BootedHost,
) -> None:
    """Before, the shipped unit ran vLLM as root, so "vLLM's user" was every root program and
    a switch removed their unopened `psm_*` and `sem.mp-*` files made since vLLM's start."""
    wait_serving(host, "profile")
    vllm_uid = int(host.sh("id -u kimi-vllm").stdout)
    video = int(host.sh("getent group video | cut -d: -f3").stdout)
    # Every process of the unit runs as vLLM's user, with the video group for the GPUs' files.
    listed = host.sh("grep -l '/vllm-kimi-k25.service$' /proc/[0-9]*/cgroup", check=False)
    tree = [int(p.split("/")[2]) for p in listed.stdout.split()]
    assert len(tree) >= 6, tree  # the API server, its engine, 4 workers (and a tracker)
    for pid in tree:
        uid, groups = proc_ids(host, pid)
        assert uid == vllm_uid and video in groups, (pid, uid, groups)
    # It reached its GPUs (0660 root:video here): each worker made a context, as its user.
    alloc = host.sh("stat -c %u /var/lib/kimi-sim/gpu/alloc/*").stdout.split()
    assert alloc == [str(vllm_uid)] * 4, alloc
    gpus = status(host)["gpus"]
    assert all(g["used_mib"] > g["baseline_mib"] for g in gpus), gpus
    # It serves: the daemon said so (/health 200); and it answers a request of its API.
    port = host.sh(
        f'{PYTHON} -c "import tomllib; print(tomllib.load(open('
        f"'/etc/kimi-supervisor/kimi-supervisor.toml', 'rb'))['vllm']['port'])\""
    ).stdout.strip()
    models = host.sh(
        f'{PYTHON} -c "import urllib.request as u; '
        f"print(u.urlopen('http://127.0.0.1:{port}/v1/models', timeout=5).status)\""
    )
    assert models.stdout.strip() == "200", models.stdout + models.stderr
    # Its folders are its own; the launch record, which it cannot forge, root's.
    for d, mode in (
        ("/var/cache/kimi-supervisor/vllm", "700"),
        ("/var/lib/kimi-supervisor/traces", "700"),
        ("/var/lib/kimi-vllm", "700"),
    ):
        assert host.sh(f"stat -c '%a %U' {d}").stdout.split() == [mode, "kimi-vllm"], d
    journal = host.sh("journalctl -b -u vllm-kimi-k25 --no-pager -o cat").stdout
    assert "not using the cache" not in journal, journal[-2000:]
    record = json.loads(host.sh("cat /run/kimi-supervisor/vllm-launched.json").stdout)
    assert record["pid"] == vllm_pid(host) and record["mode"] == "profile", record
    assert host.sh("stat -c %U /run/kimi-supervisor/vllm-launched.json").stdout.strip() == "root"

    # Files the leftovers step may see, all made after vLLM's unit started, none of them open:
    # root programs' look-alikes, and vLLM's user's own (as a SIGKILLed vLLM leaves them).
    roots = ["/dev/shm/psm_b00t0001", "/dev/shm/sem.mp-b00t0001", "/dev/shm/vllm-root-cache"]
    vllms = ["/dev/shm/psm_b00t0002", "/dev/shm/sem.mp-b00t0002", "/dev/shm/nccl-b00t0002"]
    bystander = int(host.sh("setsid sleep 900 >/dev/null 2>&1 < /dev/null & echo $!").stdout)
    try:
        host.sh(f"touch {' '.join(roots)}")
        host.sh(f"runuser -u kimi-vllm -- touch {' '.join(vllms)}")
        r = host.sh("kimi-mode production", check=False, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_serving(host, "production")
        for path in roots:
            assert host.sh(f"stat -c %U {path}").stdout.strip() == "root", path
        for path in vllms:
            assert host.sh(f"test -e {path}", check=False).returncode != 0, f"{path} was kept"
        teardown = [e for e in history(host) if e["kind"] == "teardown"][-1]
        assert set(vllms) <= set(teardown["shm_removed"]), teardown["shm_removed"]
        assert not set(roots) & set(teardown["shm_removed"]), teardown["shm_removed"]
        kept = host.sh(
            "journalctl -u kimi-supervisor KIMI_EVENT=leftover_not_removed --no-pager -o cat"
        ).stdout
        for path in roots:
            assert f"{path}" in kept, kept[-2000:]
        assert f"owned by uid 0, not vLLM's user ({vllm_uid})" in kept, kept[-2000:]
        assert host.sh(f"test -d /proc/{bystander}", check=False).returncode == 0
    finally:
        host.sh(f"kill {bystander}", check=False)  # the bystander this test started, alone
        host.sh(f"rm -rf {' '.join(roots + vllms)}", check=False)
    r = host.sh("kimi-mode profile", check=False, timeout=120)  # as the next tests expect
    assert r.returncode == 0, r.stdout + r.stderr
    wait_serving(host, "profile")


def test_vllms_output_reaches_the_journal_and_the_daemon_follows_its_progress(
    host: BootedHost,
) -> None:
    out = host.sh("journalctl -u vllm-kimi-k25 --no-pager -o cat").stdout
    assert "Loading safetensors checkpoint shards" in out
    daemon = host.sh("journalctl -u kimi-supervisor --no-pager -o cat").stdout
    assert "vllm_progress phase=loading" in daemon  # a readable line, the fields beside it


def test_warnings_and_errors_reach_the_journal_at_their_priority(host: BootedHost) -> None:
    # vLLM's main process dies: the daemon warns (vllm_main_exited), logs an error (vllm_died)
    # and serves again; `journalctl -p warning` shows those and none of the info lines.
    killed = vllm_pid(host)
    host.sh(f"kill -9 {killed}")
    # Until the daemon notices, its status still says serving: wait for the new vLLM first.
    deadline = time.monotonic() + 120
    while vllm_pid(host) in (0, killed) and time.monotonic() < deadline:
        time.sleep(0.2)
    wait_serving(host, "profile", 120)
    warned = host.sh("journalctl -u kimi-supervisor -p warning --no-pager -o cat").stdout
    assert "vllm_main_exited main_pid=" in warned and "vllm_died" in warned, warned
    assert "state_changed" not in warned  # info lines are not warnings
    entry = json.loads(
        host.sh("journalctl -u kimi-supervisor -p err -o json -n 1 --no-pager").stdout
    )
    assert entry["PRIORITY"] == "3" and not entry["MESSAGE"].startswith("{")  # no braces


def test_journal_entries_carry_fields_an_operator_filters_on(host: BootedHost) -> None:
    """Before, MESSAGE held a JSON blob and no field, so `journalctl KIMI_EVENT=...` found
    nothing."""
    died = host.sh(
        "journalctl -u kimi-supervisor KIMI_EVENT=vllm_main_exited -o json --no-pager"
    ).stdout.splitlines()
    assert died, "no entry with KIMI_EVENT=vllm_main_exited"
    entry = json.loads(died[-1])
    assert entry["KIMI_PID"].isdigit() and entry["PRIORITY"] == "4"
    assert entry["_SYSTEMD_UNIT"] == "kimi-supervisor.service"
    assert entry["SYSLOG_IDENTIFIER"] == "kimi-supervisor"
    states = host.sh(
        "journalctl -u kimi-supervisor KIMI_EVENT=state_changed KIMI_STATE=serving -o json "
        "--no-pager"
    ).stdout.splitlines()
    assert states and json.loads(states[-1])["MESSAGE"].startswith("state_changed previous=")
    switched = host.sh(
        "journalctl -u kimi-supervisor KIMI_MODE=profile -o json --no-pager"
    ).stdout.splitlines()
    assert any(json.loads(x).get("KIMI_TRANSITION", "").startswith("t-") for x in switched)


def test_doctor_passes_on_the_healthy_host_and_fails_on_each_broken_precondition(
    host: BootedHost,
) -> None:
    """The real system manager, bus and package: each precondition broken on the host itself,
    then put back, and the rest through copies of the installed config (the sandbox's tests
    show the system bus and a taken metrics port failing too)."""
    r = host.sh("kimi-mode doctor", check=False)
    assert r.returncode == 0, r.stdout
    assert r.stdout.splitlines()[-1].startswith("every check passed"), r.stdout
    assert "runs vLLM as kimi-vllm (uid " in " ".join(r.stdout.split()), r.stdout  # wrapped

    def failing(check: str, says: str, options: str = "") -> None:
        r = host.sh(f"kimi-mode doctor -o json {options}", check=False)
        report = json.loads(r.stdout)
        bad = {c["name"]: c for c in report["checks"] if c["ok"] is False}
        assert r.returncode == 1 and check in bad, r.stdout
        assert says in bad[check]["message"] and bad[check]["fix"], bad[check]

    gpu = "/var/lib/kimi-sim/gpu"
    unit = "/lib/systemd/system/vllm-kimi-k25.service"
    cases = [  # (break it, put it back, the check that fails, what it says)
        ("chmod -x /usr/local/bin/vllm", "chmod +x /usr/local/bin/vllm",
         "vllm executable", "is not executable"),
        ("groupmod -n kimi-away kimi", "groupmod -n kimi kimi-away",
         "control group", "'kimi' does not exist"),
        (f"mv {gpu}/host.json {gpu}/host.json.away", f"mv {gpu}/host.json.away {gpu}/host.json",
         "GPU driver", "NVML does not answer"),  # the driver unloaded
        (f"mv {unit} /root/ && systemctl daemon-reload",
         f"mv /root/vllm-kimi-k25.service {unit} && systemctl daemon-reload",
         "vLLM's unit", "vllm-kimi-k25.service is "),
    ]  # fmt: skip
    for breaks, restores, check, says in cases:
        host.sh(breaks)
        try:
            failing(check, says)
        finally:
            host.sh(restores)
    # What a config names and this host lacks, through copies of the installed config.
    conf = "/etc/kimi-supervisor/kimi-supervisor.toml"
    copies = [  # (an edit of the copy, doctor's extra options, the check that fails, its words)
        ('s|^dir = "/var/lib/kimi-supervisor"$|dir = "/root/empty-state"|', "",
         "baseline", "no baseline stored"),
        ("s|^managed = \\[\\]$|managed = [0, 1, 2, 3, 9]|", "",
         "managed GPUs", "names GPU(s) [9]"),
        ("", "--socket /run/no-daemon.sock", "daemon", "not running"),
        ("$ a [gpus]", "", "config", "not valid TOML"),
    ]  # fmt: skip
    for i, (edit, more, check, says) in enumerate(copies):
        copy = f"/root/doctor-{i}.toml"
        host.sh(f"sed -e '{edit}' {conf} > {copy}" if edit else f"cp {conf} {copy}")
        try:
            failing(check, says, f"--config {copy} {more}")
        finally:
            host.sh(f"rm -f {copy}")  # the purge test lists every file left on the host
    wait_serving(host, "profile")
    assert host.sh("kimi-mode doctor", check=False).returncode == 0


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


def daemon_started(h: BootedHost) -> str:
    return str(status(h)["daemon"]["started_at"])


def current(h: BootedHost) -> str:
    return h.sh("readlink /usr/lib/kimi-supervisor/current").stdout.strip()


def test_an_upgrade_switches_to_the_new_version_while_vllm_keeps_serving(
    host: BootedHost, debian_package: Path, debian_package_2: Path
) -> None:
    conf = "/etc/kimi-supervisor/kimi-supervisor.toml"
    edited = host.sh(f"cat {conf}").stdout  # configure.py's: an admin's edit
    vllm, started = vllm_pid(host), daemon_started(host)
    daemon = host.sh("systemctl show -p MainPID --value kimi-supervisor").stdout
    r = host.install_package(debian_package_2.name)
    assert "the daemon runs the new version; vLLM kept serving" in r.stdout, r.stdout
    assert current(host) == "0.1.0-2"
    # The old version's directory is gone, and nothing of it is left behind.
    assert host.sh("ls /usr/lib/kimi-supervisor").stdout.split() == ["0.1.0-2", "current"]
    assert "A newer release." in host.sh("cat /usr/share/doc/kimi-supervisor/README.md").stdout
    wait_serving(host, "profile", 30)
    assert vllm_pid(host) == vllm  # never reloaded: vLLM kept serving
    # Re-executed in place (same PID, a new start) into the new code.
    assert host.sh("systemctl show -p MainPID --value kimi-supervisor").stdout == daemon
    assert daemon_started(host) != started
    exe = host.sh(f"tr '\\0' ' ' < /proc/{daemon.strip()}/cmdline").stdout
    assert exe.startswith("/usr/lib/kimi-supervisor/current/bin/python3 /usr/bin/kimi-supervisor")
    # The admin's config is kept; the new default lies beside it.
    assert host.sh(f"cat {conf}").stdout == edited
    assert "# A newer default." in host.sh(f"cat {conf}.dpkg-dist").stdout


def test_a_broken_upgrade_fails_saying_so_and_the_old_daemon_runs_on_and_answers(
    host: BootedHost, debian_package_2: Path
) -> None:
    vllm, started = vllm_pid(host), daemon_started(host)
    r = host.install_package(f"kimi-supervisor_{BROKEN}_amd64.deb", check=False)
    assert r.returncode != 0, r.stdout
    assert "the new version did not take over" in r.stdout, r.stdout
    assert "kimi_supervisor.loop.daemon does not import" in host.sh(
        "journalctl -u kimi-supervisor -n 20 --no-pager -o cat").stdout  # fmt: skip
    # The old image still runs, answers and serves; vLLM was never touched.
    assert host.sh("systemctl is-active kimi-supervisor").stdout.strip() == "active"
    assert wait_serving(host, "profile", 5)["daemon"]["started_at"] == started
    assert vllm_pid(host) == vllm
    # The admin goes back to the build that worked: the daemon takes it up, vLLM serves on.
    r = host.install_package(debian_package_2.name, "--allow-downgrades")
    assert "the daemon runs the new version" in r.stdout, r.stdout
    assert current(host) == "0.1.0-2"
    assert host.sh("ls /usr/lib/kimi-supervisor").stdout.split() == ["0.1.0-2", "current"]
    assert wait_serving(host, "profile", 30)["daemon"]["started_at"] != started
    assert vllm_pid(host) == vllm


def test_where_policy_rc_d_forbids_it_the_upgrade_says_the_old_daemon_runs_on(
    host: BootedHost, debian_package_2: Path
) -> None:
    started = daemon_started(host)
    policy = "/usr/sbin/policy-rc.d"  # as an image build has it: no service may be touched
    host.sh(f"printf '#!/bin/sh\\nexit 101\\n' > {policy} && chmod 755 {policy}")
    try:
        r = host.install_package(debian_package_2.name, "--reinstall")
    finally:
        host.sh(f"rm -f {policy}")
    assert "policy-rc.d forbids reloading the daemon: it still runs the previous" in r.stdout
    assert "the daemon runs the new version" not in r.stdout, r.stdout
    assert daemon_started(host) == started  # as the message says: not re-executed


def test_stop_tears_down_to_clean_with_vllm_exiting_on_its_own(host: BootedHost) -> None:
    host.sh("systemctl stop kimi-supervisor", timeout=120)
    assert host.sh("systemctl is-active vllm-kimi-k25", check=False).stdout.strip() == "inactive"
    line = host.sh('grep \'"kind": "teardown"\' /var/lib/kimi-supervisor/history.jsonl | tail -1')
    last = json.loads(line.stdout)
    assert last["outcome"] == "clean" and last["reason"] == "the supervisor is stopping"
    assert not [k for k in last["kills"] if k["signal"] == "SIGKILL"], last["kills"]
    stop = next(s for s in last["steps"] if s["step"] == "stop_unit")
    assert stop["note"] == "unit stopped", stop


def test_apt_remove_tears_vllm_down_and_keeps_the_config_and_state(host: BootedHost) -> None:
    host.sh("systemctl start kimi-supervisor")
    wait_serving(host, "profile", 60)
    vllm = vllm_pid(host)
    host.sh(f"{APT} remove kimi-supervisor", timeout=300)
    assert host.sh(f"test -d /proc/{vllm}", check=False).returncode != 0
    assert host.sh("systemctl is-active vllm-kimi-k25", check=False).stdout.strip() != "active"
    line = host.sh('grep \'"kind": "teardown"\' /var/lib/kimi-supervisor/history.jsonl | tail -1')
    last = json.loads(line.stdout)
    assert last["outcome"] == "clean" and last["reason"] == "the supervisor is stopping"
    assert host.sh("dpkg-query -W -f '${Status}' kimi-supervisor").stdout == (
        "deinstall ok config-files"
    )
    for kept in (
        "/etc/kimi-supervisor/kimi-supervisor.toml",
        "/var/lib/kimi-supervisor/state.json",
    ):
        assert host.sh(f"test -f {kept}", check=False).returncode == 0, kept
    assert host.sh("test -e /usr/lib/kimi-supervisor", check=False).returncode != 0
    assert host.sh("command -v kimi-mode", check=False).returncode != 0


def test_reinstalling_on_a_configured_host_starts_the_daemon_and_it_serves_again(
    host: BootedHost, debian_package_2: Path
) -> None:
    r = host.install_package(debian_package_2.name)
    assert "kimi-supervisor: started" in r.stdout and "not started" not in r.stdout, r.stdout
    wait_serving(host, "profile", 60)  # the desired mode, kept in the state


def test_apt_purge_keeps_the_incident_bundles_says_so_and_leaves_nothing_else(
    host: BootedHost,
) -> None:
    """The incident bundles are an operator's evidence, as the captures are: a purge kept the
    captures and said so, and deleted the bundles without a word."""
    incidents = "/var/lib/kimi-supervisor/incidents"
    bundle = f"{incidents}/incident-20261204T180123.620132Z-stuck.txt"
    host.sh(f"install -d -m 0700 {incidents} && echo 'trigger:   stuck' > {bundle}")
    said = host.sh(f"{APT} purge kimi-supervisor", timeout=300).stdout
    assert f"KEPT the incident bundles in {incidents}" in said, said
    assert "KIMI_SUPERVISOR_PURGE_INCIDENTS=yes" in said, said
    assert host.sh(f"cat {bundle}").stdout == "trigger:   stuck\n"
    assert host.sh("ls -A /var/lib/kimi-supervisor").stdout.split() == ["incidents"]
    host.sh("rm -rf /var/lib/kimi-supervisor")  # as the purge said to
    assert host.sh("dpkg-query -W kimi-supervisor", check=False).returncode != 0
    assert host.sh("getent group kimi", check=False).returncode != 0
    new = files(host) - BEFORE["files"]
    left = sorted(
        p for p in new
        if not p.startswith(PLANTED) and ("kimi-supervisor" in p or not p.startswith(SYSTEM))
    )  # fmt: skip
    assert left == [], left


def test_a_kimi_group_the_admin_made_before_the_package_survives_its_purge(
    host: BootedHost, debian_package_2: Path
) -> None:
    host.sh("groupadd --system kimi && useradd -M -G kimi carol")
    try:
        host.install_package(debian_package_2.name)
        host.sh(f"{APT} purge kimi-supervisor", timeout=300)
        assert host.sh("id -nG carol").stdout.split() == ["carol", "kimi"]  # untouched
    finally:
        host.sh("userdel carol; groupdel kimi", check=False)


# New files that are not the package's. What the tests planted: the simulated GPUs, the fake
# vLLM and its config's drop-ins (configure.py), the users alice and bob and their files.
PLANTED = (
    "/var/lib/kimi-sim", "/usr/local/bin/vllm", "/etc/systemd/system/kimi-supervisor.service.d",
    "/etc/systemd/system/vllm-kimi-k25.service.d", "/home/alice", "/home/bob", "/tmp/alice-traces",
)  # fmt: skip
# What the system writes: the journal, apt's and dpkg's logs and state, systemd's runtime state,
# temporary files, the user database's backups. A path there that names kimi-supervisor is
# still the package's, and reported.
SYSTEM = (
    "/tmp/", "/var/tmp/", "/var/log/", "/var/cache/", "/var/lib/apt/", "/var/lib/dpkg/",
    "/var/lib/systemd/", "/var/mail/", "/etc/passwd-", "/etc/group-", "/etc/shadow-",
    "/etc/gshadow-", "/etc/subuid", "/etc/subgid", "/etc/.pwd.lock", "/run/",
)  # fmt: skip
