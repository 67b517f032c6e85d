"""What a teardown reports while it runs, as types: the loop applies them (loop/jobs.py), and
each becomes one log line and one event on the bus, named by `kind` with the fields of `data()`
(the wire's event names and fields, docs/control-protocol.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kimi_supervisor.model import DeviceReading, KillRecord, Outcome, Step, StepReport


@dataclass(frozen=True)
class TeardownStarted:
    kind: ClassVar[str] = "teardown_started"
    unit: str

    def data(self) -> dict[str, Any]:
        return {"unit": self.unit}


@dataclass(frozen=True)
class StepStarted:
    kind: ClassVar[str] = "step_started"
    step: Step

    def data(self) -> dict[str, Any]:
        return {"step": self.step.value}


@dataclass(frozen=True)
class StepFinished:
    kind: ClassVar[str] = "step_finished"
    report: StepReport

    def data(self) -> dict[str, Any]:
        return self.report.model_dump(mode="json")


@dataclass(frozen=True)
class GpusRead:
    """A change of the managed GPUs' memory (the drain)."""

    kind: ClassVar[str] = "gpus"
    devices: tuple[DeviceReading, ...]

    def data(self) -> dict[str, Any]:
        return {"devices": [d.model_dump() for d in self.devices]}


@dataclass(frozen=True)
class Signalled:
    """A signal sent (SIGSTOP, then SIGKILL), or one that could not be (its result says why)."""

    kind: ClassVar[str] = "kill"
    record: KillRecord

    def data(self) -> dict[str, Any]:
        return self.record.model_dump(mode="json")


@dataclass(frozen=True)
class Spared:
    """A target that is protected: recorded once per teardown, never signalled."""

    kind: ClassVar[str] = "spared"
    pid: int
    why: str
    step: Step

    def data(self) -> dict[str, Any]:
        return {"pid": self.pid, "why": self.why, "step": self.step.value}


@dataclass(frozen=True)
class RespawnWatch:
    kind: ClassVar[str] = "respawn_watch"
    parents: tuple[int, ...]
    seconds: float

    def data(self) -> dict[str, Any]:
        return {"parents": list(self.parents), "seconds": self.seconds}


@dataclass(frozen=True)
class Warned:
    kind: ClassVar[str] = "warning"
    message: str

    def data(self) -> dict[str, Any]:
        return {"message": self.message}


@dataclass(frozen=True)
class LeftoverKept:
    """A leftover that could not be removed."""

    kind: ClassVar[str] = "leftover_not_removed"
    path: str
    error: str

    def data(self) -> dict[str, Any]:
        return {"path": self.path, "error": self.error}


@dataclass(frozen=True)
class LeftoversUnlisted:
    """Leftovers kept as not provably vLLM's past the ones listed one by one."""

    kind: ClassVar[str] = "leftovers_not_listed"
    count: int
    why: str

    def data(self) -> dict[str, Any]:
        return {"count": self.count, "why": self.why}


@dataclass(frozen=True)
class TeardownFinished:
    kind: ClassVar[str] = "teardown_finished"
    outcome: Outcome
    duration_s: float

    def data(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "duration_s": self.duration_s}


TeardownEvent = (
    TeardownStarted
    | StepStarted
    | StepFinished
    | GpusRead
    | Signalled
    | Spared
    | RespawnWatch
    | Warned
    | LeftoverKept
    | LeftoversUnlisted
    | TeardownFinished
)
EventSink = Callable[[TeardownEvent], None]


def ignore(_event: TeardownEvent) -> None:
    """The sink of a teardown nobody follows."""
