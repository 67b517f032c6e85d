"""Renders the real-GPU figures into docs/performance.md from the JSON the GPU tests write.

    # on the GPU host (see tests/gpu/test_real_gpus.py):
    KIMI_GPU_RESULTS=$OUT/gpu-results.json python3 -m pytest -q tests/gpu -s
    # here, with the file copied into bench/results/:
    .venv/bin/python -m bench.gpu_results bench/results/h200x2-2026-11-30.json \
        --host "2x NVIDIA H200 (nvidia-h200-x2)" --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.common import write_section


def render(data: dict, source: Path, host: str) -> str:  # type: ignore[type-arg]
    rows = []
    for name, r in data["scenarios"].items():
        f, t = r["floor_ms"], r["teardown_ms"]
        ratio = statistics.mean(t) / statistics.mean(f)
        target = ""
        if name.startswith(("well-behaved", "ghost")):
            target = "≤ 1.2: " + ("met" if ratio <= 1.2 else f"MISSED by {ratio - 1.2:.2f}")
        rows.append(
            f"| {name} | {', '.join(map(str, f))} | {', '.join(map(str, t))} | {ratio:.2f} | "
            f"{target} |"
        )
    return (
        f"From `{source}` ({host}, driver {data['driver']}, {data['gpus']} GPUs, baseline "
        f"{data['baseline_mib']} MiB): two runs per scenario in one test run, milliseconds; "
        "ratio of the means.\n\n"
        "| scenario | floor (SIGKILL all holders → NVML at baseline) | teardown → CLEAN | "
        "teardown / floor | target |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results", type=Path)
    p.add_argument("--host", required=True)
    p.add_argument("--write", type=Path, default=None)
    args = p.parse_args()
    body = render(json.loads(args.results.read_text()), args.results, args.host)
    print(body)
    if args.write:
        write_section(args.write, "gpu-results", body)


if __name__ == "__main__":
    main()
