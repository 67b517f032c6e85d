"""Signalling a teardown's targets, and the record of every signal sent (the report's kills).

Targets are signalled through pidfds checked against their start time, so a recycled PID is never
hit; a set of targets is SIGSTOPped before it is SIGKILLed (no respawn in between); a protected
target is recorded as spared once per teardown and never signalled.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from kimi_supervisor.model import (
    Evidence,
    KillRecord,
    ProcessDescription,
    Step,
    TeardownReport,
    utcnow,
)
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.processes import PidHandle, ProcessRef
from kimi_supervisor.teardown.events import EventSink, Signalled, Spared
from kimi_supervisor.teardown.gpuview import Target
from kimi_supervisor.teardown.scan import Protection

KILL_WORDS = {
    Evidence.NVML_LISTED: "NVML-listed holder(s)",
    Evidence.OPEN_AND_MAPPED: "open-and-mapped holder(s)",
    Evidence.RESPAWNS: "respawning parent(s)",
}


def holders_note(counts: dict[Evidence, int], spared: set[int]) -> str:
    """The kill_gpu_holders step's note: what it killed on which evidence, and which holders
    it did not signal because they are protected (never "no holder" when there is one)."""
    killed = ", ".join(f"{c} {KILL_WORDS[e]}" for e, c in counts.items() if c)
    note = f"{killed} killed" if killed else ""
    if spared:
        said = f"holder PID {', '.join(map(str, sorted(spared)))} protected, not signalled"
        return f"{note}; {said}" if note else said
    return note or "nothing killed: NVML lists no live holder, none has a GPU open and mapped"


@dataclass
class Kills:
    protection: Protection
    report: TeardownReport
    on_event: EventSink
    # Everything that got SIGKILL, and everything spared, in this teardown.
    killed: dict[ProcessRef, KillRecord] = field(default_factory=dict)
    spared: set[ProcessRef] = field(default_factory=set)

    def all_dead(self) -> bool:
        return not any(processes.is_alive(r) for r in self.killed)

    def record(
        self,
        ref: ProcessRef,
        sig: str,
        step: Step,
        *,
        target: Target,
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
        self.on_event(Signalled(rec))
        return rec

    def kill_set(self, step: Step, targets: list[Target]) -> int:
        """SIGSTOP every target, then SIGKILL every target; returns how many were signalled.
        A protected target is recorded as spared once per teardown, never signalled."""
        handles: list[tuple[Target, PidHandle, ProcessDescription]] = []
        for t in targets:
            if t.ref in self.killed or t.ref in self.spared:
                continue  # already got SIGKILL (waited for), or already spared
            why = self.protection.why_protected(t.ref.pid)
            if why:
                self.spared.add(t.ref)
                self.on_event(Spared(t.ref.pid, why, step))
                continue
            h = PidHandle.open(t.ref)
            if isinstance(h, str):
                self.record(
                    t.ref,
                    "SIGKILL",
                    step,
                    target=t,
                    result=h,
                    desc=ProcessDescription(pid=t.ref.pid, start_time=0.0),
                )
                continue
            handles.append((t, h, processes.describe(t.ref)))
        try:
            for t, h, desc in handles:
                self.record(
                    t.ref, "SIGSTOP", step, target=t, result=h.send(signal.SIGSTOP), desc=desc
                )
            for t, h, desc in handles:
                self.killed[t.ref] = self.record(
                    t.ref, "SIGKILL", step, target=t, result=h.send(signal.SIGKILL), desc=desc
                )
        finally:
            for _t, h, _d in handles:
                h.close()
        return len(handles)
