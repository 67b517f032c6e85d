"""A switch's unavailable window, measured as it happens (decide/downtime.py has the rule and
the parts). The loop sets the marks; this module keeps them in the loop state, and gives the
finished window to the transition's record, the metric, the event and the status.

Which windows there are: one begins when a transition begins while a vLLM serves (an operator's
switch, a profile expiring, a restart to apply a config) and when a serving vLLM is lost (dead
or hung); it goes on through what follows (a rollback, a failed start and its backoff, a switch
that takes over) until some vLLM answers /health again. Its `earlier` part is then the time spent
before the last transition began. A transition that begins with nothing serving (a boot, a retry
after FAILED) has no window, only its parts from the teardown on.
"""

from __future__ import annotations

from typing import Any

from kimi_supervisor.decide import downtime
from kimi_supervisor.decide.downtime import Stopwatch
from kimi_supervisor.loop.context import Context
from kimi_supervisor.model import Mode, Step, TeardownReport, utcnow
from kimi_supervisor.status import DowntimeStatus

# The `earlier` part of the first start after a serving vLLM was lost (decide/downtime.py).
LOST = "the lost vLLM until found, its teardown and the backoff"


class Window:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.s = ctx.s

    def _now(self) -> float:
        return self.ctx.clock.monotonic()

    def begin(self, served: bool) -> None:
        """A transition begins; `served`: a vLLM served until now (its last 200 opens the
        window). A window still open (a rollback, a retry, a take-over) goes on."""
        s, last_ok = self.s, self.ctx.observer.last_ok
        open_since = s.watch.at.get("last_ok") if s.watch is not None else None
        # The first start after a lost vLLM: its `earlier` is that loss, not earlier attempts.
        earlier_is = s.watch.lost_as if s.watch is not None else ""
        s.watch = Stopwatch(earlier_is=earlier_is)
        if open_since is not None:
            s.watch.mark("last_ok", open_since)
            s.watch.mark("resumed", self._now())
        elif served and last_ok is not None:
            s.watch.mark("last_ok", last_ok)

    def lost(self, since: float | None = None) -> None:
        """The serving vLLM died or hung: the window opens at its last 200, or, for a hang
        (whose /health goes on answering), at its last proof of progress (`since`)."""
        last_ok = since if since is not None else self.ctx.observer.last_ok
        self.s.watch = Stopwatch(lost_as=LOST)
        if last_ok is not None:
            self.s.watch.mark("last_ok", last_ok)

    def probed(self, ok_at: float | None) -> None:
        """The teardown's probe of /health just before the unit's stop answered 200."""
        w = self.s.watch
        if w is not None and ok_at is not None and "resumed" not in w.at:
            w.at["last_ok"] = max(w.at.get("last_ok", ok_at), ok_at)

    def teardown_done(self, report: TeardownReport, started: float) -> None:
        """A CLEAN teardown of this switch ended: the old vLLM's exit is its stop_unit step."""
        w = self.s.watch
        if w is None:
            return
        stop = next((x for x in report.steps if x.step is Step.STOP_UNIT), None)
        if stop is not None:
            w.mark("exited", started + stop.duration_s)
        w.mark("clean", self._now())

    def ready(self, mode: Mode) -> dict[str, Any]:
        """The new vLLM answered /health: the window closes; its record (for the transition's
        history record, the `ready` event and the status)."""
        s, ctx = self.s, self.ctx
        w, s.watch = s.watch, None
        if w is None:
            return {}
        now = self._now()
        w.mark("api", now)
        w.mark("ready", now)
        record = w.record()
        window = record["window_s"]
        if s.warm is not None and not s.warm.under_way:
            record["warm"] = s.warm.model_dump(
                mode="json",
                include={"read_bytes", "skipped_bytes", "took_s", "stopped", "refused",
                         "abandoned", "reader_pid"},
            )  # fmt: skip
        record["text"] = downtime.describe(record)
        if ctx.metrics and window is not None:
            ctx.metrics.switch_downtime.labels(mode.value).observe(window)
        tr = s.transition
        s.last_downtime = DowntimeStatus(
            transition=tr.id if tr else "",
            target=mode,
            under_way=False,
            window_s=window,
            parts=record["parts"],
            at=utcnow().isoformat(),
            text=downtime.describe(record),
        )
        return record
