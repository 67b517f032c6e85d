"""A rolling capture over N sandboxed hosts with Ansible, against N times one host's cycle done
by hand with kimi-mode (profile, a capture of S seconds, production), measured in one run:

    .venv/bin/python -m bench.fleet_bench --hosts 3 --runs 3 --write docs/performance.md

Each host is a sandbox of its own (systemd --user manager, daemon, 2 simulated GPUs, the fake
vLLM); the playbook is the collection's rolling_capture, under the local connection.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import machine
from kimi_supervisor.sandbox.sandbox import Sandbox
from tests.fleet import KIMI_MODE, Ansible, local_inventory


def by_hand(sb: Sandbox, seconds: float) -> float:
    """One host's cycle as an operator types it; seconds from the first command to the last."""
    env = {**os.environ, **sb.env}
    t0 = time.monotonic()
    for args in (
        ["profile"],
        ["capture", "--seconds", f"{seconds:g}", "--then", "stay"],
        ["production"],
    ):
        r = subprocess.run([str(KIMI_MODE), *args], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"kimi-mode {' '.join(args)} failed: {r.stdout}{r.stderr}")
    return time.monotonic() - t0


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}–{max(xs):.1f})"


def run(runs: int, hosts: int, seconds: float) -> str:
    work = Path(tempfile.mkdtemp(prefix="kimi-fleet-bench-"))
    sandboxes: list[Sandbox] = []
    try:
        for i in range(hosts):
            sandboxes.append(Sandbox.up(work / f"h{i + 1}", gpus=2))
        sockets = {f"h{i + 1}": sb.socket_path for i, sb in enumerate(sandboxes)}
        ansible = Ansible(work, local_inventory(work / "hosts.ini", sockets))
        one: list[float] = []
        rolls: list[float] = []
        for _ in range(runs):
            one.append(by_hand(sandboxes[0], seconds))
            played = ansible.play("rolling_capture", kimi_capture_seconds=f"{seconds:g}")
            if played.rc != 0:
                raise SystemExit(f"the rolling capture failed:\n{played.output[-3000:]}")
            rolls.append(played.seconds)
    finally:
        for sb in sandboxes:
            sb.down()
        shutil.rmtree(work, ignore_errors=True)
    host = statistics.median(one)
    roll = statistics.median(rolls)
    overhead = roll - hosts * host
    rows = [
        f"Measured {machine()}, {runs} runs each (median, min–max), a capture of "
        f"{seconds:g} s, the sandbox's fake vLLM loading in about 2 s:",
        "",
        "| | seconds |",
        "|---|---|",
        f"| one host's cycle by hand (`kimi-mode profile`, `capture`, `production`) | "
        f"{spread(one)} |",
        f"| rolling capture over N = {hosts} hosts (`ansible-playbook "
        f"kimi.supervisor.rolling_capture`) | {spread(rolls)} |",
        f"| N × one host | {hosts * host:.1f} |",
        f"| Ansible's overhead: the roll − N × one host | {overhead:.1f} "
        f"({overhead / hosts:.1f} per host) |",
    ]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    from bench.common import main

    main("fleet-bench", run, runs=3, hosts=(int, 3), seconds=(float, 1.0))
