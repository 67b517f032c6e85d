"""One rank's timeline, read from what analysis/trace.py kept of its trace: the steps in order,
the collective calls of each step (what analysis/skew.py matches across the ranks), the steps'
time distribution, and how much of the communication overlaps compute.

A collective's time on a rank is the kernel's on a GPU (its start is when the rank arrived:
NCCL's and vLLM's custom all-reduce's kernels spin until every rank's data is there), the
operator's on a CPU (vLLM's `_C::shm_allreduce` waits in a loop for the other ranks' flags).
A call belongs to the step whose CPU range launched it, else to the step whose range holds it.
"""

from __future__ import annotations

import bisect
import re
import statistics
from collections import Counter
from typing import Any, Protocol

from kimi_supervisor.analysis.collectives import collective

# `r` below is analysis/trace.py's reader (kernels, cpu_ops, cpu_steps, gpu_steps, nccl_args),
# typed loosely here: trace.py imports this module, never the other way round.
Reader = Any


class Launches(Protocol):
    def start(self, link: int) -> float | None: ...


# A step longer than this many times its kind's median, among the first steps of that kind, is
# a start-up step (compilation of a new shape, a first allocation): shown apart, never mixed
# into the steady state's percentiles. At most FIRST_MAX of them.
FIRST_FACTOR, FIRST_MAX = 1.5, 5


class StepIndex:
    """Which step (in start order) holds a time: the last to start at or before it, if it has
    not ended."""

    def __init__(self, steps: list[tuple[float, float, str]]) -> None:
        self.starts = [s for s, _, _ in steps]
        self.ends = [e for _, e, _ in steps]

    def at(self, t: float) -> int:
        k = bisect.bisect_right(self.starts, t) - 1
        return k if k >= 0 and t < self.ends[k] else -1


STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$|^ProfilerStep#\d+$")


def kind_of(step_name: str) -> str:
    """decode, prefill (a step with any prefill request), or step (a plain ProfilerStep#N)."""
    m = STEP.match(step_name)
    if m is None or m.group(1) is None:
        return "step"
    return "prefill" if int(m.group(1)) > 0 else "decode"


def steps_of(r: Reader) -> list[tuple[float, float, str]]:
    """The rank's steps in start order: its CPU ranges (execute_model), else its GPU ranges."""
    if r.cpu_steps:
        return sorted((s, e, n) for s, e, n, _tid in r.cpu_steps)
    return sorted(r.gpu_steps)


def calls_of(
    r: Reader, names: dict[int, str], steps: list[tuple[float, float, str]], launches: Launches
) -> list[tuple[int, str, float, float]]:
    """(step, key, start, duration) of every collective call inside a step, in start order. The
    key is the collective and, when the kernel names it, its process group: the calls of one key
    follow the same order on every rank."""
    index = StepIndex(steps)
    kinds: dict[int, str | None] = {}

    def kind(n: int) -> str | None:
        if n not in kinds:
            c = collective(names[n])
            kinds[n] = c[0] if c else None
        return kinds[n]

    out: list[tuple[int, str, float, float]] = []
    k = r.kernels
    if len(k.ts):
        for j in range(len(k.ts)):
            what = r.nccl_args.get(j)
            c = what[0] if what and what[0] else kind(k.name[j])
            if c is None:
                continue
            launched = launches.start(k.link[j])
            # The CPU range that launched it, else the range it ran in.
            step = index.at(launched if r.cpu_steps and launched is not None else k.ts[j])
            if step >= 0:
                key = f"{c}@{what[1]}" if what and what[1] else c
                out.append((step, key, k.ts[j], k.dur[j]))
    else:
        for ops in r.cpu_ops.values():
            ends: dict[str, float] = {}  # an operator inside one of its own kind is not a call
            for j in sorted(range(len(ops.ts)), key=ops.ts.__getitem__):
                c = kind(ops.name[j])
                if c is None or ops.ts[j] < ends.get(c, -1.0):
                    continue
                ends[c] = ops.ts[j] + ops.dur[j]
                if (step := index.at(ops.ts[j])) >= 0:
                    out.append((step, c, ops.ts[j], ops.dur[j]))
    out.sort(key=lambda c: c[2])
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


def step_times(steps: list[tuple[float, float, str]]) -> dict[str, Any]:
    """Per step kind: how many, p50/p90/p99 of the steady steps (ms), the first steps apart
    (leading steps over FIRST_FACTOR x the kind's median), and the most common step name (the
    batch: execute_context_0(0)_generation_16(16) is sixteen decode requests)."""
    by_kind: dict[str, list[float]] = {}
    named: dict[str, Counter[str]] = {}
    for s, e, n in steps:
        by_kind.setdefault(kind_of(n), []).append((e - s) / 1000)
        named.setdefault(kind_of(n), Counter())[n] += 1
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


def timeline(r: Reader, names: dict[int, str], launches: Launches, base_ns: int) -> dict[str, Any]:
    """What analysis/skew.py needs of this rank (it is dropped once the ranks are matched): the
    trace's time base, the steps and the collective calls, times in µs."""
    steps = steps_of(r)
    calls = calls_of(r, names, steps, launches)
    return {
        "base_ns": base_ns,
        "steps": [[round(s, 3), round(e, 3), n] for s, e, n in steps],
        "calls": [[step, key, round(t, 3), round(d, 3)] for step, key, t, d in calls],
    }
