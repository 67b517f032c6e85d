"""docs/performance.md's records of three benchmarks that write raw JSON of their own (run on
the GPU host, or too long to rerun for the page): their tables made from those files, never
typed, then the page refilled (bench/perf_tables.py).

    .venv/bin/python -m bench.raw_records --write docs/performance.md

- gpu-hang-signature: bench/gpu_hang_signature.py's NVML readings per workload shape (on the GPU
  host: `python3 -m bench.gpu_hang_signature --out $OUT/gpu-hang-signature.json --repeat 2`),
  with what bench/process_samples_probe.py found of NVML's per-process samples;
- liveness-bound: bench/liveness_bound.py's bound on a doubt and a hang's grace;
- compare-bench: bench/compare_bench.py's scores of the compare on real gloo traces.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench import perf_tables
from kimi_supervisor.decide import liveness

RESULTS = Path(__file__).resolve().parent / "results"


def _median(rows: list[dict[str, Any]], key: str) -> str:
    vals = [r[key]["median"] for r in rows if isinstance(r.get(key), dict) and "median" in r[key]]
    return f"{statistics.median(vals):.0f}" if vals else "n/a"


def gpu_hang_signature(path: Path) -> tuple[str, str, list[str], list[list[str]]]:
    d = json.loads(path.read_text())
    shapes: dict[str, list[dict[str, Any]]] = {}
    for r in d["results"]:
        if "error" not in r:
            shapes.setdefault(r["shape"], []).append(r)
    rows = []
    for shape, runs in shapes.items():
        pcie = [
            (r["pcie_tx_kb_s"]["median"] + r["pcie_rx_kb_s"]["median"]) / 1000
            for r in runs
            if "median" in r.get("pcie_tx_kb_s", {}) and "median" in r.get("pcie_rx_kb_s", {})
        ]
        cpu = [r["host_cpu_fraction_of_a_core"] for r in runs if "host_cpu_fraction_of_a_core" in r]
        rows.append([
            shape, _median(runs, "util_gpu"), _median(runs, "util_memory"),
            _median(runs, "power_w"), f"{statistics.median(pcie):.0f}" if pcie else "n/a",
            _median(runs, "gpm_dram_bw_util"), f"{statistics.median(cpu):.1f}" if cpu else "n/a",
        ])  # fmt: skip
    text = (
        f"{d['gpu']}, NVML every {d['interval_s']} s, medians. A spin moves no memory (a flag "
        "in host memory: some PCIe); all work moves memory. Work: util.mem >= "
        f"{liveness.MEMORY_BUSY_PCT:g} % or PCIe >= {liveness.PCIE_BUSY_MB_S:,.0f} MB/s or "
        "NVLink traffic." + process_samples(RESULTS / "h100x1-2026-12-07-process-samples.json")
    )
    cols = ["shape", "util.gpu %", "util.mem %", "power W", "PCIe MB/s", "DRAM BW %", "host CPU"]
    return d["date"], text, cols, rows


def process_samples(path: Path) -> str:
    """What NVML's per-process samples keep of short jobs, in a sentence."""
    runs = json.loads(path.read_text())["runs"]
    during = sum(r["during"]["child_in_samples"] for r in runs)
    after = sum(r["after"]["child_in_samples"] for r in runs)
    late = max(r["read_after_end_s"] for r in runs)
    return (
        f" A short job is in NVML's per-process samples while it runs ({during} of {len(runs)}),"
        f" in none once it ended ({after} of {len(runs)}, read 0-{late:g} s after): where"
        " vLLM's are sampled, theirs judge."
    )


def liveness_bound(path: Path) -> tuple[str, str, list[str], list[list[str]]]:
    d = json.loads(path.read_text())
    rows = [
        [b["values"], f"{b['hang_bound_s']:g} s / {b['metrics_interval_s']:g} s",
         f"{b['judged_s']:.2f} s", f"{b['evidence_read_s']:.2f} s"]
        for b in d["bound"]
    ]  # fmt: skip
    rows += [
        [f"a hang's grace {g['hang_term_grace_s']:g} s (term_grace_s {g['term_grace_s']:g})",
         f"API holds {g['api_holds_s']:g} s", f"teardown {g['teardown_s']:.1f} s",
         f"window {g['window_s']:.1f} s"]
        for g in d["grace"]
    ]  # fmt: skip
    text = (
        f"{d['machine']}: a stuck collective (no step, a thread spinning, GPUs spinning) judged "
        "at hang_bound_s; a hang's teardown with requests held, grace before and after."
    )
    return d["date"], text, ["values", "bound / interval", "judged after", "evidence"], rows


def compare_bench(path: Path) -> tuple[str, str, list[str], list[list[str]]]:
    d = json.loads(path.read_text())
    rows = [[k, v] for k, v in d["scores"].items()]
    errors = [r["error"] for r in d["sizes"]["rows"]]
    text = (
        f"{d['machine']}: {d['captures']}. Bytes per call exact; bus bandwidth against the "
        f"truth within {min(errors):.0%}-{max(errors):.0%} (the smallest sizes worst)."
    )
    return d["machine"][:10], text, ["case", "result"], rows


SOURCES = {
    "gpu-hang-signature": ("h100x1-2026-12-07-gpu-hang-signature-host-flag.json",
                           gpu_hang_signature,
                           "python3 -m bench.gpu_hang_signature --seconds 5 --settle-s 1.5 "
                           "--out F  # GPU host\n"
                           "python3 -m bench.process_samples_probe --out F  # GPU host"),
    "liveness-bound": ("liveness-bound-2026-12-07.json", liveness_bound,
                       ".venv/bin/python -m bench.liveness_bound 2"),
    "compare-bench": ("compare-bench-gloo-2cpu-2026-12-07.json", compare_bench,
                      ".venv/bin/python -m bench.compare_bench --runs 5"),
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, required=True, help="docs/performance.md")
    a = ap.parse_args()
    for section, (name, make, command) in SOURCES.items():
        date, text, cols, rows = make(RESULTS / name)
        table = "\n".join("| " + " | ".join(r) + " |" for r in [cols, ["---"] * len(cols), *rows])
        if not any(p.name.startswith(f"perf-{section}-") for p in RESULTS.iterdir()):
            perf_tables.record(section, f"{text}\n\n{table}\n", command=command, date=date)
    perf_tables.write(a.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
