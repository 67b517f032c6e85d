"""Many hosts: the kimi.supervisor collection (ansible/) driven by ansible-playbook against three
sandboxes, each with its own systemd --user manager, daemon, simulated GPUs and fake vLLM, under
the local connection with a control socket per host. One fleet for the module; each test leaves
every host serving production."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.sandbox.sandbox import Sandbox
from kimi_supervisor.sandbox.usermanager import unavailable_reason

from ..conftest import DaemonHelper, SandboxHelper
from ..fleet import BIN, COLLECTION, Ansible, local_inventory

HOSTS = ("h1", "h2", "h3")


class Fleet:
    def __init__(self, work: Path, hosts: dict[str, DaemonHelper]) -> None:
        self.work = work
        self.hosts = hosts
        inventory = local_inventory(work / "hosts.ini", {h: d.socket for h, d in hosts.items()})
        self.ansible = Ansible(work, inventory)

    def pids(self) -> dict[str, int]:
        return {h: d.vllm_pid() for h, d in self.hosts.items()}

    def transitions_since(self, h: str, since: datetime) -> list[dict[str, Any]]:
        return [
            t for t in self.hosts[h].transitions()
            if datetime.fromisoformat(t["started_at"]) >= since
        ]  # fmt: skip

    def all_serve_production(self) -> None:
        for d in self.hosts.values():
            d.wait_serving("production", 60)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    why = unavailable_reason()
    if why:
        pytest.skip(f"no isolated systemd user manager here: {why}")
    work = Path(tempfile.mkdtemp(prefix="kimi-fleet-"))
    sandboxes: list[Sandbox] = []
    try:
        for h in HOSTS:
            sandboxes.append(Sandbox.up(work / h, gpus=2))
        hosts = {h: DaemonHelper(SandboxHelper(sb)) for h, sb in zip(HOSTS, sandboxes, strict=True)}
        f = Fleet(work, hosts)
        f.all_serve_production()
        yield f
    finally:
        for sb in sandboxes:
            sb.down()
        shutil.rmtree(work, ignore_errors=True)


def report(f: Fleet, h: str) -> dict[str, Any]:
    return json.loads((f.work / "captures" / f"{h}.json").read_text())  # type: ignore[no-any-return]


def test_a_rolling_capture_visits_the_hosts_one_at_a_time_and_brings_every_trace_home(
    fleet: Fleet,
) -> None:
    # The load balancer's hooks: task files of the operator's, here noting each call.
    lb = fleet.work / "lb.log"
    for hook in ("drain", "undrain"):
        (fleet.work / f"{hook}.yml").write_text(
            f"- name: {hook.capitalize()}\n  ansible.builtin.shell: echo {hook} "
            f"{{{{ inventory_hostname }}}} >> {lb}\n  delegate_to: localhost\n"
            "  changed_when: true\n"
        )
    start = datetime.now().astimezone()
    run = fleet.ansible.play(
        "rolling_capture", kimi_capture_seconds="1",
        kimi_drain_tasks=str(fleet.work / "drain.yml"),
        kimi_undrain_tasks=str(fleet.work / "undrain.yml"),
    )  # fmt: skip
    assert run.rc == 0, run.output[-4000:]
    assert run.failed() == set() and set(run.recap) == set(HOSTS)
    # Each host is drained before its switch and put back after its gate, one after another.
    assert lb.read_text().split("\n")[:-1] == [
        f"{x} {h}" for h in HOSTS for x in ("drain", "undrain")
    ]
    windows = []
    for h in HOSTS:
        rep = report(fleet, h)
        # The facts carry the switch's teardown report and load time, both ways.
        for step, mode in (("profile", "profile"), ("production", "production")):
            facts = rep[step]["ansible_facts"]["kimi_supervisor"]
            assert facts["mode"] == mode and facts["state"] == "serving"
            assert facts["teardown"]["outcome"] == "clean", facts
            assert facts["load_s"] > 0 and facts["transition"]["outcome"] == "ready"
        # The traces are on the controller, byte for byte the size the host reported.
        capture = rep["capture"]["capture"]
        home = Path(rep["capture"]["fetched_to"])
        assert home.parent == fleet.work / "captures" / h
        assert len(capture["files"]) == 5  # 2 ranks' traces and tables, the API server's trace
        for f in capture["files"]:
            assert (home / f["name"]).stat().st_size == f["bytes"]
        assert json.loads((home / "summary.json").read_text())["ranks"]
        # Exactly two switches on this host: to profile and back.
        (to_profile, back) = fleet.transitions_since(h, start)
        assert (to_profile["target"], back["target"]) == ("profile", "production")
        windows.append((h, to_profile["started_at"], back["finished_at"]))
    # One at a time: a host starts its profile switch only once the one before serves again.
    for (_h, _s, ended), (h, started, _e) in itertools.pairwise(windows):
        assert datetime.fromisoformat(started) > datetime.fromisoformat(ended), (h, windows)
    fleet.all_serve_production()


def test_a_host_whose_profile_mode_crashes_while_loading_stops_the_roll(fleet: Fleet) -> None:
    h2 = fleet.hosts["h2"]
    h2.h.fake(crash_during_load_at=50, load_faults_only_when_profiling=True)
    try:
        untouched = fleet.hosts["h3"].vllm_pid()
        start = datetime.now().astimezone()
        run = fleet.ansible.play("rolling_capture", kimi_capture_seconds="1")
        assert run.rc == 2, run.output[-4000:]  # ansible-playbook: a host failed
        # h1 was captured, h2 failed, h3 was never visited.
        assert run.failed() == {"h2"} and set(run.recap) == {"h1", "h2"}, run.recap
        assert report(fleet, "h1")["capture"]["outcome"] == "captured"
        # The failure carries the daemon's own words and what kimi-mode's exit code means.
        profile = report(fleet, "h2")["profile"]
        assert profile["outcome"] == "rolled_back" and profile["rc"] == 1
        assert "profile did not become ready" in profile["msg"]
        assert "simulated crash while loading at 50%" in profile["transition"]["output_tail"][-1]
        assert "(failed: the switch or capture did not succeed" in run.output
        assert "the hosts after it were not touched" in run.output
        # h2 went back to production (its rollback, then the play's recovery); h3 never moved.
        h2.wait_serving("production", 60)
        assert fleet.transitions_since("h3", start) == []
        assert fleet.hosts["h3"].vllm_pid() == untouched
        fleet.all_serve_production()
    finally:
        h2.h.fake()


SWITCH = """\
- name: Switch
  hosts: kimi
  gather_facts: false
  tasks:
    - name: Ask for a mode
      kimi.supervisor.kimi_mode:
        mode: "{{ want }}"
        socket: "{{ kimi_socket }}"
        executable: "{{ kimi_mode_executable }}"
"""


def test_the_module_changes_only_what_differs_and_check_mode_changes_nothing(
    fleet: Fleet,
) -> None:
    playbook = fleet.work / "switch.yml"
    playbook.write_text(SWITCH)
    before = fleet.pids()
    run = fleet.ansible.play(playbook, want="production")
    assert run.rc == 0 and run.changed() == dict.fromkeys(HOSTS, 0), run.output[-3000:]
    # Check mode with diff: says h1 would change and shows desired against actual; nothing moves.
    run = fleet.ansible.play(playbook, "--check", "--diff", "--limit", "h1", want="profile")
    assert run.rc == 0 and run.changed() == {"h1": 1}, run.output[-3000:]
    assert "-mode: production" in run.output and "+mode: profile" in run.output
    assert fleet.pids() == before
    fleet.hosts["h1"].wait_serving("production", 5)
    # A real switch changes; asking again does not.
    run = fleet.ansible.play(playbook, "--limit", "h1", want="profile")
    assert run.rc == 0 and run.changed() == {"h1": 1}, run.output[-3000:]
    fleet.hosts["h1"].wait_serving("profile", 5)
    run = fleet.ansible.play(playbook, "--limit", "h1", want="profile")
    assert run.rc == 0 and run.changed() == {"h1": 0}, run.output[-3000:]
    # Back to production, fleet-wide: only h1 moves, and a second run changes nothing.
    profiled = fleet.hosts["h1"].vllm_pid()
    run = fleet.ansible.play("back_to_production")
    assert run.rc == 0 and run.changed() == {"h1": 1, "h2": 0, "h3": 0}, run.output[-3000:]
    assert fleet.hosts["h1"].vllm_pid() != profiled
    assert {h: p for h, p in fleet.pids().items() if h != "h1"} == {
        h: p for h, p in before.items() if h != "h1"
    }
    run = fleet.ansible.play("back_to_production")
    assert run.rc == 0 and run.changed() == dict.fromkeys(HOSTS, 0), run.output[-3000:]


def test_a_host_whose_daemon_cannot_be_reached_fails_with_what_the_exit_code_means(
    fleet: Fleet,
) -> None:
    playbook = fleet.work / "switch.yml"
    playbook.write_text(SWITCH)
    away = str(fleet.work / "no-such" / "control.sock")
    run = fleet.ansible.play(playbook, "--limit", "h1", want="production", kimi_socket=away)
    assert run.rc == 2 and run.failed() == {"h1"}, run.output[-3000:]
    assert away in run.output  # kimi-mode's own message names the socket
    assert "the daemon is unreachable or refused the caller" in run.output
    # A request the module can tell is wrong never reaches the host's daemon.
    bad = fleet.work / "bad.yml"
    bad.write_text(SWITCH.replace('mode: "{{ want }}"', "mode: production\n        for: 2h"))
    run = fleet.ansible.play(bad, "--limit", "h1")
    assert run.rc == 2 and "`for` goes with mode=profile" in run.output, run.output[-3000:]
    fleet.all_serve_production()


def test_the_collection_passes_ansible_lint_and_its_module_documents_itself(tmp_path: Path) -> None:
    env = Ansible(tmp_path, tmp_path / "none").env
    r = subprocess.run([str(BIN / "ansible-lint"), "--nocolor"], cwd=COLLECTION, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Profile 'production' was required, and it passed" in r.stdout + r.stderr
    # Installed the way docs/fleet.md says, the module documents itself from there.
    cols = tmp_path / "collections"
    galaxy = [
        str(BIN / "ansible-galaxy"),
        "collection",
        "install",
        str(COLLECTION),
        "-p",
        str(cols),
    ]
    env["ANSIBLE_COLLECTIONS_PATH"] = str(cols)  # this checkout's ansible/ no longer
    r = subprocess.run(galaxy, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "kimi.supervisor:0.2.1 was installed" in r.stdout, r.stderr
    r = subprocess.run([str(BIN / "ansible-doc"), "kimi.supervisor.kimi_mode"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and "fetch_to" in r.stdout and "state" in r.stdout, r.stderr
    assert str(cols) in r.stdout  # the installed copy, not this checkout's
