"""The fake vLLM's profiler traces: named as vLLM 0.16 (or 0.32) names them, and shaped like a
vLLM 0.16 CPU worker's (tests/vllm_0_16.py checks both against the real tier's)."""

from __future__ import annotations

import json
import time
from typing import Any


def trace_name(naming: str, instance: str, rank: int) -> str:
    if naming == "0.32":
        return f"rank{rank}.{time.time_ns()}.pt.trace.json.gz"
    return f"{instance}-rank-{rank}.{time.time_ns()}.pt.trace.json.gz"


def trace(rank: int | None, pid: int, steps: int = 6) -> str:
    """A small Chrome trace shaped like a vLLM 0.16 CPU worker's: decode steps marked
    `execute_context_0(0)_generation_4(4)` (one prefill first), each with a GEMM, an attention
    and an all-reduce operator under a parent (own times: 600, 200 and 300 + 100 x rank us: the
    ranks arrive apart and end together), and
    the with_stack Python frames the summary skips. The API server's (rank None) has no steps."""
    ev: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
         "args": {"name": "python" if rank is None else f"VLLM::Worker_TP{rank}"}},
    ]  # fmt: skip

    def op(cat: str, name: str, ts: float, *, dur: float) -> None:
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": pid, "ts": ts,
                   "dur": dur})  # fmt: skip

    for i in range(steps if rank is not None else 0):
        t = 1000.0 + i * 2000
        prefill = i == 0
        op("user_annotation", f"execute_context_{int(prefill)}({4 * prefill})_generation_"
           f"{4 * (not prefill)}({4 * (not prefill)})", t, dur=1500)  # fmt: skip
        op("python_function", "vllm/v1/worker/gpu_worker.py(603): execute_model", t, dur=1500)
        op("cpu_op", "aten::linear", t + 10, dur=650)
        op("cpu_op", "_C::onednn_mm", t + 20, dur=600)
        op("cpu_op", "vllm::unified_attention_with_output", t + 660, dur=200)
        # Every rank's all-reduce ends at one moment (as on real GPUs; analysis/skew.py), rank r
        # arriving 100 x r us before rank 0: the last to arrive is rank 0, every rank's transfer
        # 300 us, its wait 100 x r.
        late = 100 * rank  # type: ignore[operator]
        op("cpu_op", "_C::shm_allreduce", t + 1170 - late, dur=300 + late)
    return json.dumps({"schemaVersion": 1, "traceEvents": ev, "traceName": "fake"}, indent=1)
