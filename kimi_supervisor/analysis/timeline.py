"""One rank's timeline, read from what analysis/reader.py kept of its trace: the steps in order,
the collective calls of each step (what analysis/skew.py matches across the ranks), the steps'
time distribution, and how much of the communication overlaps compute.

A collective's time on a rank is where it runs, per backend (docs/architecture.md has the table):
the kernel's on a GPU (its start is when the rank arrived: NCCL's and vLLM's custom all-reduce's
kernels spin until every rank's data is there); gloo's worker thread's range (`gloo:all_reduce`)
on a CPU, with the kind of the c10d operator that handed it over (that operator returns at once;
the caller's wait is in `work.wait()`, which the profiler does not record); the operator's for
vLLM's CPU shared memory (`_C::shm_allreduce` waits in a loop for the other ranks' flags).
A call belongs to the step whose CPU range launched it, else to the step whose range holds it.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kimi_supervisor.analysis.collectives import collective
from kimi_supervisor.analysis.reader import STEP, Launches, Reader, Step

# A step longer than this many times its kind's median, among the first steps of that kind, is
# a start-up step (compilation of a new shape, a first allocation): shown apart, never mixed
# into the steady state's percentiles. At most FIRST_MAX of them.
FIRST_FACTOR, FIRST_MAX = 1.5, 5


@dataclass(frozen=True)
class Calls:
    """A rank's collective calls inside its steps, in start order, as columns: the step each is
    in (its index in the timeline's steps), its key, its start and its duration (µs), and its
    message in bytes as nccl-tests sizes it (-1: the trace does not say)."""

    step: list[int]
    key: list[str]
    start: list[float]
    dur: list[float]
    nbytes: list[int]


@dataclass(frozen=True)
class Timeline:
    """What analysis/skew.py needs of one rank (it is dropped once the ranks are matched): the
    trace's time base, the steps in start order and the collective calls, times in µs. It
    crosses from a rank's summarizer to its parent as JSON (`to_json`, `from_json`)."""

    base_ns: int
    steps: list[Step]
    calls: Calls

    def to_json(self) -> dict[str, Any]:
        c = self.calls
        return {
            "base_ns": self.base_ns,
            "steps": [[s.start, s.end, s.name] for s in self.steps],
            "calls": {
                "step": c.step, "key": c.key, "start": c.start, "dur": c.dur, "nbytes": c.nbytes
            },
        }  # fmt: skip

    @classmethod
    def from_json(cls, found: dict[str, Any]) -> Timeline:
        c = found["calls"]
        return cls(
            base_ns=int(found["base_ns"]),
            steps=[Step(s, e, n) for s, e, n in found["steps"]],
            calls=Calls(
                step=c["step"],
                key=c["key"],
                start=c["start"],
                dur=c["dur"],
                nbytes=c.get("nbytes") or [-1] * len(c["step"]),
            ),
        )


class StepIndex:
    """Which step (in start order) holds a time: the last to start at or before it, if it has
    not ended."""

    def __init__(self, steps: list[Step]) -> None:
        self.starts = [s.start for s in steps]
        self.ends = [s.end for s in steps]

    def at(self, t: float) -> int:
        k = bisect.bisect_right(self.starts, t) - 1
        return k if k >= 0 and t < self.ends[k] else -1


class Windows:
    """Steps' ranges, merged into sorted [start, end) ranges; `holds(t)` by bisection."""

    def __init__(self, steps: list[Step]) -> None:
        merged = union([(s.start, s.end) for s in steps])
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]

    def holds(self, t: float) -> bool:
        k = bisect.bisect_right(self.starts, t) - 1
        return k >= 0 and t < self.ends[k]


def kind_of(step_name: str) -> str:
    """decode, prefill (a step with any prefill request), or step (a plain ProfilerStep#N)."""
    m = STEP.match(step_name)
    if m is None or m.group(1) is None:
        return "step"
    return "prefill" if int(m.group(1)) > 0 else "decode"


def steps_of(r: Reader) -> list[Step]:
    """The rank's steps in start order: its CPU ranges (execute_model), else its GPU ranges."""
    return sorted(r.cpu_steps or r.gpu_steps, key=lambda s: (s.start, s.end, s.name))


def calls_of(r: Reader, names: dict[int, str], steps: list[Step], *, launches: Launches) -> Calls:
    """Every collective call inside a step, in start order. The key is the collective and, when
    the kernel names it, its process group: the calls of one key follow the same order on every
    rank."""
    index = StepIndex(steps)
    kinds: dict[int, str | None] = {}

    def kind(n: int) -> str | None:
        if n not in kinds:
            c = collective(names[n])
            kinds[n] = c.kind if c else None
        return kinds[n]

    out: list[tuple[int, str, float, float, int]] = []
    k = r.kernels
    if len(k.ts):
        for j in range(len(k.ts)):
            what = r.nccl_args.get(j)
            c = what.collective if what and what.collective else kind(k.name[j])
            if c is None:
                continue
            launched = launches.start(k.link[j])
            # The CPU range that launched it, else the range it ran in.
            step = index.at(launched if r.cpu_steps and launched is not None else k.ts[j])
            if step >= 0:
                key = f"{c}@{what.group}" if what and what.group else c
                nbytes = what.nbytes if what and what.nbytes is not None else -1
                out.append((step, key, k.ts[j], k.dur[j], nbytes))
    else:
        handed = bool(len(r.gloo.ts))
        for handover, start, dur, c, nbytes in gloo_calls(r, names):
            # The rank arrived when it handed the work over; the call ends with the worker's.
            if (step := index.at(handover)) >= 0:
                out.append((step, c, handover, start + dur - handover, nbytes))
        for ops in r.cpu_ops.values():
            ends: dict[str, float] = {}  # an operator inside one of its own kind is not a call
            for j in sorted(range(len(ops.ts)), key=ops.ts.__getitem__):
                c = kind(ops.name[j])
                if c is None or ops.ts[j] < ends.get(c, -1.0):
                    continue
                if handed and names[ops.name[j]].startswith("c10d::"):
                    continue  # a hand-over to gloo: the call is its worker's range
                ends[c] = ops.ts[j] + ops.dur[j]
                if (step := index.at(ops.ts[j])) >= 0:
                    nbytes = _bytes(ops.shape_at(j))
                    out.append((step, c, ops.ts[j], ops.dur[j], nbytes))
    out.sort(key=lambda c: c[2])
    return Calls(
        step=[c[0] for c in out],
        key=[c[1] for c in out],
        start=[c[2] for c in out],
        dur=[c[3] for c in out],
        nbytes=[c[4] for c in out],
    )


def _bytes(
    shape: tuple[int, int | None] | None, fallback: tuple[int, int | None] | None = None
) -> int:
    """A message's bytes from record_shapes' (elements, element size), the element size taken
    from `fallback` where `shape` has none (a TensorList's, from gloo's own range of the same
    tensor); -1 where either is unknown."""
    if shape is None:
        return -1
    size = shape[1] if shape[1] is not None else (fallback[1] if fallback else None)
    return shape[0] * size if size is not None else -1


def gloo_calls(r: Reader, names: dict[int, str]) -> list[tuple[float, float, float, str, int]]:
    """gloo's collectives as (hand-over start, start, duration, kind, bytes as nccl-tests size
    them or -1: the operator's largest tensor, its dtype from gloo's range where the operator
    takes a TensorList): each worker range paired,
    in start order, with the c10d operator that handed it over, the first range to start at or
    after the operator's start (gloo's queue is first in, first out). The kind is the
    operator's (gloo runs a reduce-scatter as `gloo:all_reduce`); a range with no operator
    before it is a call handed over before the trace began, and is dropped."""
    g = r.gloo
    if not len(g.ts):
        return []
    handovers: list[tuple[float, str, tuple[int, int]]] = []
    for tid, ops in r.cpu_ops.items():
        for j, (ts, n) in enumerate(zip(ops.ts, ops.name, strict=True)):
            name = names[n]
            if name.startswith("c10d::") and (c := collective(name)) is not None:
                handovers.append((ts, c.kind, (tid, j)))
    handovers.sort()
    ranges = sorted(range(len(g.ts)), key=g.ts.__getitem__)
    out: list[tuple[float, float, float, str, int]] = []
    j = 0
    for ts, kind, op in handovers:
        while j < len(ranges) and g.ts[ranges[j]] < ts:
            j += 1
        if j == len(ranges):
            break
        k = ranges[j]
        nbytes = _bytes(r.cpu_ops[op[0]].shape_at(op[1]), g.shape_at(k))
        out.append((ts, g.ts[k], g.dur[k], kind, nbytes))
        j += 1
    return out


def percentile(sorted_values: list[float], p: float) -> float:
    """The nearest-rank percentile of values sorted ascending."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, int(-(-p * len(sorted_values) // 100)) - 1))
    return sorted_values[k]


def leading(ms: list[float]) -> int:
    """How many of the first steps (of one kind, in order) are start-up steps: each over
    FIRST_FACTOR x the kind's median, FIRST_MAX at most, never every step."""
    median = statistics.median(ms) if ms else 0.0
    first = 0
    while first < min(FIRST_MAX, len(ms) - 1) and ms[first] > FIRST_FACTOR * median:
        first += 1
    return first


def step_times(steps: list[Step]) -> dict[str, Any]:
    """Per step kind: how many, p50/p90/p99 of the steady steps (ms), the first steps apart
    (leading steps over FIRST_FACTOR x the kind's median), and the most common step name (the
    batch: execute_context_0(0)_generation_16(16) is sixteen decode requests)."""
    by_kind: dict[str, list[float]] = {}
    named: dict[str, Counter[str]] = {}
    for s in steps:
        by_kind.setdefault(kind_of(s.name), []).append((s.end - s.start) / 1000)
        named.setdefault(kind_of(s.name), Counter())[s.name] += 1
    out: dict[str, Any] = {}
    for kind, ms in by_kind.items():
        first = leading(ms)
        steady = sorted(ms[first:])
        out[kind] = {
            "n": len(ms),
            "p50": round(percentile(steady, 50), 3),
            "p90": round(percentile(steady, 90), 3),
            "p99": round(percentile(steady, 99), 3),
            "first": [round(x, 3) for x in ms[:first]],
            "typical": named[kind].most_common(1)[0][0],
        }
    return out


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged [start, end) ranges."""
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def overlap(r: Reader, names: dict[int, str]) -> dict[str, Any] | None:
    """Communication kernels' time that ran while a compute kernel ran too, as HTA's
    `get_comm_comp_overlap` reports it: the share of the communication time overlapped. None on
    a CPU trace (a rank's operators run one after the other on its thread)."""
    k = r.kernels
    if not len(k.ts):
        return None
    comm: list[tuple[float, float]] = []
    comp: list[tuple[float, float]] = []
    for j in range(len(k.ts)):
        name = names[k.name[j]]
        if name.startswith(("Memcpy", "Memset")):
            continue
        span = (k.ts[j], k.ts[j] + k.dur[j])
        (comm if j in r.nccl_args or collective(name) else comp).append(span)
    comm, comp = union(comm), union(comp)
    total = sum(e - s for s, e in comm)
    both, i = 0.0, 0
    for s, e in comm:
        while i < len(comp) and comp[i][1] <= s:
            i += 1
        j = i
        while j < len(comp) and comp[j][0] < e:
            both += min(e, comp[j][1]) - max(s, comp[j][0])
            j += 1
    return {
        "communication_ms": round(total / 1000, 3),
        "overlapped_share": round(both / total, 4) if total else 0.0,
    }


def timeline(r: Reader, names: dict[int, str], launches: Launches, *, base_ns: int) -> Timeline:
    """This rank's timeline (see Timeline), times rounded to the ns."""
    steps = steps_of(r)
    calls = calls_of(r, names, steps, launches=launches)
    return Timeline(
        base_ns=base_ns,
        steps=[Step(round(s.start, 3), round(s.end, 3), s.name) for s in steps],
        calls=Calls(
            step=calls.step,
            key=calls.key,
            start=[round(t, 3) for t in calls.start],
            dur=[round(d, 3) for d in calls.dur],
            nbytes=calls.nbytes,
        ),
    )
