"""`--compare` against the truth, on real torch gloo captures made afresh on this host
(tests/fixtures/make_gloo_trace.py: 2 CPU ranks on loopback, one all-reduce, all-gather and
reduce-scatter per step, the truth stamped outside the profiler), and each collective's sizes
and bus bandwidth against that truth.

    .venv/bin/python -m bench.compare_bench --torch-python PYTHON [--runs 5] [--out FILE.json]

Per repetition: three captures of one state (no delay) as A, three more as B, three with the
last rank 2 ms late before every collective as C, made interleaved (A, B, C, A, ...) by one pair
of rank processes, each capture its own profiler session (as a running vLLM's captures are);
then A against B (a control: the truth is no
change), A against C (the wait grew, carried by the late rank), and A1 against C1 (one capture a
side: run-to-run noise unmeasured, the rank still named). Then one capture with
record_shapes and two sizes per collective: the bytes per call against the truth's, exactly,
and the bus bandwidth (nccl-tests' definition) against the truth's, per size: the truth's time of
a call is the median rank's exit less the latest entry, stamped by `time.time_ns()`.
PYTHON is one with torch (`pip install torch==2.13.0` in a virtualenv of its own).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine
from kimi_supervisor.analysis.compare import compare
from kimi_supervisor.analysis.ranks import summarize_folder
from kimi_supervisor.ports.safeopen import try_open
from tests.gloo_truth import truth_busbw

ROOT = Path(__file__).resolve().parents[1]
MAKE = ROOT / "tests" / "fixtures" / "make_gloo_trace.py"
LATE_RANK = 1
# The sizes check's tensors, tokens x 7168 fp32: 1.8 and 14.7 MB per all-reduce, where the
# truth's stamps around a call (Python's dispatch, the caller's wake-up after gloo's worker)
# are a small part of its time.
SIZES = "64,512"


def make(python: str, folder: Path, *, delays: str = "0", steps: int, extra: list[str]) -> None:
    argv = [python, str(MAKE), str(folder), "--ranks", "2", "--delay-ms", delays,
            "--steps", str(steps), *extra]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True)


def summarize(folder: Path) -> dict[str, Any]:
    """The capture's summary as `kimi-mode capture --summarize` makes it (in this process)."""
    return summarize_folder(folder, try_open)[0]


def judged(c: dict[str, Any]) -> dict[str, Any]:
    """What a compare said, as the bench scores it."""
    v = c["verdict"]
    return {
        "verdict": v,
        "no_change": v.startswith("no change beyond the noise"),
        "wait_grew": "the wait grew" in v,
        "names_rank": f"carried by rank {LATE_RANK}" in v,
        "run_noise_unmeasured": "run-to-run noise not measured" in v,
        "leads_with_beyond": _leads_beyond(c),
        "tests": c["tests"],
        "late": c["late"],
    }


def _leads_beyond(c: dict[str, Any]) -> bool:
    """Whether the verdict's first term is one beyond its noise (or says nothing moved)."""
    v = c["verdict"]
    if v.startswith(("no change beyond the noise", "nothing")):
        return True
    first = v.split(";")[0]
    beyond = [p for p, t in c["tests"].items() if t["beyond"]]
    words = {"wait": "wait", "transfer": "transfer", "compute": "compute", "step": "step p50",
             "spread": "arrival spread"}  # fmt: skip
    return any(words[p] in first for p in beyond)


def sizes_check(python: str, d: Path, steps: int, *, remake: bool = True) -> dict[str, Any]:
    folder = d / "sizes"
    if remake:
        make(python, folder, steps=steps, extra=["--record-shapes", "--tokens", SIZES])
    summary = summarize(folder)
    truth = json.loads((folder / "truth.json").read_text())
    counted = {row[0] for row in summary["across_ranks"]["per_step"]["rows"] if row[6]}
    true_bus = truth_busbw(truth, counted)
    true_bytes = {
        k: sorted({c[4] for c in truth["calls"]["0"] if c[1] == k}) for k in truth["kinds"]
    }
    rows = []
    for kind, c in summary["across_ranks"]["kinds"]["decode"]["collectives"].items():
        s = c["sizes"]
        ours = {r["bytes"]: r["busbw_gbps"] for r in s["by_size"]}
        for nbytes, bus in sorted(true_bus[kind].items()):
            got = ours.get(nbytes)
            rows.append({
                "collective": kind, "bytes": nbytes, "busbw_gbps": got,
                "truth_busbw_gbps": round(bus, 4),
                "error": None if got is None else round(abs(got - bus) / bus, 4),
            })  # fmt: skip
        rows[-1]["bound"] = s["bound"]
        rows[-1]["bytes_exact"] = sorted(ours) == true_bytes[kind]
    return {
        "rows": rows,
        "bytes_exact": all(r.get("bytes_exact", True) for r in rows),
        "worst_busbw_error": max(r["error"] for r in rows if r["error"] is not None),
    }


def run(
    python: str, runs: int, steps: int, delay_ms: float, *, keep: Path | None = None
) -> dict[str, Any]:
    """The bench (see the module). `keep`: the captures' folder, kept, and those already there
    (a capture with its truth.json) summarized again rather than made again."""
    reps = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="compare-bench-") as tmp:
        d = keep or Path(tmp)
        for rep in range(runs):
            caps: dict[str, list[dict[str, Any]]] = {"A": [], "B": [], "C": []}
            # Nine captures by one pair of ranks, each its own profiler session (as a running
            # vLLM's captures are), interleaved A, B, C: a drift of the host falls on all alike.
            folder = d / f"rep-{rep}"
            if not (folder / "08" / "truth.json").exists():
                make(python, folder, delays=",".join(["0", "0", f"{delay_ms:g}"] * 3),
                     steps=steps, extra=[])  # fmt: skip
            for k in range(9):
                caps["ABC"[k % 3]].append(summarize(folder / f"{k:02d}"))
            reps.append({
                "control_3v3": judged(compare(caps["A"], caps["B"])),
                "delayed_3v3": judged(compare(caps["A"], caps["C"])),
                "delayed_1v1": judged(compare(caps["A"][0], caps["C"][0])),
                "control_1v1": judged(compare(caps["A"][0], caps["B"][0])),
            })  # fmt: skip
            print(f"rep {rep}: " + json.dumps({k: v["verdict"] for k, v in reps[-1].items()}),
                  file=sys.stderr, flush=True)  # fmt: skip
        sizes = sizes_check(python, d, steps) if not keep or not (d / "sizes").exists() else (
            sizes_check(python, d, steps, remake=False))  # fmt: skip

    def count(case: str, key: str) -> int:
        return sum(bool(r[case][key]) for r in reps)

    scores = {
        "control 3 v 3, no change beyond the noise": count("control_3v3", "no_change"),
        "delayed 3 v 3, the wait grew": count("delayed_3v3", "wait_grew"),
        "delayed 3 v 3, names the rank": count("delayed_3v3", "names_rank"),
        "delayed 1 v 1, run-to-run noise said unmeasured": count(
            "delayed_1v1", "run_noise_unmeasured"
        ),
        "delayed 1 v 1, names the rank": count("delayed_1v1", "names_rank"),
        "control 1 v 1, no change beyond the noise": count("control_1v1", "no_change"),
        "verdicts leading with a term beyond its noise": sum(
            r[c]["leads_with_beyond"] for r in reps for c in r
        ),
    }
    return {
        "machine": machine(),
        "command": f"python -m bench.compare_bench --runs {runs} --steps {steps} "
        f"--delay-ms {delay_ms:g}",
        "captures": "2 gloo CPU ranks, 1 all-reduce + 1 all-gather + 1 reduce-scatter of 4 x "
        f"7168 fp32 per step, {steps} steps each; C: rank {LATE_RANK} {delay_ms:g} ms late "
        "before each collective",
        "scores": {
            k: f"{v} of {4 * runs if k.startswith('verdicts') else runs}" for k, v in scores.items()
        },
        "sizes": sizes,
        "repetitions": reps,
        "took_s": round(time.monotonic() - t0),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--torch-python", required=True)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--delay-ms", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None, help="keep the captures here (and reuse)")
    a = p.parse_args()
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
    got = run(a.torch_python, a.runs, a.steps, a.delay_ms, keep=a.keep)
    text = json.dumps(got, indent=1) + "\n"
    if a.out:
        a.out.write_text(text)
    print(json.dumps({"scores": got["scores"], "sizes": {k: v for k, v in got["sizes"].items()
                                                         if k != "rows"}}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
