"""Today's practice against kimi-supervisor, on the same scenario, from the same starting state.

    .venv/bin/python -m bench.practice_bench [--runs N] [--write docs/performance.md]

The scenario (sandbox, 8 simulated GPUs):
- vLLM's tree: API server, EngineCore and 8 workers holding 90,000 MiB each;
- a ghost outside it, titled `jupyter-kernel`, holding 30,720 MiB on GPUs 0-3 and nvidia-uvm;
- a protected stand-in titled `nvidia-persistenced` holding the device files, no memory;
- a stand-in for the supervisor as `ps` shows it (`python3 .../kimi-supervisor run ...`),
  holding the device files as an NVML client does.

Three ways down:
(a) the hand sequence of ../shared/seeds/000_d01c13970a9e3dca.txt, only its device paths changed
    to the simulated ones. It kills by pattern, so it runs in a PID namespace of its own
    (`unshare --pid --fork --mount-proc`) holding nothing but this scenario's processes: there,
    `ps`, `pgrep` and `fuser` see only them. The tree runs without systemd there (the sequence
    never uses systemd); its own final check is its verification.
(b) `systemctl stop` of the unit (the tree runs in the sandbox's unit);
(c) kimi-supervisor's teardown (the tree runs in the unit; the supervisor is this process).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from bench.common import health, machine, poll
from bench.common import main as bench_main
from kimi_supervisor.model import Mode
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.clock import SystemClock
from kimi_supervisor.ports.launcher import write_argv_file
from kimi_supervisor.ports.systemd import PystemdSystemd
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.fake_vllm import FakeOptions
from kimi_supervisor.sandbox.sandbox import UNIT, Sandbox
from kimi_supervisor.store import baseline
from kimi_supervisor.teardown.escalation import Teardown

GHOST_MIB = 30_720
SUPERVISOR_TITLE = "/usr/bin/python3 /usr/local/bin/kimi-supervisor run --config /etc/kimi-supervisor/kimi-supervisor.toml"

# The seed's command, verbatim except for the device paths (`$DEV` = the simulated /dev).
HAND_SEQUENCE = r"""
kill $(pgrep -f "vllm.entrypoints") 2>/dev/null; sleep 3; ps aux | grep -E "python3|VLLM" | grep -v grep | awk "{print \$2}" | xargs kill -9 2>/dev/null; sleep 5; kill -9 $(fuser $DEV/nvidia* 2>/dev/null | tr " " "\n" | sort -u | grep -v "^$") 2>/dev/null; sleep 2
"""

# Runs as PID 1 of its own PID namespace: starts the scenario, waits for GO, runs the sequence,
# then checks the GPUs (the sequence's own `nvidia-smi`) and who is still alive.
DRIVER = r"""
set -u
cd "$SANDBOX"
"$PY" -m kimi_supervisor.sandbox.ghost --gpu all --mib 0 --title nvidia-persistenced > protected.out &
echo "protected $!" > pids
"$PY" -m kimi_supervisor.sandbox.ghost --gpu all --mib 0 --title "$SUPERVISOR_TITLE" > supervisor.out &
echo "supervisor $!" >> pids
"$PY" -m kimi_supervisor.sandbox.ghost --gpu 0,1,2,3 --mib $GHOST_MIB --title jupyter-kernel > ghost.out &
echo "ghost $!" >> pids
"$SANDBOX/bin/vllm" serve moonshotai/Kimi-K2.5 --tensor-parallel-size 8 --port $PORT > hand-vllm.log 2>&1 &
echo "vllm $!" >> pids
until [ "$(cat protected.out supervisor.out ghost.out 2>/dev/null | grep -c ready)" = 3 ] \
      && grep -q "startup complete" hand-vllm.log; do sleep 0.05; done
echo ready > READY
until [ -e GO ]; do sleep 0.01; done
start=$(date +%s.%N)
eval "$HAND_SEQUENCE"
end=$(date +%s.%N)
# The sequence's own check (nvidia-smi there): is every GPU back at baseline?
"$PY" -c "
import json, sys
from kimi_supervisor.sandbox.simgpu import SimGpu
g = SimGpu(sys.argv[1]); n = g.device_count()
print(json.dumps({'at_baseline': all(d.used_mib == g.baseline_of(d.index) for d in g.sample(range(n))),
                  'used': [d.used_mib for d in g.sample(range(n))]}))
" "$SANDBOX/gpu" > check.json
while read -r name pid; do
  if kill -0 "$pid" 2>/dev/null; then echo "$name alive"; else echo "$name dead"; fi
done < pids > alive
echo "$start $end" > DONE
"""


class Scenario:
    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb
        self.config = sb.config()
        self.systemd = PystemdSystemd("user", self.config.systemd.bus_address)
        stored = baseline.load(self.config.state.dir)
        assert stored is not None
        self.baselines = stored.devices
        self.indices = sorted(self.baselines)

    def at_baseline(self) -> bool:
        gpu = simgpu.SimGpu(self.sb.gpu_dir)
        try:
            return all(
                d.used_mib == gpu.baseline_of(d.index) and not d.processes
                for d in gpu.sample(self.indices)
            )
        finally:
            gpu.close()

    def start(self) -> dict[str, processes.ProcessRef]:
        """The scenario with vLLM in the sandbox's unit; returns the processes outside it."""
        self.sb.set_fake_options(FakeOptions(load_s=0.2))
        write_argv_file(self.config, Mode.PRODUCTION)
        self.systemd.start(UNIT)
        poll(lambda: health(self.config.vllm.health_url) == 200, 60, 0.02)
        return {
            "protected": self.sb.start_ghost("all", 0, "nvidia-persistenced"),
            "supervisor": self.sb.start_ghost("all", 0, SUPERVISOR_TITLE),
            "ghost": self.sb.start_ghost("0,1,2,3", GHOST_MIB, "jupyter-kernel"),
        }

    def end(self, others: dict[str, processes.ProcessRef]) -> None:
        if not self.systemd.status(UNIT).inactive:
            self.systemd.kill(UNIT, "all", signal.SIGKILL)
        poll(lambda: self.systemd.status(UNIT).inactive, 30, 0.02)
        if self.systemd.status(UNIT).active_state == "failed":
            self.systemd.reset_failed(UNIT)
        for ref in others.values():
            processes.send_signal(ref, signal.SIGKILL)
        poll(lambda: not any(processes.is_alive(r) for r in others.values()), 10, 0.02)
        poll(self.at_baseline, 30, 0.02)

    # (b)
    def systemctl_stop(self) -> dict[str, Any]:
        others = self.start()
        t0 = time.monotonic()
        self.systemd.stop(UNIT)
        poll(lambda: self.systemd.status(UNIT).inactive, 60, 0.005)
        reached = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.at_baseline():
                reached = time.monotonic() - t0
                break
            time.sleep(0.005)
        alive = {n: processes.is_alive(r) for n, r in others.items()}
        self.end(others)
        return {"seconds": reached, "alive": alive, "killed_others": []}

    # (c)
    def teardown(self) -> dict[str, Any]:
        others = self.start()
        main_pid = self.systemd.status(UNIT).main_pid
        self._tree_pids = {main_pid, *processes.descendants(main_pid)}
        gpu = simgpu.SimGpu(self.sb.gpu_dir)
        try:
            report = Teardown(self.config, self.systemd, gpu, SystemClock(), self.baselines).run()
        finally:
            gpu.close()
        alive = {n: processes.is_alive(r) for n, r in others.items()}
        roles = {r.pid: n for n, r in others.items()}
        killed = [
            roles.get(k.process.pid, " ".join(k.process.cmdline)[:40])
            for k in report.kills
            if k.signal == "SIGKILL" and k.process.pid not in self._tree_pids
        ]
        self.end(others)
        ok = report.outcome.value == "clean" and self.at_baseline()
        return {
            "seconds": report.duration_s if ok else None,
            "alive": alive,
            "killed_others": killed,
        }

    # (a)
    def hand(self) -> dict[str, Any]:
        work = Path(tempfile.mkdtemp(prefix="hand-", dir=self.sb.root))
        driver = work / "driver.sh"
        driver.write_text(DRIVER)
        env = {
            **os.environ,
            **self.sb.env,
            "SANDBOX": str(self.sb.root),
            "PY": sys.executable,
            "DEV": str(self.sb.gpu_dir / "dev"),
            "PORT": str(self.config.vllm.port),
            "GHOST_MIB": str(GHOST_MIB),
            "SUPERVISOR_TITLE": SUPERVISOR_TITLE,
            "HAND_SEQUENCE": HAND_SEQUENCE,
            "KIMI_FAKE_VLLM_CONFIG": str(self.sb.fake_options_path),
        }
        self.sb.set_fake_options(FakeOptions(load_s=0.2))
        for name in ("READY", "GO", "DONE", "alive", "check.json", "pids"):
            (self.sb.root / name).unlink(missing_ok=True)
        log = open(work / "driver.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "bash", str(driver)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        log.close()
        try:
            poll(lambda: (self.sb.root / "READY").exists(), 60, 0.02)
            (self.sb.root / "GO").touch()
            poll(lambda: (self.sb.root / "DONE").exists(), 60, 0.05)
            start, end = map(float, (self.sb.root / "DONE").read_text().split())
            check = json.loads((self.sb.root / "check.json").read_text())
            alive = dict(line.split() for line in (self.sb.root / "alive").read_text().splitlines())
        finally:
            proc.wait(30)  # PID 1 of the namespace exits: the kernel ends everything in it
        poll(self.at_baseline, 30, 0.02)
        return {
            "seconds": (end - start) if check["at_baseline"] else None,
            "alive": {n: a == "alive" for n, a in alive.items() if n != "vllm"},
            "killed_others": [n for n, a in alive.items() if a == "dead" and n != "vllm"],
        }


def summarize(name: str, runs: list[dict[str, Any]]) -> str:
    secs = [r["seconds"] for r in runs]
    reached = [s for s in secs if s is not None]
    if len(reached) == len(secs):
        t = f"{statistics.median(reached) * 1000:.0f} ({min(reached) * 1000:.0f}–{max(reached) * 1000:.0f})"
    elif reached:
        t = f"reached in {len(reached)} of {len(secs)} runs"
    else:
        t = "not reached"
    last = runs[-1]
    protected = "yes" if all(r["alive"].get("protected") for r in runs) else "**killed**"
    sup_alive = all(r["alive"].get("supervisor", True) for r in runs)
    supervisor = "yes" if sup_alive else "**killed**"
    killed = ", ".join(sorted(set(last["killed_others"]))) or "nothing outside vLLM's tree"
    return f"| {name} | {t} | {protected} | {supervisor} | {killed} |"


def run(runs: int) -> str:
    root = Path(tempfile.mkdtemp(prefix="kimi-practice-"))
    sb = Sandbox.up(root, gpus=8, daemon=False)
    try:
        s = Scenario(sb)
        rows = [
            summarize(
                "(a) the hand sequence (pkill, kill -9, fuser)", [s.hand() for _ in range(runs)]
            ),
            summarize(
                "(b) `systemctl stop` of the unit", [s.systemctl_stop() for _ in range(runs)]
            ),
            summarize("(c) kimi-supervisor's teardown", [s.teardown() for _ in range(runs)]),
        ]
    finally:
        sb.down()
    head = textwrap.dedent(f"""\
        Measured {machine()}, sandbox with 8 simulated GPUs, {runs} runs each from the same starting
        state; time until the GPUs are verified at baseline in milliseconds, median (min–max).
        The hand sequence's time includes its fixed sleeps (3 + 5 + 2 s): it verifies only at its end.

        | way down | GPUs verified at baseline | protected `nvidia-persistenced` survived | supervisor survived | killed besides vLLM's tree |
        |---|---|---|---|---|
        """)
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    bench_main("practice-bench", run, 3)
