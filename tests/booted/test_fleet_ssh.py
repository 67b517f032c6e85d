"""Two booted Debian 12 hosts driven over SSH on the loopback address, as a controller drives a
fleet: the collection's install playbook installs the Debian package on bare hosts (no
compiler, no package index) and upgrades it later while vLLM keeps serving, then a rolling
capture visits both and brings the traces home over SSH, and one variable opens the metrics to
the fleet's Prometheus. The hosts share this machine's network, so each has its own sshd, vLLM
and metrics ports. The tests run in order and build on each other."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..fleet import Ansible, Played
from .host import BootedHost, Unavailable, unavailable
from .test_booted import status, vllm_pid, wait_serving

pytestmark = pytest.mark.booted

NAMES = ("b1", "b2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SshFleet:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.hosts: dict[str, BootedHost] = {}
        self.ports = {h: (_free_port(), _free_port(), _free_port()) for h in NAMES}
        self.key = work / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)],
                       check=True, capture_output=True)  # fmt: skip
        inventory = work / "hosts.ini"
        inventory.write_text(
            "[kimi]\n"
            + "".join(f"{h} ansible_port={p[0]}\n" for h, p in self.ports.items())
            + "\n[kimi:vars]\nansible_host=127.0.0.1\nansible_user=root\n"
            f"ansible_ssh_private_key_file={self.key}\n"
            "ansible_ssh_common_args='-o StrictHostKeyChecking=no"
            " -o UserKnownHostsFile=/dev/null'\n"
            "ansible_python_interpreter=/usr/bin/python3\n"
        )
        self.ansible = Ansible(work, inventory)
        # One connection per task, none left behind when a playbook ends (no ControlPersist).
        self.ansible.env |= {"ANSIBLE_SSH_ARGS": "", "ANSIBLE_PIPELINING": "1"}

    def install(self, deb: Path, enable: bool, scrapers: tuple[str, ...] = ()) -> Played:
        extra = json.dumps({"kimi_metrics_scrapers": list(scrapers)})
        return self.ansible.play(
            "install", "-e", extra, timeout_s=900, kimi_deb=str(deb), kimi_enable=str(enable)
        )


@pytest.fixture(scope="module")
def fleet() -> Iterator[SshFleet]:
    why = unavailable()
    if why:
        pytest.skip(f"no booted host: {why}")
    if shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh-keygen (the set-up installs openssh-client)")
    work = Path(tempfile.mkdtemp(prefix="kimi-sshfleet-"))
    f = SshFleet(work)
    try:
        pub = (work / "id_ed25519.pub").read_text()
        for h in NAMES:
            (work / h).mkdir()
            host = BootedHost(work / h)
            f.hosts[h] = host
            try:
                host.prepare(ssh=(f.ports[h][0], pub))
                host.boot()
            except Unavailable as e:
                pytest.skip(f"no booted host: {e}")
        yield f
    finally:
        for host in f.hosts.values():
            host.poweroff()
        shutil.rmtree(work, ignore_errors=True)


def test_the_install_playbook_installs_the_package_on_bare_hosts_over_ssh(
    fleet: SshFleet, debian_package: Path
) -> None:
    run = fleet.install(debian_package, enable=False)
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    assert set(run.recap) == set(NAMES)
    for h, host in fleet.hosts.items():
        assert "kimi-mode" in host.sh("kimi-mode --version").stdout
        assert host.sh("command -v gcc cc", check=False).stdout == ""  # none came with it
        # The package enables the daemon; unconfigured, it is not started.
        assert host.sh("systemctl is-enabled kimi-supervisor").stdout.strip() == "enabled"
        assert host.sh("systemctl is-active kimi-supervisor", check=False).stdout.strip() == (
            "inactive"
        )
        vllm_port, metrics_port = fleet.ports[h][1:]
        host.configure(vllm_port, metrics_port)  # the simulated GPUs and the fake vLLM
    # Again, enabling: nothing is reinstalled, and the play waits until both serve.
    run = fleet.install(debian_package, enable=True)
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    task = run.output.split("Install or upgrade the package]")[1].split("TASK")[0]
    assert "skipping: [b1]" in task and "skipping: [b2]" in task, task
    for host in fleet.hosts.values():
        assert wait_serving(host, "production", 5)["mode"] == "production"


def test_a_rolling_capture_over_ssh_brings_both_hosts_traces_home(fleet: SshFleet) -> None:
    run = fleet.ansible.play("rolling_capture", timeout_s=600, kimi_capture_seconds="1")
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    for h in NAMES:
        rep = json.loads((fleet.work / "captures" / f"{h}.json").read_text())
        facts = rep["production"]["ansible_facts"]["kimi_supervisor"]
        assert facts["mode"] == "production" and facts["teardown"]["outcome"] == "clean"
        home = Path(rep["capture"]["fetched_to"])
        files = rep["capture"]["capture"]["files"]
        assert len(files) >= 3 and home.parent == fleet.work / "captures" / h
        for f in files:  # copied over SSH, byte for byte the size the host reported
            assert (home / f["name"]).stat().st_size == f["bytes"]
    run = fleet.ansible.play("back_to_production")
    assert run.rc == 0 and run.changed() == dict.fromkeys(NAMES, 0), run.output[-3000:]


def test_an_upgrade_installs_the_new_package_and_the_daemon_takes_it_up_while_vllm_serves(
    fleet: SshFleet, debian_package_2: Path
) -> None:
    before = {h: vllm_pid(host) for h, host in fleet.hosts.items()}
    daemons = {h: host.sh("systemctl show -p MainPID --value kimi-supervisor").stdout.strip()
               for h, host in fleet.hosts.items()}  # fmt: skip
    started = {h: status(host)["daemon"]["started_at"] for h, host in fleet.hosts.items()}
    run = fleet.install(debian_package_2, enable=True)
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    for h, host in fleet.hosts.items():
        readme = host.sh("cat /usr/share/doc/kimi-supervisor/README.md").stdout
        assert "A newer release." in readme
        assert wait_serving(host, "production", 30)["daemon"]["started_at"] != started[h]
        assert vllm_pid(host) == before[h]  # never reloaded: vLLM kept serving
        # `systemctl reload` re-executes the daemon in place: same PID, new code.
        main = host.sh("systemctl show -p MainPID --value kimi-supervisor").stdout.strip()
        assert main == daemons[h]


def _scrape(address: str, port: int) -> bool:
    """Whether the metrics answer at address:port within 3 s (a dropped packet does not)."""
    try:
        with socket.create_connection((address, port), timeout=3) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            status = sock.recv(64).split(b"\r\n", 1)[0].split()
            return status[:1] in ([b"HTTP/1.0"], [b"HTTP/1.1"]) and status[1:2] == [b"200"]
    except OSError:
        return False


def _own_address() -> str | None:
    """This machine's first IPv4 address that is not loopback: traffic to it stays on this
    machine, but the hosts' units see it as a remote address, as a fleet's Prometheus would be."""
    r = subprocess.run(["hostname", "-I"], capture_output=True, text=True)
    v4 = [a for a in r.stdout.split() if "." in a and not a.startswith("127.")]
    return v4[0] if v4 else None


def test_one_variable_opens_the_metrics_to_the_fleets_prometheus_and_closes_them(
    fleet: SshFleet, debian_package_2: Path
) -> None:
    prometheus = _own_address()
    if prometheus is None:
        pytest.skip("this machine has no address but loopback")
    host = fleet.hosts["b1"]
    port = fleet.ports["b1"][2]
    vllm = vllm_pid(host)
    assert _scrape("127.0.0.1", port) and not _scrape(prometheus, port)  # as shipped
    run = fleet.install(debian_package_2, enable=True, scrapers=(f"{prometheus}/32",))
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    assert _scrape(prometheus, port)
    allow = host.sh("systemctl show -p IPAddressAllow --value kimi-supervisor").stdout
    assert prometheus in allow, allow
    assert vllm_pid(host) == vllm  # the restart adopted vLLM
    run = fleet.install(debian_package_2, enable=True)  # no scrapers: closed again
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    assert not _scrape(prometheus, port) and _scrape("127.0.0.1", port)
    assert vllm_pid(host) == vllm
