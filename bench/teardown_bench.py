"""Teardown against the floor, per scenario, measured in one run on the sandbox.

    .venv/bin/python -m bench.teardown_bench [--runs N] [--gpus G] [--write docs/performance.md]

For each scenario, from the same starting state each time:
  floor     SIGKILL of every holder (unit's cgroup and ghosts) until the GPUs read baseline
  own exit  plain `systemctl stop` until the unit is inactive (the fake's own shutdown)
  teardown  kimi-supervisor's teardown until verified CLEAN
The figures are medians with the min-max spread; the doc section is written by this script.
"""

from __future__ import annotations

import signal
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import fmt_ms, health, machine, poll
from bench.common import main as bench_main
from kimi_supervisor.model import Mode, Outcome
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.clock import SystemClock
from kimi_supervisor.ports.launcher import write_argv_file
from kimi_supervisor.ports.systemd import PystemdSystemd
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.fake_vllm import FakeOptions
from kimi_supervisor.sandbox.sandbox import UNIT, Sandbox
from kimi_supervisor.store import baseline
from kimi_supervisor.teardown.escalation import Teardown


class Bench:
    def __init__(self, sb: Sandbox, gpus: int) -> None:
        self.sb = sb
        self.config = sb.config()
        self.systemd = PystemdSystemd("user", self.config.systemd.bus_address)
        self.gpu = simgpu.SimGpu(sb.gpu_dir)
        self.indices = list(range(gpus))
        base = baseline.load(self.config.state.dir)
        assert base is not None
        self.baselines = base.devices

    def at_baseline(self) -> bool:
        return all(
            d.used_mib <= self.baselines[d.index] and not d.processes
            for d in self.gpu.sample(self.indices)
        )

    def setup(self, scenario: str) -> list[processes.ProcessRef]:
        opts = FakeOptions(load_s=0.1, graph_capture_s=0.0)
        if scenario == "ignores SIGTERM":
            opts.ignore_sigterm = True
        self.sb.set_fake_options(opts)
        write_argv_file(self.config, Mode.PRODUCTION)
        self.systemd.start(UNIT)
        poll(lambda: health(self.config.vllm.health_url) == 200)
        ghosts = []
        if scenario == "ghost outside the unit":
            ghosts.append(self.sb.start_ghost("all", 8_000, "python"))
        if scenario == "stray VLLM::Worker_TP3":
            ghosts.append(self.sb.start_ghost("3", 8_000, "VLLM::Worker_TP3"))
        return ghosts

    def reset(self, ghosts: list[processes.ProcessRef]) -> None:
        if not self.systemd.status(UNIT).inactive:
            self.systemd.kill(UNIT, "all", signal.SIGKILL)
        poll(lambda: self.systemd.status(UNIT).inactive)
        if self.systemd.status(UNIT).active_state == "failed":
            self.systemd.reset_failed(UNIT)
        for g in ghosts:
            processes.send_signal(g, signal.SIGKILL)
        poll(self.at_baseline)

    def floor(self, scenario: str) -> float:
        ghosts = self.setup(scenario)
        holders = [r for r in map(processes.ref_of, self.systemd.cgroup_pids(UNIT)) if r]
        t0 = time.monotonic()
        for ref in holders + ghosts:
            processes.send_signal(ref, signal.SIGKILL)
        poll(self.at_baseline)
        elapsed = time.monotonic() - t0
        self.reset(ghosts)
        return elapsed

    def own_exit(self, scenario: str) -> float | None:
        if scenario == "ignores SIGTERM":
            return None  # it never exits by itself
        ghosts = self.setup(scenario)
        t0 = time.monotonic()
        self.systemd.stop(UNIT)
        poll(lambda: self.systemd.status(UNIT).inactive)
        elapsed = time.monotonic() - t0
        self.reset(ghosts)
        return elapsed

    def teardown(self, scenario: str) -> float:
        ghosts = self.setup(scenario)
        t0 = time.monotonic()
        report = Teardown(self.config, self.systemd, self.gpu, SystemClock(), self.baselines).run()
        elapsed = time.monotonic() - t0
        assert report.outcome is Outcome.CLEAN, report.diagnosis
        self.reset(ghosts)
        return elapsed


SCENARIOS = ["well-behaved", "ignores SIGTERM", "ghost outside the unit", "stray VLLM::Worker_TP3"]


def run(runs: int, gpus: int) -> str:
    root = Path(tempfile.mkdtemp(prefix="kimi-bench-"))
    sb = Sandbox.up(root, gpus=gpus, daemon=False)  # the benchmark drives the unit itself
    try:
        b = Bench(sb, gpus)
        grace = b.config.teardown.term_grace_s
        rows = []
        for scenario in SCENARIOS:
            floor, own, td = [], [], []
            for _ in range(runs):
                floor.append(b.floor(scenario))
                o = b.own_exit(scenario)
                if o is not None:
                    own.append(o)
                td.append(b.teardown(scenario))
            med_td, med_floor = statistics.median(td), statistics.median(floor)
            # The targets: well-behaved within 100 ms of floor + the fake's own exit;
            # the others within term_grace_s + 300 ms.
            if scenario == "well-behaved":
                target = med_floor + statistics.median(own) + 0.100
                target_text = "floor + own exit + 100 ms"
            else:
                target = grace + 0.300
                target_text = f"term_grace_s ({grace:g} s) + 300 ms"
            met = "met" if med_td <= target else f"MISSED by {(med_td - target) * 1000:.0f} ms"
            rows.append(
                f"| {scenario} | {fmt_ms(floor)} | {fmt_ms(own) if own else 'never'} | "
                f"{fmt_ms(td)} | {med_td / med_floor:.1f}× | {target_text}: {met} |"
            )
        head = (
            f"Measured {machine()}, sandbox with {gpus} simulated GPUs, {runs} runs per cell; "
            "milliseconds, median (min–max).\n\n"
            "| scenario | floor: SIGKILL all → baseline | own exit (systemctl stop) | "
            "teardown → CLEAN | teardown / floor | target |\n|---|---|---|---|---|---|\n"
        )
        return head + "\n".join(rows) + "\n"
    finally:
        sb.down()


if __name__ == "__main__":
    bench_main("teardown-bench", run, 5, gpus=(int, 8))
