"""A switch's downtime: the window in which the host answers nothing, and its parts (pure).

The window runs from the last /health 200 of the old vLLM to the first 200 of the new one. It is
cut at marks the loop sets as they happen (monotonic seconds):

    last_ok     the old vLLM's last /health 200 (probed again just before the unit's stop)
    resumed     only for a window that goes on through more than one transition (a rollback,
                a failed start and its backoff, a switch that takes over): this one began
    exited      the teardown's stop_unit step ended: the old vLLM's own exit
    clean       the teardown ended CLEAN
    weights     the new vLLM's weights are loaded (its shard bar at 100 %, or "Model loading took")
    api         its API server starts ("Starting vLLM API server")
    ready       its first /health 200

so its parts are `earlier` (last_ok -> resumed, where there is one), `old_exit` (-> exited),
`teardown` (the teardown's own steps after that), `to_weights` (the unit's start, the
interpreter, the processes, reading the weights), `engine_init` (profile run, KV cache, compile
and warm-up) and `to_ready`. A mark not seen (a vLLM whose output has no shard bar) merges its
part into the next one, so the parts always add up to the window. Nothing served before the
switch (a boot, a retry after FAILED): there is no window, and the parts from `teardown` on are
still measured. Marks are as precise as the
loop sees them: /health is polled every `daemon.start_poll_s` while loading.

The estimate of what is left (the ETA) is made of the same parts: the median of each over the
past switches to the same mode and argv.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kimi_supervisor.decide.progress import PHASES, Progress, weights_loaded

# Each part, the mark that ends it, and what an operator reads.
PARTS: tuple[tuple[str, str, str], ...] = (
    ("earlier", "resumed", "earlier attempts"),
    ("old_exit", "exited", "old vLLM's exit"),
    ("teardown", "clean", "teardown"),
    ("to_weights", "weights", "start to weights loaded"),
    ("engine_init", "api", "engine init"),
    ("to_ready", "ready", "API to /health 200"),
)
MARKS = ("last_ok", *(mark for _part, mark, _words in PARTS))
WORDS = {part: words for part, _mark, words in PARTS}
PAST = 5  # the newest switches the estimate is made of


@dataclass
class Stopwatch:
    """The marks of one switch, set once each as the loop sees them happen."""

    at: dict[str, float] = field(default_factory=dict)
    # What its `earlier` part holds where it is no earlier attempt: a serving vLLM lost (dead or
    # hung) until it was found, its teardown and the backoff, before the first start after it.
    earlier_is: str = ""
    # Set on the window a lost vLLM opens: what the first transition after it calls `earlier`.
    lost_as: str = ""

    def mark(self, name: str, t: float) -> None:
        assert name in MARKS, name
        self.at.setdefault(name, t)

    def parts(self) -> dict[str, float]:
        """The parts measured so far (a missing mark merges its part into the next one)."""
        out: dict[str, float] = {}
        prev = self.at.get("last_ok")
        for part, mark, _words in PARTS:
            t = self.at.get(mark)
            if t is None:
                continue
            if prev is not None:
                out[part] = round(max(t - prev, 0.0), 3)
            prev = t
        return out

    def window_s(self) -> float | None:
        """The whole window, once the new vLLM answered; None without an old one."""
        if "last_ok" not in self.at or "ready" not in self.at:
            return None
        return round(self.at["ready"] - self.at["last_ok"], 3)

    def part_now(self) -> str | None:
        """The part under way: the one after the last mark set (never `earlier`, which is
        over when a transition begins)."""
        done = max((i for i, (_p, m, _w) in enumerate(PARTS) if m in self.at), default=0)
        return PARTS[done + 1][0] if done + 1 < len(PARTS) else None

    def saw(self, p: Progress, t: float) -> None:
        """vLLM's output moved to `p` (read at `t`): the weights loaded, the API started."""
        if "clean" not in self.at:
            return
        if weights_loaded(p):
            self.mark("weights", t)
        if PHASES.index(p.phase) >= PHASES.index("api"):
            self.mark("api", t)

    def record(self) -> dict[str, Any]:
        """What the transition's history record and status keep."""
        out: dict[str, Any] = {"window_s": self.window_s(), "parts": self.parts()}
        if self.earlier_is:
            out["earlier_is"] = self.earlier_is
        return out


def describe(record: dict[str, Any]) -> str:
    """One line: "unavailable 46.1 s: the old vLLM's own exit 2.2 s, ..."."""
    parts = record.get("parts") or {}
    words = {**WORDS, "earlier": record.get("earlier_is") or WORDS["earlier"]}
    said = ", ".join(f"{words.get(p, p)} {s:.1f} s" for p, s in parts.items())
    window = record.get("window_s")
    head = f"unavailable {window:.1f} s" if window is not None else "nothing served before"
    return f"{head}: {said}" if said else head


def expected_parts(records: Iterable[dict[str, Any]], mode: str, key: str) -> dict[str, float]:
    """From history records (oldest first): the median of each part over the newest PAST
    switches to `mode` with the argv key `key` that became ready."""
    past = [
        r["downtime"]["parts"]
        for r in records
        if r.get("kind") == "transition"
        and r.get("outcome") == "ready"
        and r.get("target") == mode
        and r.get("argv_key") == key
        and isinstance(r.get("downtime"), dict)
        and isinstance(r["downtime"].get("parts"), dict)
    ][-PAST:]
    out: dict[str, float] = {}
    for part, _mark, _words in PARTS:
        seen = [float(p[part]) for p in past if isinstance(p.get(part), int | float)]
        if seen:
            out[part] = statistics.median(seen)
    return out


def remaining_s(expected: dict[str, float], watch: Stopwatch, now: float) -> float | None:
    """What is left of the window by the past parts: the rest of the part under way (never
    below zero) and every part after it. A part the past lacks was merged into the next one
    there (its mark was not seen), so it counts as none; None when the past has none of them."""
    part = watch.part_now()
    if part is None:
        return 0.0
    names = [p for p, _m, _w in PARTS]
    todo = names[names.index(part) :]
    if not any(p in expected for p in todo):
        return None
    began = max(watch.at.values(), default=now)
    left = max(expected.get(part, 0.0) - (now - began), 0.0)
    return round(left + sum(expected.get(p, 0.0) for p in todo[1:]), 1)
