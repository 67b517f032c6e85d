"""How long this load will take, from the past ones (pure: records in, an estimate out).

A load of Kimi-K2.5 takes 30+ minutes, and its length depends on the mode's argv (the model, the
profiler) and on the host. The history keeps each transition that became ready with its
`load_s` (starting vLLM's unit to /health 200) and its `argv_key` (a hash of the argv it ran).
The estimate is the median of the newest loads with the same target mode and argv; it says
"ready in about N min" while loading, and says so when this load runs longer than every one of
them (`SLOWER` past the slowest).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

PAST = 5  # the newest loads the estimate is made of
SLOWER = 1.25  # this much past the slowest of them counts as slower than usual


def argv_key(argv: list[str]) -> str:
    return hashlib.sha256(json.dumps(argv).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Estimate:
    expected_s: float  # the median of the past loads
    slowest_s: float
    past: int  # how many past loads it is made of

    def remaining_s(self, elapsed_s: float) -> float:
        return max(self.expected_s - elapsed_s, 0.0)

    def slower(self, elapsed_s: float) -> bool:
        return elapsed_s > self.slowest_s * SLOWER

    def describe(self, elapsed_s: float) -> str:
        if self.slower(elapsed_s):
            return (
                f"slower than the last {self.past} load(s): {_minutes(elapsed_s)} so far, the "
                f"slowest took {_minutes(self.slowest_s)}"
            )
        left = self.remaining_s(elapsed_s)
        if left < 0.5:  # "ready in about 0 s" would stand while the load goes on
            return f"past the estimate: past loads took {_minutes(self.expected_s)}"
        return f"ready in about {_minutes(left)} (past loads: {_minutes(self.expected_s)})"


def estimate(records: Iterable[dict[str, Any]], mode: str, key: str) -> Estimate | None:
    """From history records (oldest first): the newest PAST loads of `mode` with `key`."""
    loads = [
        float(r["load_s"])
        for r in records
        if r.get("kind") == "transition"
        and r.get("outcome") == "ready"
        and r.get("target") == mode
        and r.get("argv_key") == key
        and isinstance(r.get("load_s"), int | float)
    ][-PAST:]
    if not loads:
        return None
    return Estimate(statistics.median(loads), max(loads), len(loads))


def _minutes(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"
