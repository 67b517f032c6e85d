"""ansible-playbook as an operator runs it, against the collection in ansible/
(tests/sandbox/test_fleet.py, tests/booted/test_fleet_ssh.py and bench/fleet_bench.py): its own
ANSIBLE_HOME and temporary folders, no colour, and the play recap read back per host."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECTIONS = ROOT / "ansible"
COLLECTION = COLLECTIONS / "ansible_collections" / "kimi" / "supervisor"
BIN = Path(sys.executable).parent
KIMI_MODE = BIN / "kimi-mode"
RECAP = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", re.MULTILINE)


@dataclass
class Played:
    rc: int
    output: str
    seconds: float
    recap: dict[str, dict[str, int]] = field(default_factory=dict)

    def changed(self) -> dict[str, int]:
        return {host: counts["changed"] for host, counts in self.recap.items()}

    def failed(self) -> set[str]:
        return {h for h, c in self.recap.items() if c["failed"] or c["unreachable"]}


def local_inventory(path: Path, sockets: dict[str, Path]) -> Path:
    """An inventory of sandboxed hosts on this machine: group `kimi`, the local connection,
    this interpreter and kimi-mode, and each host's control socket."""
    path.write_text(
        "[kimi]\n"
        + "".join(f"{host} kimi_socket={sock}\n" for host, sock in sockets.items())
        + "\n[kimi:vars]\nansible_connection=local\n"
        f"ansible_python_interpreter={sys.executable}\nkimi_mode_executable={KIMI_MODE}\n"
    )
    return path


class Ansible:
    def __init__(self, work: Path, inventory: Path) -> None:
        self.work = work
        self.inventory = inventory
        for d in ("home", "tmp", "remote-tmp"):
            (work / d).mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "PWD": str(work),
            "ANSIBLE_COLLECTIONS_PATH": str(COLLECTIONS),
            "ANSIBLE_HOME": str(work / "home"),
            "ANSIBLE_LOCAL_TEMP": str(work / "tmp"),
            "ANSIBLE_REMOTE_TEMP": str(work / "remote-tmp"),
            "ANSIBLE_CONFIG": str(work / "none.cfg"),  # no ansible.cfg from elsewhere
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_RETRY_FILES_ENABLED": "0",
            "ANSIBLE_HOST_KEY_CHECKING": "0",
            "ANSIBLE_PYTHON_INTERPRETER": "auto_silent",
        }

    def play(
        self, playbook: str | Path, *args: str, timeout_s: float = 600, **extra: str
    ) -> Played:
        """`ansible-playbook -i INVENTORY PLAYBOOK ARGS -e k=v...`; a playbook of the collection
        by its short name (`rolling_capture`) or a file."""
        name = str(playbook) if isinstance(playbook, Path) else f"kimi.supervisor.{playbook}"
        cmd = [str(BIN / "ansible-playbook"), "-i", str(self.inventory), name, *args]
        for k, v in extra.items():
            cmd += ["-e", f"{k}={v}"]
        t0 = time.monotonic()
        r = subprocess.run(
            cmd, cwd=self.work, env=self.env, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        took = time.monotonic() - t0
        out = r.stdout + r.stderr
        recap = {
            m[1]: {k: int(v) for k, v in (kv.split("=") for kv in m[2].split())}
            for m in RECAP.finditer(out.split("PLAY RECAP")[-1])
        }
        return Played(r.returncode, out, took, recap)
