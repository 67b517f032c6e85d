"""A capture's summary and two captures' comparison, as the operator reads them."""

from __future__ import annotations

from typing import Any

LABELS = {"communication": "communication", "gemm": "GEMM", "attention": "attention"}
COLLECTIVES = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "other": "other comm.",
}


def _pct(share: float) -> str:
    return f"{share * 100:5.1f} %"


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def format_summary(summary: dict[str, Any]) -> str:
    """What the operator reads after a capture: per rank, the steps and where their time went;
    across the ranks, the collectives' wait and transfer."""
    lines: list[str] = []
    for r in summary.get("ranks", []):
        steps = r.get("steps") or {}
        counted = ", ".join(f"{n} {k}" for k, n in sorted(steps.items())) or "no step marks"
        device = "GPU kernels" if r["device"] == "gpu" else "CPU operators"
        head = f"rank {r['rank']} ({r.get('process') or r['file']}): {counted}"
        if r.get("step_ms") is not None:
            head += f"; {r['scope']}: {r['step_ms']:.2f} ms per step"
        lines.append(head)
        for kind, t in sorted((r.get("step_times") or {}).items()):
            first = f"; first {len(t['first'])} apart: {t['first']} ms" if t["first"] else ""
            lines.append(
                f"  {kind} steps p50 {t['p50']:.2f} ms, p90 {t['p90']:.2f}, p99 {t['p99']:.2f}"
                f"{first}"
            )
        per = "per step" if r.get("step_ms") is not None else "in all"
        lines.append(f"  {device} busy {r['busy_ms_per_step']:.2f} ms {per}:")
        for cls, v in r["classes"].items():
            label = LABELS.get(cls, cls)
            lines.append(f"    {label:<14} {_pct(v['share'])}  {v['ms_per_step']:8.3f} ms")
            if cls == "communication":
                for coll, c in (r.get("collectives") or {}).items():
                    impl = ", ".join(c["implementations"])
                    named = f": {', '.join(map(_short, c['names']))}" if c.get("names") else ""
                    lines.append(
                        f"      {COLLECTIVES[coll]:<14} {_pct(c['share'])}  "
                        f"{c['ms_per_step']:6.3f} ms  ({impl}){named}"
                    )
        for t in r.get("top", [])[:5]:
            lines.append(f"    top {_pct(t['share'])}  {t['calls']:6d} calls  {_short(t['name'])}")
        if r.get("overlap"):
            o = r["overlap"]
            lines.append(
                f"  communication overlapped with compute: {_pct(o['overlapped_share'])} of "
                f"{o['communication_ms']:.3f} ms"
            )
    if "fabric" in summary:  # a summary of this version: said also where none was recorded
        from kimi_supervisor.analysis.sizes import fabric_line  # kimi-mode loads no analysis

        lines.append(fabric_line(summary.get("fabric")))
    if summary.get("across_ranks"):
        # A CPU's collectives (gloo, vLLM's shared memory) do not cross the GPUs' links.
        on_gpus = all(r.get("device") == "gpu" for r in summary.get("ranks", []))
        fabric = summary.get("fabric") if on_gpus else {"cpu": True}
        lines += format_split(summary["across_ranks"], fabric)
    for e in summary.get("errors", []):
        if e.get("rank") is None:
            lines.append(f"{e['file']}: {e['error']}")
        else:
            lines.append(f"rank {e['rank']} ({e['file']}): not summarized: {e['error']}")
    if not lines:
        lines.append("no rank traces to summarize")
    return "\n".join(lines)


def format_split(split: dict[str, Any], fabric: dict[str, Any] | None = None) -> list[str]:
    """Across the ranks: per step kind and collective, waiting against moving data, and the
    data against the fabric."""
    lines = [
        f"across ranks {', '.join(map(str, split['ranks']))}: {split['matched_steps']} steps "
        f"matched ({split['unmatched_steps']} not; {split.get('startup_steps', 0)} start-up "
        f"left out of the totals); clock: {split['clock']}"
    ]
    if t := split.get("transient"):
        lines.append(
            f"  profiler-start transient trimmed: the first {t['calls']} call(s), arrivals up to "
            f"{t['entry_spread_ms']:.3f} ms apart while their ends agree within "
            f"{t['exit_spread_ms']:.4f} ms (over {t['threshold_ms']:.3f} ms, 10x the median "
            "spread, is the profilers starting, not the host's skew)"
        )
    for kind, k in sorted(split["kinds"].items(), key=lambda kv: kv[0] != "decode"):
        lines.append(f"  {kind} ({k['steps']} steps, {k['step_ms']:.2f} ms per step):")
        for coll, c in k["collectives"].items():
            name = COLLECTIVES.get(coll, coll)
            lines.append(
                f"    {name:<14} {_pct(c['share_of_step'])} of the step, {c['ms_per_step']:.3f} ms:"
                f" wait {c['wait_ms']:.3f} ms ({c['wait_share'] * 100:.0f} %), transfer "
                f"{c['transfer_ms']:.3f} ms; {c['calls_per_step']:g} calls per step"
            )
            last, spread = c["last_to_arrive"], c["arrival_spread_ms"]
            if last:
                by = (
                    f", {last['by_ms']:.3f} ms after the next latest (median)"
                    if last.get("by_ms") is not None
                    else ""
                )
                lines.append(
                    f"      last to arrive: rank {last['rank']} in {last['share'] * 100:.0f} % "
                    f"of calls{by}; arrival spread p50 {spread['p50']:.3f} ms, p90 "
                    f"{spread['p90']:.3f}, max {spread['max']:.3f}"
                )
            ranks = "; ".join(
                f"{p['rank']}: {p['wait_ms']:.3f} + {p['transfer_ms']:.3f}" for p in c["per_rank"]
            )
            lines.append(f"      per rank, wait + transfer ms: {ranks}")
            lines.append(f"      reading: {reading(c, k['step_ms'])}")
            if c.get("sizes"):
                lines.append(f"      data: {data_line(c['sizes'], fabric)}")
    return lines


def data_line(sizes: dict[str, Any], fabric: dict[str, Any] | None) -> str:
    """One collective's data against the fabric (analysis/sizes.py), or why it cannot be."""
    if not sizes.get("known"):
        return (
            f"message sizes missing ({sizes.get('unsized_calls', 0)} calls carry none): no bus "
            f"bandwidth is given, none guessed; to get them, {sizes.get('how', '')}"
        )
    rows = sizes["by_size"]
    each = ", ".join(
        f"{r['bytes']:,} B x {r['calls']} (transfer p50 {r['transfer_ms_p50']:.3f} ms, busbw "
        f"{r['busbw_gbps']:.2f} GB/s)"
        for r in rows[:3]
    )
    lim = (fabric or {}).get("limit")
    if (fabric or {}).get("cpu"):
        against = "CPU ranks: not set against the GPUs' links"
    elif lim:
        share = sizes["busbw_gbps_p50"] / lim["gbps"] * 100 if lim["gbps"] else 0.0
        against = f"{share:.1f} % of the fabric's {lim['gbps']:.1f} GB/s"
    else:
        against = "no fabric limit recorded with this capture (not a GPU host, or an older one)"
    unsized = f"; {sizes['unsized_calls']} calls without a size" if sizes["unsized_calls"] else ""
    return (
        (
            f"{rows[0]['bytes']:,} bytes per call"
            if len(rows) == 1
            else f"{len(rows)} sizes, most often {sizes['bytes_per_call']:,} bytes per call"
        )
        + "; bus bandwidth p50 "
        f"{sizes['busbw_gbps_p50']:.2f} GB/s, {against} ({sizes['rule']}); by size: {each}"
        f"{unsized}; {sizes['bound']['reading']}: {sizes['bound']['said']}"
    )


# The wait is small against the step, where removing skew is said not to help, at most this
# share of the step (its figure is said with it).
WAIT_SMALL = 0.05


def reading(c: dict[str, Any], step_ms: float | None = None) -> str:
    """What the split suggests, by its verdict (analysis/skew.py's thresholds; docs/operations.md,
    "Reading the split"), and whether the shortest-duration rule agrees. Removing skew is said
    not to help only where the wait is at most WAIT_SMALL of the step (`step_ms`), with the
    figure."""
    v = c["verdict"]
    t = v["thresholds"]
    last = c.get("last_to_arrive") or {}
    if v["reading"] == "one slow rank":
        part = "mostly waiting for" if c["wait_share"] >= t["waiting_share"] else "waiting for"
        said = (
            f"one slow rank: {part} rank {v['rank']}, last in {last['share'] * 100:.0f} % of "
            f"calls, p50 {c['arrival_spread_ms']['p50']:.3f} ms after the first: look at what "
            f"rank {v['rank']} does before its collectives (a host stall, more work than the "
            "others, a slower GPU)"
        )
    elif v["reading"] == "jitter":
        said = (
            "jitter: mostly waiting, the last rank changing from call to call (none last in "
            f"{t['slow_rank_last_share'] * 100:.0f} % of calls): host noise, CPU scheduling of "
            "the ranks' processes, not one slow rank"
        )
    else:
        wait, spread = c["wait_ms"], c["arrival_spread_ms"]["p50"]
        of = f" ({wait / step_ms * 100:.1f} % of the {step_ms:.2f} ms step)" if step_ms else ""
        said = (
            f"mostly moving data: the wait is {wait:.3f} ms per step{of}, arrivals p50 "
            f"{spread:.3f} ms apart per call"
        )
        if step_ms and wait <= WAIT_SMALL * step_ms:
            said += (
                ": removing skew would save at most that; faster links or smaller messages "
                "would help more"
            )
        else:
            said += (
                f": removing skew could save up to {wait:.3f} ms per step; the transfer, "
                f"{c['transfer_ms']:.3f} ms, is what faster links or smaller messages shorten"
            )
    x = c.get("cross_check")
    if x and not x["agrees"]:
        said += (
            f" (the shortest-duration rule reads a wait of {x['wait_ms']:.3f} ms, not "
            f"{c['wait_ms']:.3f}: the ranks' durations differ by more than their arrivals)"
        )
    return said


def format_compare(c: dict[str, Any], a: str | list[str], b: str | list[str]) -> str:
    """Captures side by side (analysis/compare.py): A's and B's (one folder or several a
    side), their figures, each part against its noise, the late rank per collective, the
    verdict."""
    lines = []
    for side, given in (("A", a), ("B", b)):
        folders = [given] if isinstance(given, str) else given
        if len(folders) == 1:
            lines.append(f"{side}: {folders[0]}")
        else:
            lines += [f"{side}{i + 1}: {f}" for i, f in enumerate(folders)]
    lines.append(f"{c['kind']} steps, ms per step (mean over ranks and over a side's captures):")
    width = max([30, *(len(row["what"]) for row in c["rows"])])
    lines.append(f"  {'':<{width}} {'A':>9} {'B':>9} {'B - A':>9}")

    def cell(v: float | None, sign: str = "") -> str:
        return f"{v:{sign}9.3f}" if v is not None else f"{'-':>9}"

    for row in c["rows"]:
        lines.append(
            f"  {row['what']:<{width}} {cell(row['a'])} {cell(row['b'])} {cell(row['delta'], '+')}"
        )
    lines.append("top kernels:")
    for row in c["top"]:
        lines.append(
            f"  {row['a']:9.3f} {row['b']:9.3f} {row['delta']:+9.3f}  {_short(row['what'], 60)}"
        )
    if c.get("tests"):
        lines.append(f"each part against its noise, the median step's ms; {c['noise']}:")
        for part, t in c["tests"].items():
            runs = f"{t['run_noise']:.3f}" if t["run_noise"] is not None else "not measured"
            steps = f"{t['step_noise']:.3f}" if t["step_noise"] is not None else "too few steps"
            lines.append(
                f"  {part:<10} A {t['a']:8.3f}  B {t['b']:8.3f}  B - A {t['delta']:+8.3f}  noise "
                f"±{t['noise']:.3f} (steps {steps}, runs {runs}): "
                + ("beyond it" if t["beyond"] else "within it")
            )
    if c.get("late"):
        lines.append("last to arrive, per collective (the rank, its share of calls, its lead):")
        for r in c["late"]:
            la, lb = r["a"], r["b"]

            def said(x: dict[str, Any]) -> str:
                by = f", {x['by_ms']:.3f} ms" if x.get("by_ms") is not None else ""
                return f"rank {x['rank']} {x['share'] * 100:.0f} %{by}"

            lines.append(
                f"  {COLLECTIVES.get(r['collective'], r['collective']):<14} A {said(la)}; B "
                f"{said(lb)}: " + ("changed" if r["changed"] else "no change beyond the noise")
            )
    for note in c["notes"]:
        lines.append(f"note: {note}")
    lines.append(f"verdict: {c['verdict']}")
    return "\n".join(lines)
