"""Renders the real-vLLM tier's times into docs/performance.md from the JSON it writes.

    KIMI_REALVLLM_RESULTS=/tmp/realvllm.json .venv/bin/python -m pytest -q tests/realvllm
    cp /tmp/realvllm.json bench/results/realvllm-<date>.json
    .venv/bin/python -m bench.realvllm_results bench/results/realvllm-*.json \
        --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import write_section

ROWS = [
    ("first_ready_s", "daemon start → real vLLM serving production (the tier's one start)"),
    ("profile_to_production_s", "`kimi-mode production` from profile mode → serving again"),
    ("teardown_s", "its teardown of the real tree (stop the unit … leftovers) → CLEAN"),
    ("capture_flush_s", "a capture of 3 requests of 8 tokens: `/stop_profile` flush"),
    ("capture_summary_s", "the same capture: both ranks summarized (in parallel)"),
    ("capture_mb", "the same capture: trace files, MB in all"),
    ("orphans_killed_s", "SIGKILL of the API server alone → its orphaned engine and workers gone"),
    ("orphan_teardown_s", "that teardown, started by the daemon on the death → CLEAN"),
    ("leftovers_removed", "that teardown: ZMQ sockets and /dev/shm entries of the dead tree"),
    ("canary_s", "a liveness canary (one token of the served model), idle: answered in"),
    ("canary_tokens", "that canary: tokens, prompt and completion, as vLLM counts them"),
    (
        "hang_noticed_s",
        "VLLM::EngineCore frozen (SIGSTOP) while idle → its incident recorded "
        "(canary every 10 s, 30 s timeout)",
    ),
    ("hang_served_again_s", "the same freeze → serving again (teardown and a new load)"),
    ("flush_under_load_s", "a capture's flush under load, longer than the 5 s stall: no verdict"),
    (
        "capture_stall_tps",
        "that capture, no restart: vLLM's tokens/s before / recording / flush / "
        "after (its record's `stall`)",
    ),
    ("capture_stall_failed", "that capture: requests failed meanwhile"),
    ("worker_hang_noticed_s", "VLLM::Worker_TP1 frozen under load → its incident (stall 5 s)"),
    ("worker_hang_window_s", "that hang: the unavailable window the daemon reports"),
    ("worker_hang_clients_gap_s", "that hang: the longest gap between answers its clients saw"),
    ("deadlock_noticed_s", "the engine core deadlocked under load (no step, asleep) → incident"),
    ("deadlock_window_s", "that deadlock: the unavailable window the daemon reports"),
    ("deadlock_clients_gap_s", "that deadlock: the longest gap between answers its clients saw"),
    (
        "idle_deadlock_noticed_s",
        "the engine core deadlocked while idle, then sent requests (its gauges idle: the canary) "
        "→ incident",
    ),
    (
        "idle_deadlock_api_cpu_s",
        "that deadlock: the API server's CPU seconds over the canary's wait",
    ),
    ("idle_deadlock_window_s", "that deadlock: the unavailable window the daemon reports"),
    ("idle_deadlock_clients_gap_s", "that deadlock: what its clients went without"),
]


def render(runs: list[tuple[Path, dict[str, Any]]]) -> str:
    head = "| figure | " + " | ".join(f"`{p.name}` ({d['vllm']})" for p, d in runs) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]
    for key, label in ROWS:
        if not any(key in d for _, d in runs):
            continue  # a figure none of these runs measured
        lines.append(f"| {label} | " + " | ".join(str(d.get(key, "—")) for _, d in runs) + " |")
    with_steps = [d for _, d in runs if d.get("teardown_steps")]
    steps = with_steps[-1]["teardown_steps"] if with_steps else {}
    detail = ", ".join(f"{k} {v} s" for k, v in steps.items()) or "not recorded"
    return (
        "vLLM 0.16's CPU builds (each run's in its column's head; tensor parallel 2, the tiny "
        "model of tests/realvllm) under the daemon in the sandbox, on this 2-core VM; seconds "
        "unless marked.\n\n"
        + "\n".join(lines)
        + f"\n\nThe last run's teardown by step: {detail}.\n"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("results", type=Path, nargs="+")
    p.add_argument("--write", type=Path, default=None)
    args = p.parse_args()
    runs = [(path, json.loads(path.read_text())) for path in args.results]
    body = render(runs)
    print(body)
    if args.write:
        write_section(args.write, "real-vllm", body)


if __name__ == "__main__":
    main()
