"""Two booted Debian 12 hosts driven over SSH on the loopback address, as a controller drives a
fleet: the collection's install playbook installs the package on bare hosts and upgrades it
later while vLLM keeps serving, then a rolling capture visits both and brings the traces home
over SSH. The hosts share this machine's network, so each has its own sshd, vLLM and metrics
ports. The tests run in order and build on each other."""

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
from .host import BootedHost, Unavailable, copy_checkout, network, unavailable
from .test_booted import vllm_pid, wait_serving

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
        _binds, self.pip_env = network()
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
        self.ansible.env["TMPDIR"] = str(work / "tmp")  # where the install playbook packs

    def tree(self, name: str, note: str = "") -> Path:
        """A release tree as an operator has it: the checkout's files, without .git."""
        dest = self.work / name
        copy_checkout(dest)
        if note:
            with open(dest / "README.md", "a") as f:
                f.write(note)
        return dest

    def install(self, src: Path, enable: bool) -> Played:
        env = json.dumps({"kimi_install_environment": self.pip_env})
        return self.ansible.play(
            "install", "-e", env, timeout_s=900, kimi_src=str(src), kimi_enable=str(enable)
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
        binds, _env = network()
        pub = (work / "id_ed25519.pub").read_text()
        for h in NAMES:
            (work / h).mkdir()
            host = BootedHost(work / h)
            f.hosts[h] = host
            try:
                host.prepare(install=False, ssh=(f.ports[h][0], pub))
                host.binds = binds  # pip's cache and CA for `make install` inside
                host.boot()
            except Unavailable as e:
                pytest.skip(f"no booted host: {e}")
        yield f
    finally:
        for host in f.hosts.values():
            host.poweroff()
        shutil.rmtree(work, ignore_errors=True)


def test_the_install_playbook_installs_the_package_on_bare_hosts_over_ssh(fleet: SshFleet) -> None:
    src = fleet.tree("release")
    run = fleet.install(src, enable=False)
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    assert set(run.recap) == set(NAMES)
    assert not (fleet.work / "tmp" / "kimi-supervisor-src.tar").exists()  # removed at the end
    for h, host in fleet.hosts.items():
        assert "kimi-mode" in host.sh("kimi-mode --version").stdout
        assert host.sh("systemctl is-enabled kimi-supervisor", check=False).stdout.strip() == (
            "disabled"
        )
        vllm_port, metrics_port = fleet.ports[h][1:]
        host.configure(vllm_port, metrics_port)  # the simulated GPUs and the fake vLLM
    # Again, enabling: nothing is reinstalled, and the play waits until both serve.
    run = fleet.install(src, enable=True)
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    assert "skipping: [b1]" in run.output.split("Make install")[1].split("TASK")[0]
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


def test_an_upgrade_reinstalls_and_reloads_the_daemon_while_vllm_keeps_serving(
    fleet: SshFleet,
) -> None:
    before = {h: vllm_pid(host) for h, host in fleet.hosts.items()}
    daemons = {h: host.sh("systemctl show -p MainPID --value kimi-supervisor").stdout.strip()
               for h, host in fleet.hosts.items()}  # fmt: skip
    src = fleet.tree("release-2", note="\nA newer release.\n")
    run = fleet.install(src, enable=True)
    assert run.rc == 0 and run.failed() == set(), run.output[-4000:]
    assert "RUNNING HANDLER [Reload kimi-supervisor]" in run.output
    for h, host in fleet.hosts.items():
        assert "A newer release." in host.sh("cat /opt/kimi-supervisor/docs/README.md").stdout
        wait_serving(host, "production", 30)
        assert vllm_pid(host) == before[h]  # never reloaded: vLLM kept serving
        # `systemctl reload` re-executes the daemon in place: same PID, new code.
        main = host.sh("systemctl show -p MainPID --value kimi-supervisor").stdout.strip()
        assert main == daemons[h]
