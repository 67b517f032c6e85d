"""The truth of a real gloo capture (tests/fixtures/make_gloo_trace.py's truth.json), as the
capture summary's split states it: per collective, each rank's wait in ms per step over the
steps the summary counts, the share of calls the delayed rank entered last, and the arrival
spread p50. The ranks share the host's clock: a call's wait on a rank is the latest entry less
its own (`time.time_ns()` just before each call, outside the profiler)."""

from __future__ import annotations

import statistics
from typing import Any

from kimi_supervisor.analysis.sizes import BUS


def truth_of(truth: dict[str, Any], counted: set[int]) -> dict[str, Any]:
    """The truth over the counted steps, per collective: each rank's wait (ms per step), the
    share of calls whose last entry is the late rank's, and the arrival spread p50 (ms)."""
    ranks = sorted(truth["calls"], key=int)
    out: dict[str, Any] = {}
    per_rank = [truth["calls"][r] for r in ranks]
    for kind in truth["kinds"]:
        calls = [[c for c in calls if c[1] == kind and c[0] in counted] for calls in per_rank]
        waits = [0.0] * len(ranks)
        last, spreads = 0, []
        for call in zip(*calls, strict=True):
            enters = [c[2] for c in call]
            latest = max(enters)
            for k, e in enumerate(enters):
                waits[k] += (latest - e) / 1e6
            last += enters.index(latest) == len(ranks) - 1
            spreads.append((latest - min(enters)) / 1e6)
        n = len(counted)
        out[kind] = {
            "wait_ms": [w / n for w in waits],
            "late_share": last / max(len(spreads), 1),
            "spread_p50_ms": statistics.median(spreads) if spreads else 0.0,
        }
    return out


def truth_busbw(truth: dict[str, Any], counted: set[int]) -> dict[str, dict[int, float]]:
    """Per collective and size, the truth's bus bandwidth (GB/s, nccl-tests' definition): over
    the counted calls, the median of bytes / (the median rank's exit less the latest entry) x
    the collective's bus factor."""
    per_rank = [truth["calls"][r] for r in sorted(truth["calls"], key=int)]
    out: dict[str, dict[int, float]] = {}
    for kind in truth["kinds"]:
        calls = [[c for c in cs if c[1] == kind and c[0] in counted] for cs in per_rank]
        by: dict[int, list[float]] = {}
        for call in zip(*calls, strict=True):
            latest = max(c[2] for c in call)
            t_us = statistics.median((c[3] - latest) / 1000 for c in call)
            by.setdefault(call[0][4], []).append(
                call[0][4] / t_us / 1e3 * BUS[kind][0](len(per_rank))
            )
        out[kind] = {b: statistics.median(v) for b, v in by.items()}
    return out
