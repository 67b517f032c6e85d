"""The wait/transfer split against the truth, on real torch.profiler traces of real gloo
collectives made afresh on this host (tests/fixtures/make_gloo_trace.py): 2, 4 and 8 CPU ranks
on loopback, the last rank sleeping 0, 0.25, 1 or 5 ms before each all-reduce, all-gather and
reduce-scatter, the truth stamped by `time.time_ns()` around each call outside the profiler.

    .venv/bin/python -m bench.gloo_bench --write docs/performance.md

Per run: the worst error of the recovered wait per rank (ms per step, each collective) against
the truth, the share of calls whose last arrival is the delayed rank, the clock, the verdict, and
`--compare` of the run against the same rank count's run with no delay: the arrival spread's
growth against the truth's.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import machine, main
from kimi_supervisor.analysis.compare import MEANING, compare
from tests.gloo_truth import truth_of
from tests.realvllm.env import venv_path

ROOT = Path(__file__).resolve().parents[1]
MAKE = ROOT / "tests" / "fixtures" / "make_gloo_trace.py"
# torch from the real-vLLM tier's virtualenv of this CPU's build (tests/realvllm/env.py)
TORCH_PYTHON = str(venv_path() / "bin" / "python")
ABS_MS, REL = 0.05, 0.10  # the bar: within 10 % or 50 µs


def check(summary: dict[str, Any], truth: dict[str, Any]) -> dict[str, Any]:
    """How the summary's split stands against the truth (see the module)."""
    a = summary["across_ranks"]
    at = a["per_step"]["columns"].index("counted")
    counted = {row[0] for row in a["per_step"]["rows"] if row[at]}
    t = truth_of(truth, counted)
    late = truth["late_rank"]
    worst_abs = worst_rel = 0.0
    within, named, verdicts = True, [], set()
    for kind, c in a["kinds"]["decode"]["collectives"].items():
        for p in c["per_rank"]:
            true = t[kind]["wait_ms"][p["rank"]]
            err = abs(p["wait_ms"] - true)
            worst_abs = max(worst_abs, err)
            if true > ABS_MS:
                worst_rel = max(worst_rel, err / true)
            within &= err <= max(ABS_MS, REL * true)
        if late is not None:
            last = c["last_to_arrive"]
            share = last["share"] if last["rank"] == late else 0.0
            named.append((share, t[kind]["late_share"]))
        verdicts.add(c["verdict"]["reading"])
    return {
        "worst_abs_ms": worst_abs,
        "worst_rel": worst_rel,
        "within": within,
        "named": min(named) if named else None,  # (ours, the truth's), the worst collective
        "clock": a["clock"],
        "verdicts": sorted(verdicts),
        "transient": a.get("transient"),
        "truth": t,
    }


def summarize(folder: Path) -> dict[str, Any]:
    env = {**os.environ, "KIMI_SUPERVISOR_CONFIG": "/nonexistent"}
    argv = [sys.executable, "-m", "kimi_supervisor.cli.kimi_mode", "capture", "--summarize",
            str(folder), "-o", "json"]  # fmt: skip
    out = subprocess.run(argv, env=env, capture_output=True, check=True, cwd=ROOT).stdout
    summary: dict[str, Any] = json.loads(out)
    return summary


def run(runs: int, torch_python: str, ranks: str, delays: str, steps: int, backend: str) -> str:
    """`backend` gloo, or shm: vLLM's CPU shared-memory kernels, whose ranks spin while they
    wait, so a run of more ranks than this host has CPUs measures the scheduler: left out."""
    rows, skipped = [], []
    worst_compare, compares = 0.0, [0, 0]  # the worst; within the bar, of how many
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="gloo-bench-") as d:
        for world in map(int, ranks.split(",")):
            if backend == "shm" and world > cpus:
                skipped.append(world)
                continue
            control: tuple[dict[str, Any], dict[str, Any]] | None = None
            for delay in map(float, delays.split(",")):
                for run_no in range(runs):
                    folder = Path(d, f"{world}-{delay}-{run_no}")
                    argv = [torch_python, str(MAKE), str(folder), "--ranks", str(world),
                            "--delay-ms", str(delay), "--steps", str(steps),
                            "--backend", backend]  # fmt: skip
                    subprocess.run(argv, check=True, capture_output=True)
                    truth = json.loads((folder / "truth.json").read_text())
                    summary = summarize(folder)
                    got = check(summary, truth)
                    spread = "-"
                    if delay == 0 and control is None:
                        control = (summary, got)
                    elif control is not None:
                        cmp = compare(control[0], summary)
                        _skew, readings = _said(cmp["verdict"])
                        grew = [r for r in cmp["rows"] if r["what"].endswith("arrival spread p50")]
                        # As the verdict states it (compare._reading): the median over three
                        # collectives or more, the smaller move of one or two.
                        true_grew = _as_stated([
                            got["truth"][k]["spread_p50_ms"]
                            - control[1]["truth"][k]["spread_p50_ms"]
                            for k in truth["kinds"]
                        ])  # fmt: skip
                        # The rows' per-collective growth (the verdict states the per-step
                        # median spread's, another figure of the same skew).
                        ours = _as_stated([r["delta"] for r in grew])
                        err = abs(ours - true_grew) / abs(true_grew)
                        if delay > 0:  # a control's growth is noise: no share of it is a bar
                            worst_compare = max(worst_compare, err)
                            compares[0] += abs(ours - true_grew) <= max(ABS_MS, REL * true_grew)
                            compares[1] += 1
                        off = f"{err * 100:.1f} %" if delay > 0 else "a control: no share"
                        spread = f"{ours:+.3f} (truth {true_grew:+.3f}, {off}); says: " + "; ".join(
                            readings
                        )
                    rows.append(
                        f"| {world} | {delay:g} | {got['worst_abs_ms'] * 1000:.0f} | "
                        f"{got['worst_rel'] * 100:.1f} | {'yes' if got['within'] else 'NO'} | "
                        + (
                            f"{got['named'][0] * 100:.0f} % (truth {got['named'][1] * 100:.0f} %)"
                            if got["named"] is not None
                            else "-"
                        )
                        + f" | {'none' if 'no correction' in got['clock'] else got['clock']} | "
                        f"{', '.join(got['verdicts'])} | "
                        + (f"{got['transient']['calls']}" if got["transient"] else "0")
                        + f" | {spread} |"
                    )
    what = (
        "vLLM 0.16's CPU shared-memory kernels (`_C::shm_allreduce`, `_C::shm_all_gather`, as "
        "its CPU worker calls them), one all-reduce and one all-gather"
        if backend == "shm"
        else "gloo on loopback, one all-reduce, all-gather and reduce-scatter"
    )
    left_out = (
        f" Not run: {', '.join(map(str, skipped))} ranks (more ranks than this host's {cpus} "
        "CPUs: shm ranks spin while they wait)."
        if skipped
        else ""
    )
    return (
        f"{machine()}. torch {_torch_version(torch_python)}, {what} per decode step, {steps} "
        f"steps per capture (4 x 7168 fp32 each), the last rank delayed before each collective; "
        f"{runs} capture(s) per line.{left_out} The error is the "
        "recovered wait per rank and collective (ms per step) against the truth stamped outside "
        "the profiler; the bar is 10 % or 50 µs. Named: the share of calls whose last arrival "
        "the split names as the delayed rank (the worst collective), and the share of calls "
        "the delayed rank really entered last (the truth). Compare: the arrival "
        "spread p50's growth against the same rank count's capture with no delay, ms per call, as "
        "the compare's rows give it (the median over three collectives or more, the smaller move "
        "of two), against the truth's taken the same way, and every reading the verdict gives, in "
        "its order (a control's says nothing unless its own spread moved, as its truth shows)."
        "\n\n"
        "| ranks | delay, ms | worst error, µs | worst error, % | within the bar | named | "
        "clock correction | verdicts | transient calls trimmed | compare: spread growth, ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Worst compare error against the truth's growth, over the delayed captures: "
        f"{worst_compare * 100:.1f} %; {compares[0]} of {compares[1]} within the bar (10 % or "
        "50 µs).\n"
    )


def _as_stated(growth: list[float]) -> float:
    return statistics.median(growth) if len(growth) >= 3 else min(growth, key=abs)


def _said(verdict: str) -> tuple[float | None, list[str]]:
    """The skew the compare's verdict states going up (ms per call, None where it does not),
    and every reading it gives, in its order ("nothing" where none passed its floor)."""
    m = re.search(r"the skew went up: arrival spread p50 ([+-][\d.]+) ms per call", verdict)
    phrases = [p for pair in MEANING.values() for p in pair]
    found = sorted((verdict.find(p), p) for p in phrases if p in verdict)
    return (float(m.group(1)) if m else None), [p for _, p in found] or ["nothing"]


def _torch_version(python: str) -> str:
    argv = [python, "-c", "import torch; print(torch.__version__)"]
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()


if __name__ == "__main__":
    main(
        lambda a: "gloo-bench-shm" if a["backend"] == "shm" else "gloo-bench",
        run,
        runs=1,
        torch_python=(str, TORCH_PYTHON),
        ranks=(str, "2,4,8"),
        delays=(str, "0,0.25,1,5"),
        steps=(int, 20),
        backend=(str, "gloo"),
    )
