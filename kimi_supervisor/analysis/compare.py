"""Captures side by side (`kimi-mode capture --compare A B`, or several captures a side:
`A1 A2 ... -- B1 B2 ...`): the same step kind, per class, per top kernel and for the
wait/transfer split, each with its delta; per collective, the rank that arrives last in A and in
B; and a verdict that says only what moved beyond its noise.

**The noise.** Each part of a step (the step itself, the collectives' wait, their transfer, the
compute, and the arrival spread per call) is read step by step from each capture's per-step rows.
A side's figure is the median of its captures' steps together (one slow step, or one capture
that a busy host slowed, moves a median little). Two noises are measured, at LEVEL (99 %,
two-sided: Z99 standard deviations of a bootstrap's differences, `rounds` draws):
- step to step: each capture's steps drawn again with replacement;
- run to run, with two or more captures on a side: that side's captures drawn again with
  replacement, then each one's steps (a hierarchical bootstrap; the variance a bootstrap of n
  captures understates by (n - 1) / n is put back).
A change is beyond the noise when it exceeds the larger of the two and RESOLUTION_MS. With one
capture a side, run-to-run noise is not measured, and the output says so: two captures of one
unchanged 2-CPU host differed by 1.1 to 1.85 ms of transfer per step, more than the steps'
own spread says.

**The rank.** Per collective, the rank that arrived last most often, how often, and by how much
after the next latest at the median such call (analysis/skew.py), in A and in B; it changed
when the rank differs or its share moved beyond the binomial noise of the calls (and the
run-to-run spread of the captures' shares). The verdict names a rank when the wait or the
skew moved and one rank is last in SLOW_SHARE of the calls of every collective on the side that
waits more.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Any

from kimi_supervisor.analysis.collectives import SPLIT
from kimi_supervisor.analysis.skew import SLOW_SHARE

LEVEL, Z99 = 0.99, 2.576
# Student's t at 99 % two-sided by degrees of freedom (beyond the table: the nearest below), for
# the late rank's share across captures.
T99 = {1: 63.657, 2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355,
       9: 3.25, 10: 3.169, 12: 3.055, 15: 2.947, 20: 2.845, 30: 2.75, 60: 2.66}  # fmt: skip
RESOLUTION_MS = 0.05  # below this no move is said: a trace's µs and gloo's hand-over
MIN_STEPS = 5  # a capture with fewer counted steps has no step-to-step noise to measure
ROUNDS, ROUNDS_MIN, DRAWS = 1000, 200, 600_000  # bootstrap rounds; draws per part at most
# A capture of more steps is drawn again from this many of them, evenly spaced: its noise is then
# overstated, by sqrt(steps / STEP_MAX) at most (3.2x for a summary's 5,000 rows), and a compare
# of six such captures takes seconds, not a minute.
STEP_MAX = 500
TOP = 8
# The parts judged, and what a change of each says, down then up (the verdict's words).
PARTS = ("step", "wait", "transfer", "compute", "spread")
MEANING = {
    "step": ("the step got faster", "the step got slower"),
    "wait": ("the wait shrank", "the wait grew"),
    "spread": ("the skew went down", "the skew went up"),
    "transfer": ("the data moves faster", "the data moves slower"),
    "compute": ("compute got faster", "compute got slower"),
}
UNIT = {"spread": "ms per call"}  # the others: ms per step
LABEL = {"step": "step p50", "wait": "wait", "transfer": "transfer", "compute": "compute",
         "spread": "arrival spread p50"}  # fmt: skip


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
            for coll in _split_of(summary, kind):  # the late rank, as _late reads it
                if _late([summary], kind, coll) is not None:
                    _share_of([summary], kind, coll, rank=0)
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


def _series(summary: dict[str, Any], kind: str) -> dict[str, list[float]]:
    """Each part's figure step by step (the cross-rank per-step rows, counted steps of `kind`):
    the step, the wait, the transfer (the collectives' time less their wait), the rest of the
    step, and the median arrival spread of its calls. Empty where the summary has no rows."""
    table = (summary.get("across_ranks") or {}).get("per_step") or {}
    columns = table.get("columns") or []
    need = ("kind", "step_ms", "collective_ms", "wait_ms", "counted")
    if not isinstance(columns, list) or not all(c in columns for c in need):
        return {}
    at = {c: columns.index(c) for c in (*need, "spread_ms") if c in columns}
    out: dict[str, list[float]] = {part: [] for part in PARTS}
    if "spread_ms" not in at:
        del out["spread"]
    for row in table.get("rows") or []:
        if not isinstance(row, list) or len(row) < len(columns):
            raise CompareError("a per-step row is not a row of its columns")
        if row[at["kind"]] != kind or not row[at["counted"]]:
            continue
        step = _num(row[at["step_ms"]], "a step's time")
        collective = _num(row[at["collective_ms"]], "a step's collectives")
        wait = _num(row[at["wait_ms"]], "a step's wait")
        out["step"].append(step)
        out["wait"].append(wait)
        out["transfer"].append(collective - wait)
        out["compute"].append(step - collective)
        if "spread" in out:
            out["spread"].append(_num(row[at["spread_ms"]], "a step's arrival spread"))
    return out


def _t99(df: int) -> float:
    return T99[max(d for d in T99 if d <= df)] if df < 60 else Z99


def _pooled(side: list[list[float]]) -> float:
    return statistics.median([x for capture in side for x in capture])


def judge(
    a: list[list[float]], b: list[list[float]], *, rounds: int | None = None, seed: str = ""
) -> dict[str, Any]:
    """One part judged against its noise (see the module): `a` and `b` are each side's
    captures' step-by-step series; a side's figure is the median of its captures' steps
    together. The figures (ms), the two noises (None: not measured), and whether the change is
    beyond them."""
    fa, fb = _pooled(a), _pooled(b)
    delta = fb - fa
    fewest = min(len(x) for x in (*a, *b))
    step_noise = run_noise = None
    if fewest >= MIN_STEPS:
        a, b = ([x[:: -(-len(x) // STEP_MAX)] for x in side] for side in (a, b))
        drawn = sum(len(x) for x in (*a, *b))
        n = rounds or max(ROUNDS_MIN, min(ROUNDS, DRAWS // drawn))
        rng = random.Random(f"{seed}:{drawn}")

        def steps(side: list[list[float]]) -> float:  # each capture's steps drawn again
            return _pooled([rng.choices(x, k=len(x)) for x in side])

        def runs(side: list[list[float]]) -> float:  # the captures drawn again, then steps
            return _pooled([rng.choices(x, k=len(x)) for x in rng.choices(side, k=len(side))])

        step_noise = Z99 * statistics.pstdev(steps(b) - steps(a) for _ in range(n))
        if len(a) >= 2 or len(b) >= 2:
            # A bootstrap of n captures understates their variance by (n - 1) / n: undone.
            ka, kb = (math.sqrt(len(x) / (len(x) - 1)) if len(x) >= 2 else 1.0 for x in (a, b))
            ra = [runs(a) if len(a) >= 2 else steps(a) for _ in range(n)]
            rb = [runs(b) if len(b) >= 2 else steps(b) for _ in range(n)]
            ma, mb = statistics.mean(ra), statistics.mean(rb)
            spread = [(y - mb) * kb - (x - ma) * ka for x, y in zip(ra, rb, strict=True)]
            run_noise = Z99 * statistics.pstdev(spread)
    noise = max(step_noise or 0.0, run_noise or 0.0, RESOLUTION_MS)
    return {
        "a": round(fa, 3),
        "b": round(fb, 3),
        "delta": round(delta, 3),
        "noise": round(noise, 3),
        "step_noise": None if step_noise is None else round(step_noise, 3),
        "run_noise": None if run_noise is None else round(run_noise, 3),
        "fewest_steps": fewest,
        "beyond": step_noise is not None and abs(delta) > noise,
    }


def _late(side: list[dict[str, Any]], kind: str, coll: str) -> dict[str, Any] | None:
    """One side's late rank of a collective: pooled over its captures, the rank last most
    often, its share of the calls, by how much after the next latest (the median over the
    captures), the calls, and each capture's share of that rank."""
    counts: dict[str, float] = {}
    total = 0
    for s in side:
        last = (_split_of(s, kind).get(coll) or {}).get("last_to_arrive")
        if not isinstance(last, dict):
            continue
        calls = int(_num(last.get("calls") or 0, "a late rank's calls"))
        shares = last.get("shares") or {str(last.get("rank")): last.get("share", 0.0)}
        for r, share in shares.items():
            counts[str(r)] = counts.get(str(r), 0.0) + _num(share, "a late share") * calls
        total += calls
    if not total or not counts:
        return None
    rank = max(counts, key=lambda r: counts[r])
    each, by = [], []
    for s in side:
        last = (_split_of(s, kind).get(coll) or {}).get("last_to_arrive") or {}
        shares = last.get("shares") or {str(last.get("rank")): last.get("share", 0.0)}
        each.append(_num(shares.get(rank, 0.0), "a late share"))
        if str(last.get("rank")) == rank and last.get("by_ms") is not None:
            by.append(_num(last["by_ms"], "a late rank's lead"))
    return {
        "rank": int(rank) if rank.lstrip("-").isdigit() else rank,
        "share": round(counts[rank] / total, 4),
        "by_ms": round(statistics.median(by), 4) if by else None,
        "calls": total,
        "each": each,
    }


def _share_of(side: list[dict[str, Any]], kind: str, coll: str, *, rank: Any) -> tuple[float, int]:
    """`rank`'s pooled share of being last, and the calls, on one side."""
    got, total = 0.0, 0
    for s in side:
        last = (_split_of(s, kind).get(coll) or {}).get("last_to_arrive") or {}
        calls = int(_num(last.get("calls") or 0, "a late rank's calls"))
        shares = last.get("shares") or {str(last.get("rank")): last.get("share", 0.0)}
        got += _num(shares.get(str(rank), 0.0), "a late share") * calls
        total += calls
    return (got / total if total else 0.0), total


def late_ranks(
    a: list[dict[str, Any]], b: list[dict[str, Any]], kind: str, *, colls: list[str]
) -> list[dict[str, Any]]:
    """Per collective: A's and B's late rank, and whether it changed (see the module)."""
    out = []
    for coll in colls:
        la, lb = _late(a, kind, coll), _late(b, kind, coll)
        if la is None or lb is None:
            continue
        pa, na = _share_of(a, kind, coll, rank=lb["rank"])
        pb, nb = lb["share"], lb["calls"]
        pooled = (pa * na + pb * nb) / (na + nb)
        noise = Z99 * math.sqrt(max(pooled * (1 - pooled), 0.0) * (1 / na + 1 / nb))
        ea = [_share_of([s], kind, coll, rank=lb["rank"])[0] for s in a]
        eb = lb["each"]
        df = sum(len(x) - 1 for x in (ea, eb) if len(x) >= 2)
        if df:
            ss = sum(sum((v - statistics.mean(x)) ** 2 for v in x) for x in (ea, eb)
                     if len(x) >= 2)  # fmt: skip
            noise = max(noise, _t99(df) * math.sqrt(ss / df * (1 / len(ea) + 1 / len(eb))))
        moved = abs(pb - pa) > noise
        changed = moved
        out.append(
            {
                "collective": coll,
                "a": {k: la[k] for k in ("rank", "share", "by_ms", "calls")},
                "b": {k: lb[k] for k in ("rank", "share", "by_ms", "calls")},
                "b_rank_share_in_a": round(pa, 4),
                "noise": round(noise, 4),
                "changed": changed,
            }
        )
    return out


def _carrier(late: list[dict[str, Any]], side: str) -> tuple[Any, list[dict[str, Any]]] | None:
    """The one rank that arrives last most often in every collective on `side` ("a" or "b"),
    last in SLOW_SHARE of their calls together, and those rows; None where no one rank is. (A
    2 ms late rank on a busy 2-CPU host was last in 78 % of one collective's calls and 94 % of
    another's: the scheduler, not another late rank.)"""
    if not late:
        return None
    ranks = {row[side]["rank"] for row in late}
    calls = sum(row[side]["calls"] for row in late)
    share = sum(row[side]["share"] * row[side]["calls"] for row in late) / calls if calls else 0.0
    if len(ranks) != 1 or share < SLOW_SHARE:
        return None
    return next(iter(ranks)), late


def _labels(n: int, side: str) -> list[str]:
    return [side] if n == 1 else [f"{side}{i + 1}" for i in range(n)]


def compare(
    a: dict[str, Any] | list[dict[str, Any]],
    b: dict[str, Any] | list[dict[str, Any]],
    *,
    rounds: int | None = None,
) -> dict[str, Any]:
    """The comparison (see the module) of A's captures' summaries with B's (one summary or a
    list a side); raises CompareError."""
    sides = [a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]]
    for side, caps in zip("AB", sides, strict=True):
        if not caps:
            raise CompareError(f"{side} has no capture")
        for label, s in zip(_labels(len(caps), side), caps, strict=True):
            if not s.get("ranks"):
                raise CompareError(f"{label} has no summarized rank: is it a capture's folder?")
            why = malformed(s)
            if why is not None:
                raise CompareError(
                    f"{label}'s summary cannot be read ({why}): make it again with "
                    "`kimi-mode capture --summarize FOLDER`"
                )
        counts = sorted({len(s["ranks"]) for s in caps})
        if len(counts) > 1:
            raise CompareError(
                f"{side}'s captures are of {' and '.join(map(str, counts))} ranks: the captures "
                "of one side must be of one state (the arrival spread grows with the ranks)"
            )
    kinds = {_kind(s) for caps in sides for s in caps}
    if len(kinds) != 1 or None in kinds:
        said = ", ".join(sorted(k or "no" for k in kinds))
        raise CompareError(
            f"the captures' summaries are of {said} steps: compare captures of the same load "
            "(decode steps, all)"
        )
    kind = next(iter(kinds))
    assert kind is not None
    ca, cb = sides
    fa = _side_figures(ca, kind)
    fb = _side_figures(cb, kind)
    rows = [
        {
            "what": k,
            "a": round(fa[k], 3) if k in fa else None,
            "b": round(fb[k], 3) if k in fb else None,
            "delta": round(fb[k] - fa[k], 3) if k in fa and k in fb else None,
        }
        for k in [*fa, *(k for k in fb if k not in fa)]
    ]
    ta, tb = _side_tops(ca), _side_tops(cb)
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
    notes: list[str] = []
    na, nb = len(ca[0]["ranks"]), len(cb[0]["ranks"])
    if na != nb:
        notes.append(f"A has {na} ranks and B {nb}")
    colls = [{c for s in caps for c in _split_of(s, kind) if c in SPLIT} for caps in sides]
    shared = [{c for c in SPLIT if all(c in _split_of(s, kind) for s in caps)} for caps in sides]
    if colls[0] != colls[1] or shared[0] != colls[0] or shared[1] != colls[1]:
        only = [f"only {label} has {', '.join(sorted(x))}" for label, x in
                (("A", colls[0] - colls[1]), ("B", colls[1] - colls[0])) if x]  # fmt: skip
        notes.append(
            f"the collectives split across ranks differ ({'; '.join(only) or 'within a side'}): "
            "those are not compared"
        )
    for side, caps in zip("AB", sides, strict=True):
        for label, s in zip(_labels(len(caps), side), caps, strict=True):
            lost = sorted({e.get("rank") for e in s.get("errors") or [] if isinstance(e, dict)},
                          key=str)  # fmt: skip
            if lost:
                notes.append(
                    f"{label}: rank(s) {', '.join(map(str, lost))} could not be read; its "
                    "figures are of the others"
                )
    typical = {t for caps in sides for s in caps if (t := _typical(s, kind))}
    if len(typical) > 1:
        shown = ", ".join(sorted(typical))
        notes.append(f"not the same load: the typical {kind} steps are {shown}")
    if len({r["device"] for caps in sides for s in caps for r in s["ranks"]}) > 1:
        notes.append("the captures ran on different devices (GPU kernels against CPU operators)")
    # The per-step rows sum every collective of a step: only where every capture has the same
    # ones do they measure the same thing.
    same = colls[0] == colls[1] == shared[0] == shared[1]
    tests: dict[str, Any] = {}
    series = [[_series(s, kind) for s in caps] for caps in sides]
    short: list[str] = []
    for part in PARTS:
        if part != "step" and not same:
            continue
        xa = [x.get(part) for x in series[0]]
        xb = [x.get(part) for x in series[1]]
        if not all(xa) or not all(xb):
            continue
        tests[part] = judge(xa, xb, rounds=rounds, seed=part)  # type: ignore[arg-type]
    unsplit: list[str] = []
    for side, caps, ser in zip("AB", sides, series, strict=True):
        for label, s, x in zip(_labels(len(caps), side), caps, ser, strict=True):
            if not x:
                unsplit.append(f"{label} ({len(s['ranks'])} rank(s) read)")
            elif (n := len(x.get("step") or [])) < MIN_STEPS:
                short.append(f"{label} {n}")
    if unsplit:
        notes.append(
            f"no split across ranks in {', '.join(unsplit)}: two ranks or more are needed; the "
            "parts are not judged"
        )
    if short:
        notes.append(
            f"too few counted steps to measure the step-to-step noise ({', '.join(short)}; "
            f"{MIN_STEPS} needed): no change is judged beyond the noise"
        )
    late = late_ranks(ca, cb, kind, colls=sorted(colls[0] & colls[1]))
    said = verdict(tests, late, kind, runs=(len(ca), len(cb)))
    if na != nb:
        said = (
            f"not like for like, A has {na} ranks and B {nb} (the arrival spread grows with the "
            f"ranks): {said}"
        )
    return {
        "kind": kind,
        "captures": {"a": len(ca), "b": len(cb)},
        "rows": rows,
        "top": top,
        "tests": tests,
        "late": late,
        "noise": noise_line(tests, runs=(len(ca), len(cb))),
        "verdict": said,
        "notes": notes,
    }


def _side_figures(side: list[dict[str, Any]], kind: str) -> dict[str, float]:
    """A side's figures (the summary's, per capture), each the mean over its captures that
    have it."""
    per = [_figures(s, kind) for s in side]
    keys = list(dict.fromkeys(k for f in per for k in f))
    return {k: statistics.mean(f[k] for f in per if k in f) for k in keys}


def _side_tops(side: list[dict[str, Any]]) -> dict[str, float]:
    per = [_tops(s) for s in side]
    names = {n for t in per for n in t}
    return {n: sum(t.get(n, 0.0) for t in per) / len(per) for n in names}


def noise_line(tests: dict[str, Any], *, runs: tuple[int, int]) -> str:
    """How the noise was measured, in words."""
    boot = "a bootstrap over steps (each capture's steps drawn again with replacement)"
    if max(runs) >= 2:
        run = (
            f"run to run, a bootstrap over the {runs[0]} and {runs[1]} captures of the sides (the "
            "captures drawn again, then their steps)"
        )
        if min(runs) < 2:
            run += ", measured on the side with several"
    else:
        run = "run-to-run noise not measured (one capture a side: give several, `A1 A2 -- B1 B2`)"
    return f"noise at {LEVEL * 100:.0f} %: {boot}; {run}"


def _fig(part: str, t: dict[str, Any]) -> str:
    return f"{t['delta']:+.2f} {UNIT.get(part, 'ms per step')} (noise ±{t['noise']:.2f})"


def verdict(
    tests: dict[str, Any], late: list[dict[str, Any]], kind: str, *, runs: tuple[int, int]
) -> str:
    """What changed, in words: only what moved beyond its noise, the largest first (the
    step's parts, then the step); the late rank where one carries the wait's move; then what
    stayed within its noise, and how the noise was measured."""
    beyond = {p: t for p, t in tests.items() if t["beyond"]}
    said: list[str] = []
    # The wait first where it moved: a rank late before its collectives moves the others' wait
    # and its own time outside them (the compute, a mean over the ranks) together.
    order = sorted((p for p in beyond if p not in ("step", "spread")),
                   key=lambda p: (p != "wait", -abs(beyond[p]["delta"])))  # fmt: skip
    for part in order:
        t = beyond[part]
        up = t["delta"] > 0
        if part == "wait":
            phrase = f"{MEANING['wait'][up]} {_fig('wait', t)}"
            s = tests.get("spread")
            if s and s["beyond"] and (s["delta"] > 0) == up:
                phrase += f", {MEANING['spread'][up]}: arrival spread p50 {_fig('spread', s)}"
            elif s:
                phrase += (
                    f", though the arrival spread p50 moved {_fig('spread', s)}, within its "
                    "noise or the other way: not a skew that this shows"
                )
            phrase += _named(late, up)
        else:
            phrase = f"{MEANING[part][up]}: {LABEL[part]} {_fig(part, t)}"
        said.append(phrase)
    s = beyond.get("spread")
    if s and "wait" not in beyond:
        up = s["delta"] > 0
        said.append(
            f"{MEANING['spread'][up]}: arrival spread p50 {_fig('spread', s)}, though the wait "
            "did not move beyond its noise" + _named(late, up)
        )
    if "step" in beyond:
        t = beyond["step"]
        rel = f"{t['delta'] / t['a'] * 100:+.0f} %, " if t["a"] else ""
        said.append(
            f"the {kind} step p50 {t['delta']:+.2f} ms ({rel}noise ±{t['noise']:.2f}): "
            f"{MEANING['step'][t['delta'] > 0]}"
        )
    within = [f"{LABEL[p]} {_fig(p, t)}" for p, t in tests.items() if not t["beyond"]]
    if not tests:
        head = "nothing can be judged: no per-step rows across the ranks to measure noise from"
    elif not said:
        judged = all(t["step_noise"] is not None for t in tests.values())
        head = "no change beyond the noise" if judged else "nothing judged (too few steps)"
    else:
        head = "; and ".join(said)
    tail = f"; within the noise: {', '.join(within)}" if within and said else (
        f": {', '.join(within)}" if within else "")  # fmt: skip
    changed = [r for r in late if r["changed"]]
    ranks = ""
    if changed and not any(" rank " in x for x in said):
        ranks = "; the late rank changed: " + ", ".join(_late_phrase(r) for r in changed)
    return f"{head}{tail}{ranks}; {noise_line(tests, runs=runs)}"


def _late_phrase(r: dict[str, Any]) -> str:
    a, b = r["a"], r["b"]
    return (
        f"{r['collective'].replace('_', '-')} rank {a['rank']} last in {a['share'] * 100:.0f} % "
        f"of A's calls, rank {b['rank']} in {b['share'] * 100:.0f} % of B's"
    )


def _named(late: list[dict[str, Any]], up: bool) -> str:
    """The rank that carries a move of the wait: on the side that waits more, one rank last
    in SLOW_SHARE of every collective's calls."""
    side, other = ("b", "a") if up else ("a", "b")
    found = _carrier(late, side)
    if found is None:
        return ""
    rank, rows = found
    shares = [row[side]["share"] * 100 for row in rows]
    was = (
        [row["b_rank_share_in_a"] * 100 for row in rows]
        if up
        else [row[other]["share"] * 100 if row[other]["rank"] == rank else 0.0 for row in rows]
    )
    by = [row[side]["by_ms"] for row in rows if row[side]["by_ms"] is not None]
    by_then = [row[other]["by_ms"] for row in rows
               if row[other]["rank"] == rank and row[other]["by_ms"] is not None]  # fmt: skip
    span = f"{min(shares):.0f}" + (f"-{max(shares):.0f}" if max(shares) - min(shares) >= 1 else "")
    was_span = f"{min(was):.0f}" + (f"-{max(was):.0f}" if max(was) - min(was) >= 1 else "")
    lead = f", {statistics.median(by):.2f} ms after the next latest (median)" if by else ""
    if by and by_then:
        lead += f" against {statistics.median(by_then):.2f}"
    where, then = ("B", "A") if up else ("A", "B")
    return (
        f", carried by rank {rank}: last to arrive in {span} % of the calls of "
        f"{', '.join(r['collective'].replace('_', '-') for r in rows)} in {where} ({was_span} % in "
        f"{then}){lead}{' in ' + then if by and by_then else ''}"
    )
