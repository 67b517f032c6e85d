"""Waiting against moving data: every collective call matched across the ranks of one capture,
and each rank's time in it split into the wait for the last rank to arrive and the rest.

**Matching.** The ranks run the same steps in the same order, and within a step the same
collectives of each key (collective and process group) in the same order. A rank's steps are
lined up with the lowest rank's by the shift that matches the most steps of the same name and the
same calls (the profilers of the ranks start a step or two apart); among equal shifts, the one
whose steps start closest in time. A step is kept when every rank has it with the same calls.

**Clocks.** The ranks of one host share its clock, and a trace's times are that clock's less the
trace's `baseTimeNanoseconds` (added back here). Whether they really agree is checked, not
assumed: an all-reduce, an all-gather or a reduce-scatter cannot end on any rank before the last
rank arrives, because every rank's output needs every rank's input. On the H200 fixture (NCCL,
two ranks) the ranks' ends of each all-reduce agree within 1 µs. When the median call would end
before its last arrival by more than CLOCK_TOLERANCE_US, the clocks are not one (traces from two
hosts): each rank's offset is then the median difference of its ends from the lowest rank's, and
the summary says so.

**The split.** For one call, the last arrival is the latest start among the ranks. A rank that
started earlier waited until then (at most its whole time in the call); the rest of its time is
the transfer. The rank that arrived last is that call's slowest; the spread is the last arrival
less the first.

**Start-up steps** are in the rows, not in the totals: the first matched step (the ranks'
profilers start recording at different moments, and the first collective's wait on the ranks
that started first is that difference, not the host's skew: 164 ms on the H200 fixture, against
1.5 ms per decode step), and each kind's leading steps that the steps' distribution sets apart
(over 1.5x the kind's median: a new shape compiled; on the real CPU tier the first decode step,
38 ms against 0.75, held a 32 ms arrival spread).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kimi_supervisor.analysis.collectives import SPLIT
from kimi_supervisor.analysis.reader import Step
from kimi_supervisor.analysis.sizes import sizes
from kimi_supervisor.analysis.timeline import Timeline, kind_of, leading, percentile

CLOCK_TOLERANCE_US = 20.0
# The profiler-start transient: leading calls whose arrival spread is over this many times the
# capture's median and this floor, while their ends agree within 1/TRANSIENT_FACTOR of it.
TRANSIENT_FACTOR, TRANSIENT_MIN_US = 10.0, 1000.0
MAX_SHIFT = 16  # steps a rank's profiler may have started before or after the lowest rank's
# A per-step row: the step's index in the lowest rank's trace, its kind, its time there, and the
# mean over ranks of its split collectives' time and wait; the rank last most often; whether the
# totals count it (a start-up step is not); the median arrival spread of its calls.
COLUMNS = [
    "step", "kind", "step_ms", "collective_ms", "wait_ms", "last_rank", "counted", "spread_ms"
]  # fmt: skip
PER_STEP_MAX = 5000  # per-step rows kept in the summary (a 100 s capture of 20 ms steps)


@dataclass(frozen=True)
class RankTimeline:
    """One rank's timeline, and the rank its trace's name gives."""

    rank: int
    timeline: Timeline
    host: str = ""  # the host its trace's name gives; "" the capture's own (ranks.host_of)


# The calls of one key in a step: per call, its (start, duration) on each rank in the ranks'
# order, on one time base (the earliest trace's).
PerCall = list[list[tuple[float, float]]]


@dataclass(frozen=True)
class MatchedStep:
    """A step every rank made with the same calls: its name, its index in the lowest rank's
    steps, its calls by key, and each call's message in bytes by key (the largest any rank's
    trace gives, -1 where none does)."""

    name: str
    index: int
    calls: dict[str, PerCall]
    nbytes: dict[str, list[int]]


@dataclass(frozen=True)
class Matching:
    """The ranks' timelines matched step for step (see the module)."""

    steps: list[MatchedStep]
    shifts: list[int]  # per rank: how many steps it is ahead of the lowest rank in its list
    unmatched: int  # the lowest rank's steps that some rank did not make alike


def _signature(tl: Timeline) -> list[tuple[str, tuple[tuple[str, int], ...]]]:
    """Per step: its name and how many calls of each key it made, of the collectives that are
    split (a send or a broadcast, which ranks need not share, never unmatches a step)."""
    counts: list[Counter[str]] = [Counter() for _ in tl.steps]
    for step, key in zip(tl.calls.step, tl.calls.key, strict=True):
        if key.split("@")[0] in SPLIT:
            counts[step][key] += 1
    return [(s.name, tuple(sorted(c.items()))) for s, c in zip(tl.steps, counts, strict=True)]


def _shift(ref: Timeline, other: Timeline, offset_us: float) -> int:
    """How many steps `other` is ahead of `ref` in its list (see the module)."""
    a, b = _signature(ref), _signature(other)
    best: tuple[int, float, int] | None = None
    for s in range(-min(MAX_SHIFT, len(a)), min(MAX_SHIFT, len(b)) + 1):
        pairs = [(i, i + s) for i in range(len(a)) if 0 <= i + s < len(b) and a[i] == b[i + s]]
        if not pairs:
            continue
        gap = statistics.median(
            abs(ref.steps[i].start - (other.steps[j].start + offset_us)) for i, j in pairs
        )
        score = (-len(pairs), gap, abs(s))
        if best is None or score < (best[0], best[1], abs(best[2])):
            best = (-len(pairs), gap, s)
    return best[2] if best else 0


def _calls_by_step(tl: Timeline) -> dict[int, dict[str, list[tuple[float, float, int]]]]:
    out: dict[int, dict[str, list[tuple[float, float, int]]]] = {}
    c = tl.calls
    for step, key, t, d, b in zip(c.step, c.key, c.start, c.dur, c.nbytes, strict=True):
        out.setdefault(step, {}).setdefault(key, []).append((t, d, b))
    return out


def match(ranks: list[RankTimeline]) -> Matching:
    """The matched steps of the ranks' timelines (lowest rank first), the ranks' shifts, and the
    steps left unmatched."""
    timelines = [r.timeline for r in ranks]
    ref, others = timelines[0], timelines[1:]
    base = min(tl.base_ns for tl in timelines)
    offsets = [(tl.base_ns - base) / 1000 for tl in timelines]
    shifts = [0] + [_shift(ref, tl, offsets[i + 1] - offsets[0]) for i, tl in enumerate(others)]
    sigs = [_signature(tl) for tl in timelines]
    by_step = [_calls_by_step(tl) for tl in timelines]
    steps: list[MatchedStep] = []
    unmatched = 0
    for i, sig in enumerate(sigs[0]):
        idx = [i + s for s in shifts]
        if not all(0 <= j < len(sg) and sg[j] == sig for j, sg in zip(idx, sigs, strict=True)):
            unmatched += 1
            continue
        calls: dict[str, PerCall] = {}
        nbytes: dict[str, list[int]] = {}
        for key, _n in sig[1]:
            per_rank = [by_step[k][idx[k]][key] for k in range(len(ranks))]
            matched = list(zip(*per_rank, strict=True))
            calls[key] = [[(t + offsets[k], d) for k, (t, d, _b) in enumerate(c)] for c in matched]
            nbytes[key] = [max(b for _t, _d, b in c) for c in matched]
        steps.append(MatchedStep(sig[0], i, calls, nbytes))
    return Matching(steps, shifts, unmatched)


def _clock(steps: list[MatchedStep], names: list[int], hosts: list[str]) -> tuple[list[float], str]:
    """Each rank's clock offset to add (µs) and how it was found (see the module): none on one
    host; across hosts, per host, the median of its ranks' ends less the lowest rank's, stated
    with its bound and never larger than the arrival spread it would explain away."""
    n = len(names)
    if len(set(hosts)) <= 1:
        return [0.0] * n, "one host: the ranks share its clock, no correction"
    late: list[float] = []
    spread: list[float] = []
    diffs: list[list[float]] = [[] for _ in range(n)]
    for step in steps:
        for per_call in step.calls.values():
            for call in per_call:
                last = max(t for t, _d in call)
                late.append(last - min(t + d for t, d in call))
                spread.append(last - min(t for t, _d in call))
                end0 = call[0][0] + call[0][1]
                for k, (t, d) in enumerate(call):
                    diffs[k].append(end0 - (t + d))
    if not late or statistics.median(late) <= CLOCK_TOLERANCE_US:
        return [0.0] * n, "hosts' clocks agree (the collectives' ends agree), no correction"
    cap = statistics.median(spread)
    offsets = [0.0] * n
    said: list[str] = []
    for host in dict.fromkeys(hosts):
        ks = [k for k in range(n) if hosts[k] == host]
        if host == hosts[0]:
            continue
        ends = sorted(x for k in ks for x in diffs[k])
        mid = statistics.median(ends)
        bound = (percentile(ends, 75) - percentile(ends, 25)) / 2
        capped = max(-cap, min(cap, mid))
        for k in ks:
            offsets[k] = capped
        note = " (capped at the arrival spread)" if capped != mid else ""
        said.append(f"{host} {capped / 1000:+.3f} ms ± {bound / 1000:.3f}{note}")
    return offsets, (
        f"{len(set(hosts))} hosts, aligned by the collectives' ends to {hosts[0] or 'this host'}: "
        + ", ".join(said)
    )


def _transient(
    steps: list[MatchedStep], offsets: list[float]
) -> tuple[set[int], dict[str, Any] | None]:
    """The matched steps (positions) of the profiler-start transient: the leading calls whose
    arrival spread is over TRANSIENT_FACTOR x the capture's median and TRANSIENT_MIN_US, while
    their ends agree within 1/TRANSIENT_FACTOR of that spread (the ranks that started their
    profiler first waited for the others' to start); and what was trimmed."""
    calls: list[tuple[int, float, float]] = []  # (position, entry spread, exit spread)
    for pos, step in enumerate(steps):
        for per_call in sorted(step.calls.values(), key=lambda pc: min(t for t, _ in pc[0])):
            for call in per_call:
                starts = [t + offsets[k] for k, (t, _d) in enumerate(call)]
                ends = [t + d + offsets[k] for k, (t, d) in enumerate(call)]
                calls.append((pos, max(starts) - min(starts), max(ends) - min(ends)))
    if not calls:
        return set(), None
    floor = max(TRANSIENT_MIN_US, TRANSIENT_FACTOR * statistics.median(c[1] for c in calls))
    n = 0
    while (
        n < len(calls) - 1 and calls[n][1] > floor and calls[n][2] * TRANSIENT_FACTOR < calls[n][1]
    ):
        n += 1
    if not n:
        return set(), None
    return {c[0] for c in calls[:n]}, {
        "calls": n,
        "entry_spread_ms": round(max(c[1] for c in calls[:n]) / 1000, 3),
        "exit_spread_ms": round(max(c[2] for c in calls[:n]) / 1000, 4),
        "threshold_ms": round(floor / 1000, 3),
    }


def split(ranks: list[RankTimeline]) -> dict[str, Any] | None:
    """The wait/transfer split of a capture's ranks' timelines, lowest rank first; None with
    fewer than two ranks. Per step kind and collective: per rank and on average, the time per step
    in calls, waiting and moving data, its share of the step, the rank that arrived last most
    often, and the spread of arrivals; and a row per step."""
    if len(ranks) < 2:
        return None
    m = match(ranks)
    n = len(ranks)
    names = [r.rank for r in ranks]
    offsets, clock = _clock(m.steps, names, [r.host for r in ranks])
    trimmed, transient = _transient(m.steps, offsets)
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    step_ms: dict[str, list[float]] = {}
    rows: list[list[Any]] = []
    ref_steps = ranks[0].timeline.steps
    startup = _startup(m.steps, ref_steps) | trimmed
    for pos, matched in enumerate(m.steps):
        i, calls = matched.index, matched.calls
        kind = kind_of(matched.name)
        ms = (ref_steps[i].end - ref_steps[i].start) / 1000
        counted = pos not in startup
        if counted:
            step_ms.setdefault(kind, []).append(ms)
        row_wait = row_total = 0.0
        row_last: Counter[int] = Counter()
        row_spread: list[float] = []
        for key, per_call in calls.items():  # split collectives only (see _signature)
            coll = key.split("@")[0]
            # A start-up step's figures go to its row only, in a bin nobody reports.
            a = acc.setdefault((kind if counted else "", coll), _new(n))
            for call, nbytes in zip(per_call, matched.nbytes[key], strict=True):
                starts = [t + offsets[k] for k, (t, _d) in enumerate(call)]
                last = max(starts)
                a["spread"].append(last - min(starts))
                row_spread.append(last - min(starts))
                late = starts.index(last)
                a["last"][late] += 1
                row_last[late] += 1
                if n > 1:  # by how much the last rank came after the next latest
                    a["by"].setdefault(late, []).append(last - sorted(starts)[-2])
                shortest = min(d for _t, d in call)
                moving: list[float] = []
                for k, (_t, d) in enumerate(call):
                    a["short_wait"][k] += d - shortest
                    wait = min(max(last - starts[k], 0.0), d)
                    a["total"][k] += d
                    a["wait"][k] += wait
                    moving.append(d - wait)
                    row_wait += wait / n
                    row_total += d / n
                if nbytes >= 0:  # the call's transfer: the median rank's time after the last came
                    a["sizes"].append((nbytes, statistics.median(moving)))
                else:
                    a["unsized"] += 1
        for coll in {key.split("@")[0] for key in calls}:
            acc[(kind if counted else "", coll)]["steps"] += 1
        last_rank = names[row_last.most_common(1)[0][0]] if row_last else None
        rows.append(
            [
                i,
                kind,
                round(ms, 3),
                round(row_total / 1000, 3),
                round(row_wait / 1000, 3),
                last_rank,
                counted,
                round(statistics.median(row_spread) / 1000, 4) if row_spread else 0.0,
            ]
        )
    kinds: dict[str, Any] = {}
    for kind, times in step_ms.items():
        per_coll = {
            coll: _report(a, step_ms[kind], names, coll=coll)
            for (k, coll), a in sorted(acc.items())
            if k == kind and a["steps"]
        }
        kinds[kind] = {
            "steps": len(times),
            "step_ms": round(statistics.mean(times), 3),
            "collectives": per_coll,
        }
    return {
        "ranks": names,
        "clock": clock,
        "matched_steps": len(m.steps),
        "startup_steps": len(startup),
        "transient": transient,
        "unmatched_steps": m.unmatched,
        "shifts": dict(zip(map(str, names), m.shifts, strict=True)),
        "kinds": kinds,
        "per_step": {
            "columns": COLUMNS,
            "rows": rows[:PER_STEP_MAX],
            "left_out": max(len(rows) - PER_STEP_MAX, 0),
        },
    }


def _startup(steps: list[MatchedStep], ref_steps: list[Step]) -> set[int]:
    """The positions of the matched steps left out of the totals: the first (the profilers'
    start), and each kind's leading start-up steps by the lowest rank's step times (the rule of
    the steps' distribution, timeline.leading)."""
    out = {0} if steps else set()
    by_kind: dict[str, list[int]] = {}
    for pos, step in enumerate(steps[1:], start=1):
        by_kind.setdefault(kind_of(step.name), []).append(pos)
    for positions in by_kind.values():
        ms = [ref_steps[steps[p].index].end - ref_steps[steps[p].index].start for p in positions]
        out.update(positions[: leading(ms)])
    return out


def _new(n: int) -> dict[str, Any]:
    return {
        "steps": 0,
        "total": [0.0] * n,
        "wait": [0.0] * n,
        "short_wait": [0.0] * n,
        "last": Counter(),
        "spread": [],
        "by": {},
        "sizes": [],
        "unsized": 0,
    }


def _report(
    a: dict[str, Any], step_ms: list[float], names: list[int], *, coll: str
) -> dict[str, Any]:
    """One collective of one step kind, as summary.json carries it (ms per step)."""
    steps = len(step_ms)
    per_rank = []
    for k, rank in enumerate(names):
        total, wait = a["total"][k] / steps / 1000, a["wait"][k] / steps / 1000
        per_rank.append(
            {
                "rank": rank,
                "ms_per_step": round(total, 3),
                "wait_ms": round(wait, 3),
                "transfer_ms": round(total - wait, 3),
            }
        )
    mean = statistics.mean(step_ms)
    total = statistics.mean(r["ms_per_step"] for r in per_rank)
    wait = statistics.mean(r["wait_ms"] for r in per_rank)
    calls = sum(a["last"].values())
    slowest = a["last"].most_common(1)
    spread = sorted(a["spread"])
    last = (
        {
            "rank": names[slowest[0][0]],
            "share": round(slowest[0][1] / calls, 4),
            # the median call it was last of: how long after the next latest rank it came
            "by_ms": round(statistics.median(a["by"].get(slowest[0][0]) or [0.0]) / 1000, 4),
            "calls": calls,
            "shares": {str(names[k]): round(c / calls, 4) for k, c in sorted(a["last"].items())},
        }
        if slowest and calls
        else None
    )
    short = statistics.mean(a["short_wait"]) / steps / 1000
    agrees = abs(short - wait) <= max(AGREE_SHARE * max(wait, short), AGREE_MS)
    return {
        "verdict": verdict(wait / total if total else 0.0, last, percentile(spread, 50) / 1000),
        "cross_check": {
            "rule": "shortest duration across the ranks is the transfer (TraceLens)",
            "wait_ms": round(short, 3),
            "transfer_ms": round(total - short, 3),
            "agrees": agrees,
        },
        "calls_per_step": round(len(spread) / steps, 2),
        "ms_per_step": round(total, 3),
        "wait_ms": round(wait, 3),
        "transfer_ms": round(total - wait, 3),
        "share_of_step": round(total / mean, 4) if mean else 0.0,
        "wait_share": round(wait / total, 4) if total else 0.0,
        "last_to_arrive": last,
        "arrival_spread_ms": {
            "p50": round(percentile(spread, 50) / 1000, 4),
            "p90": round(percentile(spread, 90) / 1000, 4),
            "max": round(spread[-1] / 1000, 4) if spread else 0.0,
        },
        "per_rank": per_rank,
        "sizes": sizes(a["sizes"], a["unsized"], coll=coll, ranks=len(names)),
    }


# The verdicts' thresholds (docs/operations.md, "Reading the split"): one rank last in at least
# SLOW_SHARE of the calls, arriving SLOW_SPREAD_MS or more after the first at the median call, is
# one slow rank; else a wait of WAITING of the time or more is jitter; else moving data. The
# split and the shortest-duration rule agree when their waits are within AGREE_SHARE or AGREE_MS.
SLOW_SHARE, SLOW_SPREAD_MS, WAITING = 0.8, 0.05, 0.5
AGREE_SHARE, AGREE_MS = 0.1, 0.05


def verdict(wait_share: float, last: dict[str, Any] | None, spread_p50_ms: float) -> dict[str, Any]:
    """One collective's reading: "one slow rank" (with the rank), "jitter" or "moving data",
    and the thresholds it was read by."""
    if last and last["share"] >= SLOW_SHARE and spread_p50_ms >= SLOW_SPREAD_MS:
        reading, rank = "one slow rank", last["rank"]
    else:
        reading, rank = ("jitter" if wait_share >= WAITING else "moving data"), None
    return {
        "reading": reading,
        "rank": rank,
        "thresholds": {
            "slow_rank_last_share": SLOW_SHARE,
            "slow_rank_spread_p50_ms": SLOW_SPREAD_MS,
            "waiting_share": WAITING,
        },
    }
