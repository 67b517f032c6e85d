"""The teardown: from "whatever is running" to verified clean, escalating only as far as needed.

    STOP_UNIT -> KILL_CGROUP -> KILL_STRAYS -> KILL_GPU_HOLDERS -> WAIT_RELEASE
              -> HOST_LEFTOVERS -> VERIFY

Clean means: the unit is inactive, every managed GPU's memory.used is within tolerance of its
baseline with no process listed on it, and nothing listens on vLLM's port. It is checked after
every step; the kill steps are skipped the moment it holds. Each step polls (every
`poll_interval_s`) against its own deadline, so a STUCK teardown ends within the sum of them.

Safety: targets are signalled through pidfds checked against their start time (a recycled PID is
never hit); a set of targets is SIGSTOPped before it is SIGKILLed (no respawn in between); the
supervisor, its ancestors, PID 1 and protected processes are never signalled; an open device
descriptor alone is used as evidence only when NVML's lists do not explain the memory.
"""

from __future__ import annotations

import fnmatch
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor.config import Config
from supervisor.model import (
    DeviceReading,
    Evidence,
    KillRecord,
    Outcome,
    ProcessDescription,
    RemainingHolder,
    Step,
    StepReport,
    TeardownReport,
    utcnow,
)
from supervisor.ports import processes
from supervisor.ports.clock import Clock
from supervisor.ports.gpu import DeviceSample, GpuPort
from supervisor.ports.processes import PidHandle, ProcessRef
from supervisor.ports.systemd import SystemdError, SystemdPort
from supervisor.scan import Protection, fd_holders, has_vllm_signature, listeners, shm_in_use

EventSink = Callable[[str, dict[str, Any]], None]

# Memory that no listed process explains is attributed to descriptor holders only once it has
# stopped draining for this long: a dying process's memory is freed by the driver within
# ~0.3 s on an H200, and an NVML client must not be killed for memory that is on its way out.
FD_FALLBACK_SETTLE_S = 0.5


@dataclass
class _Target:
    ref: ProcessRef
    evidence: Evidence
    reason: str


@dataclass
class Teardown:
    config: Config
    systemd: SystemdPort
    gpu: GpuPort
    clock: Clock
    baselines: dict[int, int]
    on_event: EventSink = field(default=lambda kind, data: None)
    protection: Protection | None = None

    def __post_init__(self) -> None:
        t = self.config.teardown
        self.unit = self.config.service.unit
        self.indices = sorted(self.baselines)
        self.protection = self.protection or Protection.from_config(
            t.protected_names, t.protected_units
        )
        self.patterns = [re.compile(p) for p in t.stray_patterns]
        self.killed: dict[ProcessRef, KillRecord] = {}
        self.report = TeardownReport(unit=self.unit, started_at=utcnow())
        self._devices: list[DeviceReading] = []
        self._unit_active = True
        self._device_paths = {i: self.gpu.device_path(i) for i in self.indices}
        self._last_drain: dict[int, int] = {}
        self._ppids: dict[ProcessRef, int] = {}
        self._snapshot: list[ProcessRef] = []

    # -- observation --
    def _sample(self) -> list[DeviceSample]:
        samples = self.gpu.sample(self.indices)
        tol = self.config.gpus.tolerance_mib
        self._devices = [
            DeviceReading(
                index=s.index,
                used_mib=s.used_mib,
                baseline_mib=self.baselines[s.index],
                tolerance_mib=tol,
                processes=sorted({p.pid for p in s.processes}),
            )
            for s in samples
        ]
        drain = {d.index: d.used_mib for d in self._devices}
        if drain != self._last_drain:
            self._last_drain = drain
            self.on_event("gpus", {"devices": [d.model_dump() for d in self._devices]})
        return samples

    def _gpus_clean(self) -> bool:
        self._sample()
        return all(d.clean for d in self._devices)

    def _unit_inactive(self) -> bool:
        try:
            self._unit_active = not self.systemd.status(self.unit).inactive
        except SystemdError:
            # The manager not answering is not a reason to stop freeing the GPUs.
            self._unit_active = False
        return not self._unit_active

    def _clean(self) -> bool:
        return (
            self._unit_inactive()
            and self._gpus_clean()
            and not listeners(self.config.vllm.port, self._likely())
        )

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

    # -- killing --
    def _record(
        self,
        ref: ProcessRef,
        sig: str,
        step: Step,
        target: _Target,
        result: str,
        desc: ProcessDescription | None = None,
    ) -> KillRecord:
        rec = KillRecord(
            at=utcnow(),
            signal=sig,
            step=step,
            evidence=target.evidence,
            reason=target.reason,
            process=desc or processes.describe(ref),
            result=result,
        )
        self.report.kills.append(rec)
        self.on_event("kill", rec.model_dump(mode="json"))
        return rec

    def _kill_set(self, step: Step, targets: list[_Target]) -> int:
        """SIGSTOP every target, then SIGKILL every target; returns how many were signalled."""
        assert self.protection is not None
        handles: list[tuple[_Target, PidHandle, ProcessDescription]] = []
        for t in targets:
            if t.ref in self.killed:
                continue  # already got SIGKILL: waited for, never signalled again
            why = self.protection.why_protected(t.ref.pid)
            if why:
                self.on_event("spared", {"pid": t.ref.pid, "why": why, "step": step.value})
                continue
            h = PidHandle.open(t.ref)
            if isinstance(h, str):
                self._record(
                    t.ref, "SIGKILL", step, t, h, ProcessDescription(pid=t.ref.pid, start_time=0.0)
                )
                continue
            handles.append((t, h, processes.describe(t.ref)))
        try:
            for t, h, desc in handles:
                self._record(t.ref, "SIGSTOP", step, t, h.send(signal.SIGSTOP), desc)
            for t, h, desc in handles:
                self.killed[t.ref] = self._record(
                    t.ref, "SIGKILL", step, t, h.send(signal.SIGKILL), desc
                )
        finally:
            for _t, h, _d in handles:
                h.close()
        return len(handles)

    def _wait_dead(self, timeout_s: float) -> bool:
        return self._poll_until(
            lambda: not any(processes.is_alive(r) for r in self.killed), timeout_s
        )

    # -- the steps --
    def _snapshot_tree(self) -> list[ProcessRef]:
        """The unit's processes when the teardown begins: its cgroup and MainPID's descendants."""
        pids: set[int] = set()
        try:
            status = self.systemd.status(self.unit)
            pids.update(self.systemd.cgroup_pids(self.unit))
        except SystemdError as e:
            self.on_event("warning", {"message": f"cannot read {self.unit}: {e}"})
            return []
        if status.main_pid:
            pids.add(status.main_pid)
            pids.update(processes.descendants(status.main_pid))
        return [r for r in map(processes.ref_of, pids) if r is not None]

    def _step_stop_unit(self) -> str:
        if self._unit_inactive():
            return "unit already inactive"
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
            target = _Target(ref, Evidence.UNIT_CGROUP, f"left in {self.unit} after SIGTERM")
            self.killed[ref] = self._record(
                ref, "SIGKILL", Step.KILL_CGROUP, target, "sent by systemd (KillUnit, whom=all)"
            )
        self.systemd.kill(self.unit, "all", signal.SIGKILL)
        ok = self._poll_until(
            lambda: self._unit_inactive() and not self.systemd.cgroup_pids(self.unit),
            self.config.teardown.cgroup_kill_timeout_s,
        )
        return f"SIGKILL to {len(pids)} process(es)" + ("" if ok else "; unit still not inactive")

    def _step_kill_strays(self, snapshot: list[ProcessRef]) -> str:
        targets: dict[ProcessRef, _Target] = {}
        for ref in snapshot:
            if processes.is_alive(ref):
                targets[ref] = _Target(ref, Evidence.ESCAPED_UNIT, "escaped the unit's cgroup")
        for pid in listeners(self.config.vllm.port, self._likely()):
            lref = processes.ref_of(pid)
            if lref and lref not in targets:
                targets[lref] = _Target(
                    lref, Evidence.LISTENS_ON_PORT, f"listens on port {self.config.vllm.port}"
                )
        # vLLM's signature counts only on processes that use a managed GPU (NVML lists them
        # there): a vLLM serving other GPUs of this host is not ours.
        for d in self._devices:
            for pid in d.processes:
                vref = processes.ref_of(pid)
                if vref and vref not in targets and has_vllm_signature(pid, self.patterns):
                    targets[vref] = _Target(
                        vref, Evidence.VLLM_SIGNATURE, f"vLLM process on managed GPU {d.index}"
                    )
        n = self._kill_set(Step.KILL_STRAYS, list(targets.values()))
        self._wait_dead(self.config.teardown.strays_timeout_s)
        return f"{n} stray(s) killed"

    def _listed_targets(self) -> list[_Target]:
        """NVML-listed processes on managed GPUs not yet killed, plus the parent of any that
        reappeared after its sibling was killed (a respawner: kill it and its children together)."""
        # Parents of what we killed, as seen when we chose it (a dead process has no parent).
        killed_ppids = {self._ppids[r] for r in self.killed if r in self._ppids}
        targets: dict[ProcessRef, _Target] = {}
        for d in self._devices:
            for pid in d.processes:
                ref = processes.ref_of(pid)
                if ref is None or ref in self.killed or ref in targets:
                    continue
                self._ppids[ref] = ppid = processes.ppid_of(pid)
                targets[ref] = _Target(
                    ref, Evidence.NVML_LISTED, f"listed on managed GPU {d.index}"
                )
                parent = processes.ref_of(ppid) if ppid in killed_ppids and ppid > 1 else None
                if parent is not None and parent not in targets:
                    targets[parent] = _Target(
                        parent, Evidence.RESPAWNS, f"started PID {pid} on GPU {d.index} again"
                    )
        return list(targets.values())

    def _step_kill_gpu_holders(self) -> str:
        t = self.config.teardown
        deadline = self.clock.monotonic() + t.holders_timeout_s
        n = 0
        # Loop while new holders appear (a respawner replaces what we kill), within the deadline.
        while self.clock.monotonic() < deadline:
            targets = self._listed_targets()
            if not targets:
                break
            n += self._kill_set(Step.KILL_GPU_HOLDERS, targets)
            self._wait_dead(max(deadline - self.clock.monotonic(), t.poll_interval_s))
            if self._gpus_clean() and not self._respawned(targets):
                return f"{n} NVML-listed holder(s) killed"
        # Memory that no listed process explains: look at who holds the device files, once
        # the memory has stopped draining.
        if self._gpus_clean() or any(d.processes for d in self._devices):
            return f"{n} NVML-listed holder(s) killed"
        if not self._settled(deadline):
            return f"{n} NVML-listed holder(s) killed; memory returned"
        dirty = [d.index for d in self._devices if not d.clean]
        paths = [self._device_paths[i] for i in dirty]
        holders = fd_holders(paths)
        fd_targets = [
            _Target(
                ref,
                Evidence.DEVICE_FD,
                f"holds {', '.join(sorted(held))} while memory on GPU(s) "
                f"{', '.join(map(str, dirty))} is unexplained",
            )
            for pid, held in holders.items()
            if (ref := processes.ref_of(pid)) is not None
        ]
        m = self._kill_set(Step.KILL_GPU_HOLDERS, fd_targets)
        self._wait_dead(max(deadline - self.clock.monotonic(), t.poll_interval_s))
        return f"{n} NVML-listed holder(s), {m} descriptor holder(s) killed"

    def _respawned(self, killed: list[_Target]) -> bool:
        """After killing holders whose parent lives on (not PID 1, not us, not protected), watch
        for `respawn_watch_s` whether that parent puts a new process on a managed GPU."""
        assert self.protection is not None
        parents = {self._ppids.get(t.ref, 0) for t in killed}
        live = [
            p
            for p in parents
            if p > 1 and processes.ref_of(p) is not None and not self.protection.why_protected(p)
        ]
        if not live:
            return False
        return self._poll_until(
            lambda: not self._gpus_clean() or any(d.processes for d in self._devices),
            self.config.teardown.respawn_watch_s,
        )

    def _settled(self, deadline: float) -> bool:
        """Wait until memory stops falling for FD_FALLBACK_SETTLE_S; False if it came clean."""
        last = [d.used_mib for d in self._devices]
        quiet_since = self.clock.monotonic()
        while self.clock.monotonic() < deadline:
            if self._gpus_clean():
                return False
            now = [d.used_mib for d in self._devices]
            if now != last:
                last, quiet_since = now, self.clock.monotonic()
            elif self.clock.monotonic() - quiet_since >= FD_FALLBACK_SETTLE_S:
                return True
            self.clock.sleep(self.config.teardown.poll_interval_s)
        return True

    def _step_wait_release(self) -> str:
        ok = self._poll_until(self._gpus_clean, self.config.teardown.release_timeout_s)
        alive = [r for r in self.killed if processes.is_alive(r)]
        note = "memory back at baseline" if ok else "memory still above baseline"
        if alive:
            states = ", ".join(f"{r.pid} ({processes.state_of(r.pid)})" for r in alive)
            note += f"; killed but not exited: {states}"
        return note

    def _step_host_leftovers(self) -> str:
        t = self.config.teardown
        try:
            names = {
                e.name
                for e in os.scandir(t.shm_dir)
                if any(fnmatch.fnmatch(e.name, p) for p in t.shm_patterns)
            }
        except FileNotFoundError:
            return f"{t.shm_dir} does not exist"
        if not names:
            return "no leftover segments"
        in_use = shm_in_use(t.shm_dir, names)
        for name in sorted(names - in_use):
            try:
                (t.shm_dir / name).unlink()
                self.report.shm_removed.append(str(t.shm_dir / name))
            except FileNotFoundError:
                pass
        kept = f"; {len(in_use)} still in use, kept" if in_use else ""
        return f"{len(self.report.shm_removed)} segment(s) removed{kept}"

    # -- the run --
    def run(self) -> TeardownReport:
        start = self.clock.monotonic()
        self.on_event("teardown_started", {"unit": self.unit})
        snapshot = self._snapshot = self._snapshot_tree()
        self._sample()
        steps: list[tuple[Step, Callable[[], str], bool]] = [
            (Step.STOP_UNIT, self._step_stop_unit, False),
            (Step.KILL_CGROUP, self._step_kill_cgroup, True),
            (Step.KILL_STRAYS, lambda: self._step_kill_strays(snapshot), True),
            (Step.KILL_GPU_HOLDERS, self._step_kill_gpu_holders, True),
            (Step.WAIT_RELEASE, self._step_wait_release, True),
            (Step.HOST_LEFTOVERS, self._step_host_leftovers, False),
        ]
        for step, action, skippable in steps:
            began, t0 = utcnow(), self.clock.monotonic()
            if skippable and self._clean():
                note, skipped = "skipped: GPUs clean", True
            else:
                self.on_event("step_started", {"step": step.value})
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
            self.on_event("step_finished", rep.model_dump(mode="json"))
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
        self.on_event("teardown_finished", {"outcome": r.outcome.value, "duration_s": r.duration_s})

    def _diagnose(self) -> None:
        assert self.protection is not None
        r = self.report
        lines, seen = [], set()
        if self._unit_active:
            lines.append(f"{self.unit} is still active")
        for d in self._devices:
            if not d.clean:
                lines.append(
                    f"GPU {d.index}: {d.used_mib} MiB used, baseline {d.baseline_mib} "
                    f"(+{d.tolerance_mib} tolerance), processes {d.processes or 'none'}"
                )
            for pid in d.processes:
                seen.add(pid)
        paths = [self._device_paths[d.index] for d in self._devices if not d.clean]
        for pid in sorted(seen | set(fd_holders(paths) if paths else {})):
            ref = processes.ref_of(pid)
            if ref is None or pid in self.protection.never:
                continue  # our own NVML handles explain nothing
            why = self.protection.why_protected(pid)
            killed = self.killed.get(ref)
            if killed:
                step = killed.step
                reason = (
                    f"got SIGKILL in {step.value} but has not exited (state "
                    f"{processes.state_of(pid)}: uninterruptible sleep in the driver?)"
                )
            elif why:
                step, reason = Step.KILL_GPU_HOLDERS, f"not signalled: {why}"
            else:
                step, reason = Step.KILL_GPU_HOLDERS, "holds the device; not judged a target"
            cgroup = processes.cgroup_of(pid)
            r.remaining.append(
                RemainingHolder(
                    process=processes.describe(ref),
                    unit=cgroup.rsplit("/", 1)[-1],
                    devices=[d.index for d in self._devices if pid in d.processes],
                    not_cleared_by=step,
                    why=reason,
                )
            )
        for pid in listeners(self.config.vllm.port, self._likely()):
            lines.append(f"PID {pid} still listens on port {self.config.vllm.port}")
        killed_alive = any(h.why.startswith("got SIGKILL") for h in r.remaining)
        listed = [h for h in r.remaining if h.devices]
        r.diagnosis = "; ".join(lines) or "not clean"
        if self._unit_active:
            r.next_action = f"check `systemctl status {self.unit}`: the manager did not stop it"
        elif killed_alive:
            r.next_action = (
                "a killed process has not exited: look at its kernel stack "
                "(cat /proc/PID/stack); if it is stuck in the NVIDIA driver, "
                "drain the host and reboot (or reset the GPU by hand)"
            )
        elif listed:
            r.next_action = (
                "processes listed on the GPUs were not signalled (see why): check whether "
                "they really own the memory (nvidia-smi) and stop them by hand if so"
            )
        else:
            r.next_action = (
                "memory is held with no process behind it (a driver leak): "
                "check `nvidia-smi` and dmesg for Xid errors; a GPU reset or a "
                "reboot frees it"
            )
