"""Two captures' summaries side by side (`kimi-mode capture --compare A B`): the same step kind,
per class, per top kernel and for the wait/transfer split, each with its delta, and a plain
verdict on what changed.

Figures per step are the mean over the ranks. A change is said only past its noise floor: the
larger of NOISE_MS, NOISE_SHARE of A's step, and NOISE_SE standard errors of the difference of
the two captures' means, measured from their own step-to-step spread (the summary's per-step
rows). Two back-to-back captures of one unchanged 2-CPU host differed by 1.1 to 1.85 ms of
transfer per step; a fixed floor of 2 % called that "the data moves faster" (issue 43's review).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from kimi_supervisor.analysis.collectives import SPLIT

NOISE_MS, NOISE_SHARE = 0.05, 0.02
NOISE_SE = 3.0  # standard errors of a difference of means: a chance move passes 1 in 370
MIN_STEPS = 5  # fewer steps on a side: no spread to measure, the fixed floor alone
TOP = 8
# What a change of each figure suggests, down then up (the verdict's words).
MEANING = {
    "wait": ("the skew went down", "the skew went up"),
    "transfer": ("the data moves faster", "the data moves slower"),
    "compute": ("compute got faster", "compute got slower"),
}
PARTS = ("wait", "transfer", "compute")


class CompareError(ValueError):
    """Two summaries that cannot be compared, with what to do."""


def _num(value: Any, where: str) -> float:
    """A figure of a summary: a finite number, else CompareError naming where."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CompareError(f"{where} is {value!r}, not a finite number")
    return float(value)


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
        out[f"step {p}"] = _mean([_num(s[p], f"a rank's step {p}") for s in steps])
    for cls in ("communication", "gemm", "attention", "other"):
        out[cls] = _mean([_num(r["classes"][cls]["ms_per_step"], f"a rank's {cls}") for r in ranks])
    out["compute"] = out["gemm"] + out["attention"] + out["other"]
    for coll, v in _split_of(summary, kind).items():
        if coll in SPLIT:
            label = coll.replace("_", "-")
            out[label] = _num(v["ms_per_step"], f"{label} ms per step")
            out[f"{label} wait"] = _num(v["wait_ms"], f"{label} wait")
            out[f"{label} transfer"] = _num(v["transfer_ms"], f"{label} transfer")
            spread = _num(v["arrival_spread_ms"]["p50"], f"{label} arrival spread p50")
            out[f"{label} arrival spread p50"] = spread
    return out


def _split_of(summary: dict[str, Any], kind: str) -> dict[str, Any]:
    split = ((summary.get("across_ranks") or {}).get("kinds") or {}).get(kind) or {}
    collectives = split.get("collectives") or {}
    if not isinstance(collectives, dict):
        raise CompareError(f"its {kind} collectives are {type(collectives).__name__}, not a table")
    return collectives


def _series(summary: dict[str, Any], kind: str) -> dict[str, list[float]]:
    """Each part's figure step by step (the cross-rank per-step rows, counted steps of `kind`):
    the wait, the transfer (the collectives' time less their wait) and the rest of the step.
    Empty where the summary has no such rows."""
    table = (summary.get("across_ranks") or {}).get("per_step") or {}
    columns = table.get("columns") or []
    need = ("kind", "step_ms", "collective_ms", "wait_ms", "counted")
    if not isinstance(columns, list) or not all(c in columns for c in need):
        return {}
    at = {c: columns.index(c) for c in need}
    out: dict[str, list[float]] = {part: [] for part in PARTS}
    for row in table.get("rows") or []:
        if not isinstance(row, list) or len(row) < len(columns):
            raise CompareError("a per-step row is not a row of its columns")
        if row[at["kind"]] != kind or not row[at["counted"]]:
            continue
        step = _num(row[at["step_ms"]], "a step's time")
        collective = _num(row[at["collective_ms"]], "a step's collectives")
        wait = _num(row[at["wait_ms"]], "a step's wait")
        out["wait"].append(wait)
        out["transfer"].append(collective - wait)
        out["compute"].append(step - collective)
    return out


def malformed(summary: dict[str, Any]) -> str | None:
    """Why a summary (a summary.json read from a folder) cannot be compared, or None: the
    figures the comparison reads, each a finite number where a number goes."""
    try:
        if not isinstance(summary.get("ranks"), list):
            return "it has no list of ranks"
        kind = _kind(summary)
        if kind is not None:
            _figures(summary, kind)
            _series(summary, kind)
            _tops(summary)
            _typical(summary, kind)
            # Each device and rank hashable, as compare() makes sets of them.
            {r["device"] for r in summary["ranks"]}
            errors = summary.get("errors") or []
            if not isinstance(errors, list):
                return "its errors are not a list"
            {e.get("rank") for e in errors if isinstance(e, dict)}
    except CompareError as e:
        return str(e)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _tops(summary: dict[str, Any]) -> dict[str, float]:
    per: dict[str, list[float]] = {}
    for r in summary["ranks"]:
        for t in r.get("top") or []:
            per.setdefault(str(t["name"]), []).append(_num(t["ms_per_step"], "a kernel's time"))
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
        why = malformed(s)
        if why is not None:
            raise CompareError(
                f"{label}'s summary cannot be read ({why}): make it again with "
                "`kimi-mode capture --summarize FOLDER`"
            )
    kind_a, kind_b = _kind(a), _kind(b)
    if kind_a != kind_b or kind_a is None:
        raise CompareError(
            f"A's summary is of {kind_a or 'no'} steps and B's of {kind_b or 'no'} steps: "
            "compare two captures of the same load (decode steps, both)"
        )
    kind = kind_a
    fa, fb = _figures(a, kind), _figures(b, kind)
    # Every figure of either side; one that a side lacks is None there, never a 0 (a split
    # missing from B read as "B waited 0 ms").
    rows = [
        {
            "what": k,
            "a": round(fa[k], 3) if k in fa else None,
            "b": round(fb[k], 3) if k in fb else None,
            "delta": round(fb[k] - fa[k], 3) if k in fa and k in fb else None,
        }
        for k in [*fa, *(k for k in fb if k not in fa)]
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
    ca = {c for c in _split_of(a, kind) if c in SPLIT}
    cb = {c for c in _split_of(b, kind) if c in SPLIT}
    if ca != cb:
        only = [f"only {label} has {', '.join(sorted(x))}" for label, x in (("A", ca - cb),
                ("B", cb - ca)) if x]  # fmt: skip
        notes.append(
            f"the collectives split across ranks differ ({'; '.join(only) or 'none'}): those "
            "are not compared"
        )
    for label, s in (("A", a), ("B", b)):
        lost = sorted({e.get("rank") for e in s.get("errors") or [] if isinstance(e, dict)},
                      key=str)  # fmt: skip
        if lost:
            notes.append(
                f"{label}: rank(s) {', '.join(map(str, lost))} could not be read; its figures "
                "are of the others"
            )
    if (ka := _typical(a, kind)) != (kb := _typical(b, kind)) and ka and kb:
        notes.append(f"not the same load: A's typical {kind} step is {ka}, B's {kb}")
    if {r["device"] for r in a["ranks"]} != {r["device"] for r in b["ranks"]}:
        notes.append("A and B ran on different devices (GPU kernels against CPU operators)")
    # The per-step rows sum every collective of a step: only where both have the same ones
    # do they measure what the verdict compares (else the fixed floors and the means).
    same = ca == cb
    said = verdict(fa, fb, kind, _series(a, kind) if same else None,
                   _series(b, kind) if same else None)  # fmt: skip
    if len(a["ranks"]) != len(b["ranks"]):
        said = (
            f"not like for like, A has {len(a['ranks'])} ranks and B {len(b['ranks'])} (the "
            f"arrival spread grows with the ranks): {said}"
        )
    return {"kind": kind, "rows": rows, "top": top, "verdict": said, "notes": notes}


def _floor(base: float, a: list[float] | None, b: list[float] | None, robust: bool) -> float:
    """A part's noise floor: `base`, or NOISE_SE standard errors of the difference of the two
    captures' means (of their medians where `robust`), whichever is larger."""
    if not a or not b or len(a) < MIN_STEPS or len(b) < MIN_STEPS:
        return base

    def se2(x: list[float]) -> float:
        if robust:  # a median's: 1.253 sigma / sqrt(n), sigma from the median absolute deviation
            m = statistics.median(x)
            sigma = 1.4826 * statistics.median(abs(v - m) for v in x)
            return (1.253 * sigma) ** 2 / len(x)
        return statistics.variance(x) / len(x)

    return max(base, NOISE_SE * math.sqrt(se2(a) + se2(b)))


def verdict(
    fa: dict[str, float],
    fb: dict[str, float],
    kind: str,
    sa: dict[str, list[float]] | None = None,
    sb: dict[str, list[float]] | None = None,
) -> str:
    """What changed, in words: the collectives' wait (the skew), their transfer, the compute;
    every one past its noise floor, the largest first. `sa` and `sb` are the captures' per-step
    series (`_series`): without them each floor is the fixed one.

    Wait and transfer are each summed over the collectives of a step: a rank late before each
    of them adds its delay to every one's wait, while one collective's transfer moving by
    chance is one figure. Judged one collective at a time, a 1 ms skew before three
    collectives read as "the data moves slower" on real gloo traces (issue 43). Only the
    largest change was said before, so a skew the size of one chance move of the transfer went
    unsaid: with 2 ranks the wait, a mean over the ranks, grows by half the delay.

    The wait is judged by its median over the steps where the steps are known: a mean that one
    slow step carries (a control whose median wait was 0.19 ms and mean 1.61) read as "the wait
    went down" against a real 1 ms skew. The skew is said when the arrival spread, the skew
    itself, moved by more than NOISE_MS per call (in every collective where there are fewer
    than three: the median of two is their mean, and one's chance move then reads as a skew of
    half of it; by its median over three or more), and that wait moved the same way by more
    than NOISE_MS (`_wait_reading`)."""
    sa, sb = sa or {}, sb or {}
    base = max(NOISE_MS, NOISE_SHARE * fa.get("step p50", 0.0))
    split = [
        (f"{coll.replace('_', '-')} {part}", part)
        for coll in SPLIT
        for part in ("wait", "transfer")
    ]
    totals: dict[str, float] = {"compute": fb["compute"] - fa["compute"]}
    for key, part in split:
        if key in fa and key in fb:
            totals[part] = totals.get(part, 0.0) + fb[key] - fa[key]
    median_wait = bool(totals.get("wait") is not None and sa.get("wait") and sb.get("wait"))
    if median_wait:
        totals["wait"] = statistics.median(sb["wait"]) - statistics.median(sa["wait"])
    floors = {part: _floor(base, sa.get(part), sb.get(part), part == "wait") for part in PARTS}
    step = fb["step p50"] - fa["step p50"]
    head = f"{kind} step p50 {step:+.2f} ms ({_rel(step, fa['step p50'])})"
    said = []
    for part, delta in sorted(totals.items(), key=lambda c: -abs(c[1])):
        keys = [k for k, p in split if p == part and k in fa and k in fb]
        past = round(abs(delta), 3) >= round(floors[part], 3)
        if part == "wait":
            reading = _wait_reading(delta, fa, fb, keys, median_wait, past)
            if reading:
                said.append(reading)
        elif past:
            said.append(_reading(part, delta, keys))
    if not said:
        floor = ", ".join(f"{part} {floors[part]:.2f}" for part in PARTS if part in totals)
        return f"{head}; nothing moved past its noise floor (ms per step: {floor})"
    return f"{head}; " + "; and ".join(said)


def _reading(part: str, delta: float, keys: list[str]) -> str:
    """The transfer's or the compute's change in words."""
    meaning = MEANING[part][delta > 0]
    if part == "compute":
        return f"compute {delta:+.2f} ms per step: {meaning}"
    said = "the collectives' " + part if len(keys) > 1 else keys[0]
    return f"{said} {delta:+.2f} ms per step: {meaning}"


def _wait_reading(
    delta: float,
    fa: dict[str, float],
    fb: dict[str, float],
    keys: list[str],
    median_wait: bool,
    past: bool,
) -> str | None:
    """The wait's change in words, or None. A skew is said where the arrival spread moved
    (see `verdict`) and the wait moved the same way by more than NOISE_MS: the spread, the skew
    itself, is the evidence, the wait's direction its confirmation. Held to the wait's own
    floors, a real 0.16 ms skew of 2 ranks went unsaid on a busy host, 3 of 3: its measured
    floor (step-to-step noise) and 2 % of a 7-15 ms step both outweigh the 0.24 ms a step that
    half a rank's wait adds. A wait past its measured floor whose spread did not move with it
    is said as such."""
    said = "the collectives' wait" if len(keys) > 1 else keys[0]
    if median_wait:
        said += " (the median step's)"
    spreads = {
        name.split()[0]: round(fb[name] - fa[name], 3)
        for name in (f"{key.split()[0]} arrival spread p50" for key in keys)
    }
    if len(spreads) >= 3:
        grew = statistics.median(spreads.values())
        moved = abs(grew) > NOISE_MS
    else:  # each one past the floor, the same way; the smallest move is the skew's size
        grew = min(spreads.values(), key=abs)
        moved = all(abs(g) > NOISE_MS and (g > 0) == (grew > 0) for g in spreads.values())
    if moved and (grew > 0) == (delta > 0) and round(abs(delta), 3) > NOISE_MS:
        if len(spreads) == 1:
            of = f"{next(iter(spreads))} arrival spread p50"
        elif len(spreads) == 2:
            of = f"arrival spread p50, the smaller of {' and '.join(spreads)}"
        else:
            most, by = max(spreads.items(), key=lambda c: c[1] if delta > 0 else -c[1])
            of = f"arrival spread p50, the median of {len(spreads)} collectives; {most} {by:+.3f}"
        meaning = MEANING["wait"][delta > 0]
        return f"{meaning} by {grew:+.3f} ms per call ({of}), {said} {delta:+.2f} ms per step"
    if not past:
        return None
    each = ", ".join(f"{name} {g:+.3f}" for name, g in spreads.items())
    return (
        f"{said} {delta:+.2f} ms per step, though the arrival spread p50 moved {each} ms per "
        "call: not a skew that this shows"
    )


def _rel(delta: float, base: float) -> str:
    return f"{delta / base * 100:+.0f} %" if base else "new"
