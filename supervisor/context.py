"""What the loop's parts share: the ports, the one loop state, and the small effects every part
needs (change the state, persist, publish an event, warn). Owned and used by the loop thread.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor import history
from supervisor.config import Config
from supervisor.events import EventBus
from supervisor.loopstate import LoopState
from supervisor.messages import Event
from supervisor.metrics import Metrics
from supervisor.model import Mode, utcnow
from supervisor.observer import Observer
from supervisor.ports.clock import Clock
from supervisor.ports.gpu import GpuPort
from supervisor.ports.notify import Notifier
from supervisor.ports.output import OutputPort
from supervisor.ports.systemd import SystemdPort
from supervisor.reconcile import State
from supervisor.state import PersistedState, StateStore, with_desired, with_transition

Log = Callable[..., None]


def new_id() -> str:
    return f"t-{utcnow():%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


@dataclass
class Context:
    config: Config
    systemd: SystemdPort
    gpu: GpuPort
    output: OutputPort
    notifier: Notifier
    log: Log
    clock: Clock
    metrics: Metrics | None
    store: StateStore
    bus: EventBus
    s: LoopState = field(default_factory=LoopState)
    publish: Callable[[], None] = field(default=lambda: None)

    def __post_init__(self) -> None:
        self.unit = self.config.service.unit
        self.observer = Observer(
            self.config, self.systemd, self.gpu, self.clock, self.warn, self.unwarn
        )

    def set_state(self, state: State, why: str = "") -> None:
        s = self.s
        if state is not s.state:
            self.log("state_changed", previous=s.state.value, state=state.value, why=why)
            s.state, s.state_since = state, utcnow()
        self.publish()

    def persist(self, change: Callable[[PersistedState], PersistedState]) -> None:
        self.store.update(change)

    def persist_transition(self) -> None:
        tr = self.s.transition
        self.persist(lambda st: with_transition(st, tr))

    def desire(self, mode: Mode, by: str) -> None:
        """Persist the desired mode: always before anything is torn down for it."""
        self.persist(lambda st: with_desired(st, mode, by))
        if mode is not self.s.desired:
            self.log(
                "desired_mode_changed", previous=self.s.desired.value, desired=mode.value, by=by
            )
        self.s.desired = mode
        self.publish()

    def event(self, name: str, data: dict[str, Any] | None = None) -> None:
        tid = self.s.transition.id if self.s.transition else None
        self.bus.publish(Event(event=name, at=utcnow(), transition=tid, data=data or {}))

    def incident(self, record: dict[str, Any]) -> None:
        history.append(self.config.state.dir, "incident", record)

    def warn(self, message: str) -> None:
        """Logged once while it lasts (a failing read repeats every tick); shown in status."""
        w = self.s.warnings
        if message not in w:
            self.log("warning", level="warning", message=message)
            w.append(message)
            del w[:-10]

    def unwarn(self, prefix: str) -> None:
        self.s.warnings = [w for w in self.s.warnings if not w.startswith(prefix)]
