"""Renders the real-GPU figures into docs/performance.md from the JSON the GPU tests write.

    # on the GPU host (see tests/gpu/test_real_gpus.py):
    KIMI_GPU_RESULTS=$OUT/gpu-results.json python3 -m pytest -q tests/gpu -s
    # here, with the file copied into bench/results/:
    .venv/bin/python -m bench.gpu_results bench/results/h200x2-2026-11-30-run*.json \
        --host "2x NVIDIA H200 (nvidia-h200-x2)" --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.common import write_section


def render(runs: list[tuple[Path, dict]], host: str) -> str:  # type: ignore[type-arg]
    rows = []
    ratios: dict[str, list[float]] = {}
    for source, data in runs:
        for name, r in data["scenarios"].items():
            f, t = r["floor_ms"], r["teardown_ms"]
            ratio = statistics.mean(t) / statistics.mean(f)
            ratios.setdefault(name, []).append(ratio)
            rows.append(
                f"| {source.stem} | {name} | {', '.join(map(str, f))} | "
                f"{', '.join(map(str, t))} | {ratio:.2f} |"
            )
    summary = []
    for name, rs in ratios.items():
        line = f"- {name}: ratio {', '.join(f'{r:.2f}' for r in rs)} in {len(rs)} run(s)"
        if name.startswith(("well-behaved", "ghost")):
            worst = max(rs)
            line += "; target ≤ 1.2 " + (
                "met in every run" if worst <= 1.2 else f"missed by {worst - 1.2:.2f} at worst"
            )
        summary.append(line)
    first = runs[0][1]
    return (
        f"{host}, driver {first['driver']}, {first['gpus']} GPUs, baseline "
        f"{first['baseline_mib']} MiB; from "
        + ", ".join(f"`{src}`" for src, _ in runs)
        + ". Two measurements per scenario in each test run, milliseconds; ratio of the "
        "means.\n\n"
        "| run | scenario | floor (SIGKILL all holders → NVML at baseline) | teardown → CLEAN | "
        "teardown / floor |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
        + "\n".join(summary)
        + "\n"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--host", required=True)
    p.add_argument("--write", type=Path, default=None)
    args = p.parse_args()
    runs = [(path, json.loads(path.read_text())) for path in args.results]
    body = render(runs, args.host)
    print(body)
    if args.write:
        write_section(args.write, "gpu-results", body)


if __name__ == "__main__":
    main()
