"""An A/B of rounds taken in turn, judged against its own noise.

Each arm's rounds alternate with the other's, so a drift of the host hits both. The figure is the
median of the paired ratios (B's round over the A round beside it); the noise is a 95 % bootstrap
interval of that median (a fixed seed, so a rerun on the same numbers says the same). The verdict
says "costs" or "gains" only where the whole interval lies on one side of 1.0, and "within the
noise" otherwise. The same arithmetic on A against itself (its even rounds against its odd ones)
is reported beside it, so a reader sees what the method calls a difference where there is none.

Standard library only: the GPU host runs it with nothing but torch installed.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

RESAMPLES = 2000
SEED = 45


def _interval(ratios: list[float]) -> tuple[float, float]:
    rng = random.Random(SEED)
    n = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(RESAMPLES))
    return meds[int(0.025 * RESAMPLES)], meds[int(0.975 * RESAMPLES) - 1]


def paired(a: list[float], b: list[float], higher_is_better: bool) -> dict[str, Any]:
    """B against A, round by round: a's i-th round and b's i-th round were taken side by side."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need paired rounds, at least 2 per arm: {len(a)} and {len(b)}")
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    med = statistics.median(ratios)
    lo, hi = _interval(ratios)
    # "cost": the share of A's performance B loses (a time: B longer; a rate: B lower).
    cost = (1 - med) if higher_is_better else (med - 1)
    if lo > 1.0 or hi < 1.0:
        worse = (hi < 1.0) if higher_is_better else (lo > 1.0)
        verdict = "costs" if worse else "gains"
    else:
        verdict = "within the noise"
    return {
        "rounds": len(a),
        "a_median": statistics.median(a),
        "b_median": statistics.median(b),
        "ratio_median": round(med, 5),
        "ratio_95": [round(lo, 5), round(hi, 5)],
        "cost_pct": round(cost * 100, 2),
        "b_worse_in": sum((r < 1.0) if higher_is_better else (r > 1.0) for r in ratios),
        "verdict": verdict,
    }


def self_check(a: list[float], higher_is_better: bool) -> dict[str, Any]:
    """A against itself: its even rounds against its odd ones (the method's own false alarm)."""
    n = len(a) // 2
    return paired(a[0 : 2 * n : 2], a[1 : 2 * n : 2], higher_is_better)


def sentence(name: str, p: dict[str, Any], unit: str) -> str:
    lo, hi = p["ratio_95"]
    cost = p["cost_pct"]
    what = {"costs": f"costs {cost:.2f} %", "gains": f"gains {-cost:.2f} %",
            "within the noise": f"within the noise ({cost:+.2f} %)"}[p["verdict"]]  # fmt: skip
    n = p["rounds"]
    return (
        f"{name}: {what}; median {unit} {p['b_median']:.4g} against {p['a_median']:.4g}, "
        f"paired ratio {p['ratio_median']:.4f} (95 % interval {lo:.4f}–{hi:.4f}, "
        f"{n} rounds per arm; worse in {p['b_worse_in']} of {n})"
    )
