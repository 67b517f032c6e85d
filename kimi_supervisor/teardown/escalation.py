"""The teardown: from "whatever is running" to verified clean, escalating only as far as needed.

    STOP_UNIT -> KILL_CGROUP -> KILL_STRAYS -> KILL_GPU_HOLDERS -> WAIT_RELEASE
              -> HOST_LEFTOVERS -> VERIFY

Clean means: the unit is inactive, every managed GPU's memory.used is within tolerance of its
baseline with no process listed on it, and nothing listens where vLLM binds its port. It is
checked after every step; the kill steps are skipped the moment it holds. A holder NVML lists
during WAIT_RELEASE that was not there to kill sends the teardown back to KILL_GPU_HOLDERS.
Each step polls (every `poll_interval_s`) against its own deadline, so a STUCK teardown ends
within the sum of them.

GPU holders are judged by the evidence ladder of teardown/ownership.py: a live process NVML
lists on a managed GPU (rung 1), else a process that has a managed device file open and mapped
where no live listed process explains the memory (rung 2). An open descriptor alone, or a
mapping alone (rung 3), is never a reason to kill: such processes are named in the diagnosis.

Safety: targets are signalled through pidfds checked against their start time (a recycled PID is
never hit); a set of targets is SIGSTOPped before it is SIGKILLed (no respawn in between); the
supervisor, its ancestors, PID 1 and protected processes are never signalled, and each spared
process is recorded once per teardown.
"""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kimi_supervisor.config import Config
from kimi_supervisor.model import (
    DeviceReading,
    Evidence,
    Outcome,
    Step,
    StepReport,
    TeardownReport,
    utcnow,
)
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.clock import Clock
from kimi_supervisor.ports.gpu import GpuPort
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.ports.systemd import SystemdError, SystemdPort
from kimi_supervisor.teardown import events as ev
from kimi_supervisor.teardown import leftovers
from kimi_supervisor.teardown.diagnosis import Scene, diagnose
from kimi_supervisor.teardown.events import EventSink
from kimi_supervisor.teardown.gpuview import GpuView, Target
from kimi_supervisor.teardown.kills import KILL_WORDS, Kills, holders_note
from kimi_supervisor.teardown.listing import Sighting
from kimi_supervisor.teardown.scan import Protection, device_users, listeners, unit_tree
from kimi_supervisor.teardown.strays import stray_targets

# How many times KILL_GPU_HOLDERS may run again for holders that appear during WAIT_RELEASE:
# a respawner outside every unit is killed with its child in the second round.
LATE_ROUNDS = 3


@dataclass
class Teardown:
    config: Config
    systemd: SystemdPort
    gpu: GpuPort
    clock: Clock
    baselines: dict[int, int]
    on_event: EventSink = ev.ignore
    protection: Protection | None = None
    # The daemon's teardown: its own service's other processes (its helpers) are spared.
    in_daemon: bool = False
    # When the daemon first saw each (GPU, PID) listed (teardown/listing.py).
    listed_since: Mapping[Sighting, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.config.teardown
        self.unit = self.config.service.unit
        self.indices = sorted(self.baselines)
        self.protection = protection = self.protection or Protection.from_config(
            t.protected_names, t.protected_units, own_service=self.in_daemon
        )
        self.patterns = [re.compile(p) for p in t.stray_patterns]
        self.report = TeardownReport(unit=self.unit, started_at=utcnow())
        self.kills = Kills(protection, self.report, self.on_event)
        self.view = GpuView(
            self.gpu,
            self.clock,
            self.baselines,
            self.config.gpus.tolerance_mib,
            self.on_event,
            self.listed_since,
        )
        self._unit_active = True
        self._ppids: dict[ProcessRef, int] = {}
        self._snapshot: list[ProcessRef] = []
        self._late = False  # a holder appeared during WAIT_RELEASE
        self._rounds = 1  # of KILL_GPU_HOLDERS and WAIT_RELEASE

    @property
    def _devices(self) -> list[DeviceReading]:
        return self.view.devices

    def _gpus_clean(self) -> bool:
        return self.view.clean()

    def _unit_inactive(self) -> bool:
        try:
            self._unit_active = not self.systemd.status(self.unit).inactive
        except SystemdError:
            # The manager not answering is not a reason to stop freeing the GPUs.
            self._unit_active = False
        return not self._unit_active

    def _activated_at(self) -> float | None:
        """When vLLM's unit last started: what it left since then is its own."""
        try:
            return self.systemd.activated_at(self.unit)
        except SystemdError:
            return None

    def _run_as(self) -> int | None:
        """The user vLLM's unit runs it as: whose files are vLLM's (None: unknown)."""
        try:
            return self.systemd.run_as(self.unit)
        except SystemdError:
            return None

    def _listeners(self) -> dict[int, set[str]]:
        v = self.config.vllm
        return listeners(v.port, v.host, self._likely())

    def _clean(self) -> bool:
        return self._unit_inactive() and self._gpus_clean() and not self._listeners()

    def _likely(self) -> list[int]:
        """Where vLLM's listening socket would be: its tree, and what NVML lists."""
        return [r.pid for r in self._snapshot] + [p for d in self._devices for p in d.processes]

    def _poll_until(self, cond: Callable[[], bool], timeout_s: float) -> bool:
        deadline = self.clock.monotonic() + timeout_s
        while True:
            if cond():
                return True
            if self.clock.monotonic() >= deadline:
                return False
            self.clock.sleep(self.config.teardown.poll_interval_s)

    def _wait_dead_or(self, timeout_s: float, or_gpus_clean: bool = False) -> bool:
        """Wait for everything killed so far to exit (or, with `or_gpus_clean`, for the GPUs to
        read clean: a killed holder's memory is back before its exit has finished unmapping a
        large address space, and nothing is gained by waiting for that)."""
        dead = self.kills.all_dead
        return self._poll_until(
            (lambda: dead() or self._gpus_clean()) if or_gpus_clean else dead, timeout_s
        )

    # -- the steps --
    def _step_stop_unit(self) -> str:
        if self._unit_inactive():
            return "unit already inactive"
        # A frozen tree (SIGSTOPped, as a hung engine can be) acts on no SIGTERM; with
        # KillMode=mixed systemd continues only the main process. Every process of the unit is
        # continued first, as psutil's terminate does, so that the API server's orderly stop of
        # its engine goes through instead of waiting out TimeoutStopSec.
        with contextlib.suppress(SystemdError):  # the stop below says what systemd says
            self.systemd.kill(self.unit, "all", signal.SIGCONT)
        self.systemd.stop(self.unit)
        ok = self._poll_until(self._unit_inactive, self.config.teardown.term_grace_s)
        return (
            "unit stopped"
            if ok
            else (f"unit still active after term_grace_s={self.config.teardown.term_grace_s} s")
        )

    def _step_kill_cgroup(self) -> str:
        try:
            pids = self.systemd.cgroup_pids(self.unit)
        except SystemdError as e:
            return f"cannot list the unit's processes: {e}"
        if not pids and self._unit_inactive():
            return "cgroup empty"
        for ref in filter(None, map(processes.ref_of, pids)):
            target = Target(ref, Evidence.UNIT_CGROUP, f"left in {self.unit} after SIGTERM")
            self.kills.killed[ref] = self.kills.record(
                ref,
                "SIGKILL",
                Step.KILL_CGROUP,
                target=target,
                result="sent by systemd (KillUnit, whom=all)",
            )
        self.systemd.kill(self.unit, "all", signal.SIGKILL)
        ok = self._poll_until(
            lambda: self._unit_inactive() and not self.systemd.cgroup_pids(self.unit),
            self.config.teardown.cgroup_kill_timeout_s,
        )
        return f"SIGKILL to {len(pids)} process(es)" + ("" if ok else "; unit still not inactive")

    def _step_kill_strays(self, snapshot: list[ProcessRef]) -> str:
        targets = stray_targets(
            snapshot,
            self._listeners(),
            self.config.vllm.port,
            view=self.view,
            patterns=self.patterns,
        )
        n = self.kills.kill_set(Step.KILL_STRAYS, targets)
        self._wait_dead_or(self.config.teardown.strays_timeout_s)
        return f"{n} stray(s) killed"

    def _with_respawners(self, targets: dict[ProcessRef, Target]) -> list[Target]:
        """The targets not yet killed or spared, plus the parent of any whose sibling we
        already killed: a respawner, killed with its children."""
        killed_ppids = {self._ppids[r] for r in self.kills.killed if r in self._ppids}
        for ref, t in list(targets.items()):
            self._ppids[ref] = ppid = processes.ppid_of(ref.pid)
            parent = processes.ref_of(ppid) if ppid in killed_ppids and ppid > 1 else None
            if parent is not None and parent not in targets:
                targets[parent] = Target(
                    parent, Evidence.RESPAWNS, f"started PID {ref.pid} ({t.reason}) again"
                )
        return [
            t
            for r, t in targets.items()
            if r not in self.kills.killed and r not in self.kills.spared
        ]

    def _step_kill_gpu_holders(self) -> str:
        assert self.protection is not None
        t = self.config.teardown
        deadline = self.clock.monotonic() + t.holders_timeout_s
        counts = dict.fromkeys(KILL_WORDS, 0)
        unwatched: list[Target] = []
        spared: set[int] = set()  # holders the evidence names that are protected
        while True:
            targets = self._with_respawners(self.view.listed_targets()) or self._with_respawners(
                self.view.mapped_targets(self.protection.never)
            )
            n = self.kills.kill_set(Step.KILL_GPU_HOLDERS, targets)
            for x in targets:
                if x.ref in self.kills.killed:
                    counts[x.evidence] += 1
                    unwatched.append(x)
            if n:
                self._wait_dead_or(
                    max(deadline - self.clock.monotonic(), t.poll_interval_s), or_gpus_clean=True
                )
            spared |= {x.ref.pid for x in targets if x.ref in self.kills.spared}
            note = holders_note(counts, spared)
            if self._gpus_clean():
                watched, unwatched = unwatched, []
                if watched and self._respawned(watched):
                    continue  # a parent put a holder back: the next round kills it and the parent
                return note
            if not n and not self.view.draining():
                return note  # no more evidence: WAIT_RELEASE waits, VERIFY diagnoses
            if self.clock.monotonic() >= deadline:
                return f"{note}; holders_timeout_s={t.holders_timeout_s} s reached"
            self.clock.sleep(t.poll_interval_s)

    def _respawned(self, killed: list[Target]) -> bool:
        """After killing holders whose parent lives on (not PID 1, not us, not protected), watch
        for `respawn_watch_s` (long enough to cover a CUDA start) whether a new holder appears."""
        assert self.protection is not None
        parents = {self._ppids.get(t.ref, 0) for t in killed}
        live = [
            p
            for p in parents
            if p > 1
            and (ref := processes.ref_of(p)) is not None
            and processes.is_alive(ref)  # a killed parent not yet reaped is a zombie: done
            and not self.protection.why_protected(p)
        ]
        if not live:
            return False
        watch_s = self.config.teardown.respawn_watch_s
        self.on_event(ev.RespawnWatch(tuple(sorted(live)), watch_s))
        return self._poll_until(lambda: not self._gpus_clean(), watch_s)

    def _late_holders(self) -> list[ProcessRef]:
        """Live processes NVML lists on a managed GPU that were not there to kill: a respawner's
        child that started after the respawn watch ended (a loaded host starts slower)."""
        done = self.kills.killed.keys() | self.kills.spared
        return [r for r in self.view.listed_targets() if r not in done]

    def _held_by_spared(self) -> list[int]:
        """The spared live holders, when they alone hold what is left and nothing killed is
        still alive: no release can come then (empty otherwise)."""
        if not self.kills.all_dead():
            return []
        return self.view.held_only_by({r.pid for r in self.kills.spared})

    def _step_wait_release(self) -> str:
        again = self._rounds < LATE_ROUNDS
        self._poll_until(
            lambda: (
                self._gpus_clean()
                or (again and bool(self._late_holders()))
                or bool(self._held_by_spared())
            ),
            self.config.teardown.release_timeout_s,
        )
        ok = all(d.clean for d in self._devices)
        late = [] if ok or not again else self._late_holders()
        if late:
            self._late = True
            pids = ", ".join(str(r.pid) for r in late)
            return f"new holder(s) listed after the kills ({pids}): killing again"
        if not ok and (kept := self._held_by_spared()):
            pids = ", ".join(map(str, kept))
            return f"memory held by spared live process(es) {pids}: no release can come"
        alive = [r for r in self.kills.killed if processes.is_alive(r)]
        note = "memory back at baseline" if ok else "memory still above baseline"
        if alive:
            states = ", ".join(f"{r.pid} ({processes.state_of(r.pid)})" for r in alive)
            note += f"; killed but not exited: {states}"
        return note

    def _step_host_leftovers(self) -> str:
        return leftovers.remove(
            self.config.teardown, self.report.shm_removed, self.on_event, owner=self._owner
        )

    # -- the run --
    def run(self) -> TeardownReport:
        start = self.clock.monotonic()
        self.on_event(ev.TeardownStarted(self.unit))
        snapshot = self._snapshot = unit_tree(self.systemd, self.unit, self.on_event)
        t = self.config.teardown
        self._owner = leftovers.Owner.of(
            snapshot,
            self._activated_at(),
            self._run_as(),
            dirs=[t.shm_dir] + ([t.tmp_dir] if t.tmp_dir is not None else []),
        )
        self.view.sample()
        holders: list[tuple[Step, Callable[[], str], bool]] = [
            (Step.KILL_GPU_HOLDERS, self._step_kill_gpu_holders, True),
            (Step.WAIT_RELEASE, self._step_wait_release, True),
        ]
        steps: list[tuple[Step, Callable[[], str], bool]] = [
            (Step.STOP_UNIT, self._step_stop_unit, False),
            (Step.KILL_CGROUP, self._step_kill_cgroup, True),
            (Step.KILL_STRAYS, lambda: self._step_kill_strays(snapshot), True),
            *holders,
            (Step.HOST_LEFTOVERS, self._step_host_leftovers, False),
        ]
        while steps:
            step, action, skippable = steps.pop(0)
            began, t0 = utcnow(), self.clock.monotonic()
            if skippable and self._clean():
                note, skipped = "skipped: GPUs clean", True
            else:
                self.on_event(ev.StepStarted(step))
                try:
                    note, skipped = action(), False
                except SystemdError as e:
                    note, skipped = f"systemd: {e}", False
            rep = StepReport(
                step=step,
                started_at=began,
                duration_s=self.clock.monotonic() - t0,
                skipped=skipped,
                note=note,
                devices_after=list(self._devices),
            )
            self.report.steps.append(rep)
            self.on_event(ev.StepFinished(rep))
            if self._late:
                # A holder appeared while waiting for the release: escalate again.
                self._late, self._rounds = False, self._rounds + 1
                steps[:0] = holders
        self._verify(start)
        return self.report

    def _verify(self, start: float) -> None:
        began = utcnow()
        clean = self._clean()
        r = self.report
        r.devices = list(self._devices)
        r.outcome = Outcome.CLEAN if clean else Outcome.STUCK
        if not clean:
            self._diagnose()
        r.steps.append(
            StepReport(
                step=Step.VERIFY,
                started_at=began,
                duration_s=0.0,
                note=r.outcome.value,
                devices_after=list(self._devices),
            )
        )
        r.duration_s = self.clock.monotonic() - start
        self.on_event(ev.TeardownFinished(r.outcome, r.duration_s))

    def _diagnose(self) -> None:
        assert self.protection is not None
        dirty = [self.view.paths[d.index] for d in self._devices if not d.clean]
        users = device_users(
            self.view.all_files(), dirty or None, mapped_too=True, node_key=self.view.node_key
        )
        scene = Scene(
            unit=self.unit,
            unit_active=self._unit_active,
            devices=self._devices,
            files=self.view.files(),
            users=users,
            listed_alive=self.view.listed_anywhere(),
            killed=self.kills.killed,
            why_protected=self.protection.why_protected,
            never=self.protection.never,
            port=self.config.vllm.port,
            port_holders=self._listeners(),
        )
        r = self.report
        r.remaining, r.diagnosis, r.next_action = diagnose(scene)
