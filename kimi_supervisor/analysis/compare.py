"""Two captures' summaries side by side (`kimi-mode capture --compare A B`): the same step kind,
per class, per top kernel and for the wait/transfer split, each with its delta, and a plain
verdict on what changed most.

Figures per step are the mean over the ranks. A change smaller than the noise floor (NOISE_MS, or
NOISE_SHARE of A's step, whichever is larger) is not a verdict: two captures of one unchanged
host differ by that much.
"""

from __future__ import annotations

import statistics
from typing import Any

from kimi_supervisor.analysis.collectives import SPLIT

NOISE_MS, NOISE_SHARE = 0.05, 0.02
TOP = 8
# What a change of each figure suggests, down then up (the verdict's words).
MEANING = {
    "wait": ("the skew went down", "the skew went up"),
    "transfer": ("the data moves faster", "the data moves slower"),
    "compute": ("compute got faster", "compute got slower"),
}


class CompareError(ValueError):
    """Two summaries that cannot be compared, with what to do."""


def _kind(summary: dict[str, Any]) -> str | None:
    scopes = {r.get("scope") for r in summary.get("ranks", [])}
    for kind in ("decode", "prefill", "step"):
        if f"{kind} steps" in scopes or (kind == "step" and "all steps" in scopes):
            return kind
    return None


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else 0.0


def _figures(summary: dict[str, Any], kind: str) -> dict[str, float]:
    ranks = summary["ranks"]
    out: dict[str, float] = {}
    steps = [r["step_times"][kind] for r in ranks if kind in (r.get("step_times") or {})]
    for p in ("p50", "p90", "p99"):
        out[f"step {p}"] = _mean([s[p] for s in steps])
    for cls in ("communication", "gemm", "attention", "other"):
        out[cls] = _mean([r["classes"][cls]["ms_per_step"] for r in ranks])
    out["compute"] = out["gemm"] + out["attention"] + out["other"]
    split = ((summary.get("across_ranks") or {}).get("kinds") or {}).get(kind) or {}
    for coll, v in (split.get("collectives") or {}).items():
        if coll in SPLIT:
            label = coll.replace("_", "-")
            out[label] = v["ms_per_step"]
            out[f"{label} wait"] = v["wait_ms"]
            out[f"{label} transfer"] = v["transfer_ms"]
            out[f"{label} arrival spread p50"] = v["arrival_spread_ms"]["p50"]
    return out


def _tops(summary: dict[str, Any]) -> dict[str, float]:
    per: dict[str, list[float]] = {}
    for r in summary["ranks"]:
        for t in r.get("top", []):
            per.setdefault(t["name"], []).append(t["ms_per_step"])
    n = max(len(summary["ranks"]), 1)
    return {name: sum(v) / n for name, v in per.items()}


def _typical(summary: dict[str, Any], kind: str) -> str | None:
    """The step name most ranks ran most often, e.g. execute_context_0(0)_generation_16(16):
    sixteen decode requests per step."""
    names = [(r.get("step_times") or {}).get(kind, {}).get("typical") for r in summary["ranks"]]
    named = [n for n in names if n]
    return max(set(named), key=named.count) if named else None


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The comparison (see the module); raises CompareError."""
    for label, s in (("A", a), ("B", b)):
        if not s.get("ranks"):
            raise CompareError(f"{label} has no summarized rank: is it a capture's folder?")
    kind_a, kind_b = _kind(a), _kind(b)
    if kind_a != kind_b or kind_a is None:
        raise CompareError(
            f"A's summary is of {kind_a or 'no'} steps and B's of {kind_b or 'no'} steps: "
            "compare two captures of the same load (decode steps, both)"
        )
    kind = kind_a
    fa, fb = _figures(a, kind), _figures(b, kind)
    rows = [
        {
            "what": k,
            "a": round(fa[k], 3),
            "b": round(fb.get(k, 0.0), 3),
            "delta": round(fb.get(k, 0.0) - fa[k], 3),
        }
        for k in fa
    ]
    ta, tb = _tops(a), _tops(b)
    names = sorted(set(ta) | set(tb), key=lambda n: -max(ta.get(n, 0.0), tb.get(n, 0.0)))[:TOP]
    top = [
        {
            "what": n,
            "a": round(ta.get(n, 0.0), 3),
            "b": round(tb.get(n, 0.0), 3),
            "delta": round(tb.get(n, 0.0) - ta.get(n, 0.0), 3),
        }
        for n in names
    ]
    notes = []
    if len(a["ranks"]) != len(b["ranks"]):
        notes.append(f"A has {len(a['ranks'])} ranks and B {len(b['ranks'])}")
    if (ka := _typical(a, kind)) != (kb := _typical(b, kind)) and ka and kb:
        notes.append(f"not the same load: A's typical {kind} step is {ka}, B's {kb}")
    if {r["device"] for r in a["ranks"]} != {r["device"] for r in b["ranks"]}:
        notes.append("A and B ran on different devices (GPU kernels against CPU operators)")
    return {
        "kind": kind,
        "rows": rows,
        "top": top,
        "verdict": verdict(fa, fb, kind),
        "notes": notes,
    }


def verdict(fa: dict[str, float], fb: dict[str, float], kind: str) -> str:
    """What changed most, in words: the collectives' wait, their transfer, or the compute.

    Wait and transfer are each summed over the collectives of a step: a rank late before each
    of them adds its delay to every one's wait, while one collective's transfer moving by
    chance is one figure. Judged one collective at a time, a 1 ms skew before three
    collectives read as "the data moves slower" on real gloo traces (issue 43). The wait is
    then told with the collective whose arrival spread grew most: the skew itself."""
    noise = max(NOISE_MS, NOISE_SHARE * fa.get("step p50", 0.0))
    totals: dict[str, float] = {"compute": fb["compute"] - fa["compute"]}
    split = [
        (f"{coll.replace('_', '-')} {part}", part)
        for coll in SPLIT
        for part in ("wait", "transfer")
    ]
    for key, part in split:
        if key in fa and key in fb:
            totals[part] = totals.get(part, 0.0) + fb[key] - fa[key]
    part, delta = max(totals.items(), key=lambda c: abs(c[1]))
    step = fb["step p50"] - fa["step p50"]
    head = f"{kind} step p50 {step:+.2f} ms ({_rel(step, fa['step p50'])})"
    if abs(delta) < noise:
        return f"{head}; nothing moved by more than the noise floor ({noise:.2f} ms per step)"
    meaning = MEANING[part][delta > 0]
    if part == "compute":
        return f"{head}; compute {delta:+.2f} ms per step: {meaning}"
    where = [key for key, p in split if p == part and key in fa and key in fb]
    said = "the collectives' " + part if len(where) > 1 else where[0]
    if part == "wait":  # the skew itself: how much later the last rank arrives, per call
        spreads = {
            name: fb.get(name, 0.0) - fa.get(name, 0.0)
            for name in (f"{key.split()[0]} arrival spread p50" for key in where)
        }
        spread, grew = max(spreads.items(), key=lambda c: c[1] if delta > 0 else -c[1])
        return (
            f"{head}; {meaning} by {grew:+.3f} ms per call ({spread}), {said} "
            f"{delta:+.2f} ms per step"
        )
    return f"{head}; {said} {delta:+.2f} ms per step: {meaning}"


def _rel(delta: float, base: float) -> str:
    return f"{delta / base * 100:+.0f} %" if base else "new"
