"""One rank's torch profiler trace (Chrome trace JSON, gzipped or not) read as a stream and
reduced to the figures an operator asks of a capture: how many steps, how long a step takes, and
which share of it goes to communication, GEMM, attention and the rest, with the top kernels.

The trace is never held whole: events are decoded one at a time from a window of the unpacked
text (a few MB however large the file), and only the few fields the summary needs are kept.

Steps are vLLM's own marks. vLLM 0.16 wraps every execute_model in a `record_function` named
`execute_context_C(c)_generation_G(g)` (C prefill requests of c tokens, G decode requests of g
tokens; vllm/v1/worker/gpu_worker.py `annotate_profile`, seen in the real CPU tier's traces). On a
GPU the profiler also writes that range on the GPU timeline (`gpu_user_annotation`), and kernels
are attributed to the steps whose GPU range holds them. A plain torch loop's `ProfilerStep#N`
counts as a step too. Decode steps (C = 0) are summarized when there are any, because decode is
what a serving host spends its time in; else every step; else the whole trace.

On a GPU trace the time is the kernels' (`cat` kernel, memcpy, memset). On a CPU trace (vLLM's
CPU build) it is the operators' own time (a parent's time less its children's), so that
`aten::linear` around `_C::onednn_mm` is not counted twice.
"""

from __future__ import annotations

import gzip
import json
import re
import resource
import sys
from collections.abc import Iterator
from typing import IO, Any

from kimi_supervisor.analysis.collectives import KINDS, collective
from kimi_supervisor.analysis.jsonstream import TraceError, events, open_text
from kimi_supervisor.analysis.reader import Ops, Reader
from kimi_supervisor.analysis.timeline import (
    Windows,
    kind_of,
    overlap,
    step_times,
    steps_of,
    timeline,
)

# After communication (analysis/collectives.py), the first class that matches wins: an attention
# kernel may carry "cutlass" in its name.
CLASSES: list[tuple[str, re.Pattern[str]]] = [
    (
        "attention",
        re.compile(
            r"attn|attention|flash|fmha|paged|sdpa|\bmla|reshape_and_cache|kv_cache",
            re.IGNORECASE,
        ),
    ),
    (
        "gemm",
        re.compile(
            r"gemm|matmul|\bmm\b|::mm\b|addmm|bmm|onednn_mm|cutlass|cublas|marlin|xmma|wgmma|"
            r"nvjet|linear|moe",
            re.IGNORECASE,
        ),
    ),
]
OTHER = "other"
CLASS_NAMES = ["communication", "gemm", "attention", OTHER]  # as shown
TOP = 8


def classify(name: str) -> str:
    if collective(name) is not None:
        return "communication"
    for cls, pattern in CLASSES:
        if pattern.search(name):
            return cls
    return OTHER


def _self_times(ops: Ops) -> Iterator[tuple[float, float, int]]:
    """(start, own time, name index) of each operator of one thread: its duration less its
    children's (operators nest on a thread)."""
    order = sorted(range(len(ops.ts)), key=lambda j: (ops.ts[j], -ops.dur[j]))
    own = [0.0] * len(ops.ts)
    stack: list[int] = []
    for j in order:
        start = ops.ts[j]
        while stack and ops.ts[stack[-1]] + ops.dur[stack[-1]] <= start:
            stack.pop()
        own[j] = ops.dur[j]
        if stack:
            own[stack[-1]] -= min(ops.dur[j], ops.ts[stack[-1]] + ops.dur[stack[-1]] - start)
        stack.append(j)
    for j in range(len(ops.ts)):
        yield ops.ts[j], max(own[j], 0.0), ops.name[j]


def summarize(text: IO[str]) -> dict[str, Any]:
    """The summary of one rank's trace (see the module's docstring); raises TraceError."""
    meta: dict[str, Any] = {}
    r = Reader()
    for ev in events(text, meta):
        r.add(ev)
    device = "gpu" if len(r.kernels.ts) else "cpu"
    steps: dict[str, int] = {}
    for step in r.cpu_steps or r.gpu_steps:
        steps[kind_of(step.name)] = steps.get(kind_of(step.name), 0) + 1
    chosen = "decode" if steps.get("decode") else None

    def wanted(name: str) -> bool:
        return chosen is None or kind_of(name) == chosen

    # A step's time is its execute_model on the CPU, which waits for the GPU's result; the GPU
    # ranges (start of the first kernel to the end of the last) include the launch queue.
    cpu_steps = [s for s in r.cpu_steps if wanted(s.name)]
    gpu_steps = [s for s in r.gpu_steps if wanted(s.name)]
    spans = cpu_steps or gpu_steps
    n_steps = len(spans)
    scope = f"{chosen} steps" if chosen else ("all steps" if n_steps else "the whole trace")

    totals = dict.fromkeys(CLASS_NAMES, 0.0)
    per_name: dict[int, list[float]] = {}  # name index -> [time, calls]

    def count(dur: float, n: int) -> None:
        totals[classes[n]] += dur
        acc = per_name.setdefault(n, [0.0, 0])
        acc[0] += dur
        acc[1] += 1

    names = {v: k for k, v in r.names.items()}
    classes = {n: classify(name) for n, name in names.items()}
    cpu_windows = Windows(cpu_steps)
    attributed = "by step" if n_steps else "whole trace"
    launches = r.launches()
    if device == "gpu":
        # A kernel belongs to the step whose CPU range launched it; without its launch, to the
        # step whose GPU range it starts in; without step marks, to the whole trace.
        gpu_windows = Windows(gpu_steps) if gpu_steps else None
        if n_steps and not r.launch_link and gpu_windows is None:
            attributed = "whole trace divided by steps"
        k = r.kernels
        for ts, dur, n, link in zip(k.ts, k.dur, k.name, k.link, strict=True):
            if n_steps:
                launched = launches.start(link)
                if launched is not None and cpu_windows.starts:
                    if not cpu_windows.holds(launched):
                        continue
                elif gpu_windows is not None and not gpu_windows.holds(ts):
                    continue
            count(dur, n)
    else:
        # Operators' own time, on the threads that ran the steps, inside the steps.
        step_threads = {s.thread for s in cpu_steps}
        for tid, ops in r.cpu_ops.items():
            if step_threads and tid not in step_threads:
                continue
            for ts, own, n in _self_times(ops):
                if not n_steps or cpu_windows.holds(ts):
                    count(own, n)
    busy = sum(totals.values())
    divide = n_steps or 1
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    in_steps = sum(s.end - s.start for s in spans)
    base_ns = int(meta.get("baseTimeNanoseconds") or 0)
    return {
        "device": device,
        "process": r.process_name,
        "rank": (meta.get("distributedInfo") or {}).get("rank"),
        "events": r.count,
        "steps": steps,
        "scope": scope,
        "attributed": attributed,
        "step_ms": round(in_steps / divide / 1000, 3) if n_steps else None,
        "busy_ms_per_step": round(busy / divide / 1000, 3),
        "classes": {
            c: {
                "ms_per_step": round(t / divide / 1000, 3),
                "share": round(t / busy, 4) if busy else 0.0,
            }
            for c, t in totals.items()
        },
        "top": [
            {
                "name": names[n],
                "class": classes[n],
                "calls": int(calls),
                "ms_per_step": round(t / divide / 1000, 3),
                "share": round(t / busy, 4) if busy else 0.0,
            }
            for n, (t, calls) in top
        ],
        "collectives": _collectives(per_name, names, divide, busy=busy),
        "step_times": step_times(steps_of(r)),
        "overlap": overlap(r, names),
        "timeline": timeline(r, names, launches, base_ns=base_ns).to_json(),
    }


def _collectives(
    per_name: dict[int, list[float]], names: dict[int, str], divide: int, *, busy: float
) -> dict[str, Any]:
    """The communication class by collective: time per step, share of the busy time, calls, the
    implementations seen, and for `other`, the names (an unknown kernel is listed, never hidden)."""
    out: dict[str, Any] = {}
    for n, (t, calls) in per_name.items():
        c = collective(names[n])
        if c is None:
            continue
        kind, impl = c.kind, c.implementation
        row = out.setdefault(kind, {"t": 0.0, "calls": 0, "implementations": [], "names": []})
        row["t"] += t
        row["calls"] += int(calls)
        if impl not in row["implementations"]:
            row["implementations"].append(impl)
        if kind == "other" and len(row["names"]) < TOP:
            row["names"].append(names[n])
    return {
        kind: {
            "ms_per_step": round(row["t"] / divide / 1000, 3),
            "share": round(row["t"] / busy, 4) if busy else 0.0,
            "calls": row["calls"],
            "implementations": sorted(row["implementations"]),
            **({"names": row["names"]} if kind == "other" else {}),
        }
        for kind in KINDS
        if (row := out.get(kind))
    }


def summarize_file(raw: IO[bytes]) -> dict[str, Any]:
    try:
        return summarize(open_text(raw))
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise TraceError(f"cannot read the trace: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m kimi_supervisor.analysis.trace [--memory-mb N] < TRACE`: the summary as JSON
    on stdout, or {"error": ...}. The daemon runs one per rank, in parallel, each on a file it
    opened; with --memory-mb, this process's address space is capped there first (RLIMIT_AS),
    and a trace that needs more is an error, whatever it holds."""
    args = sys.argv[1:] if argv is None else argv
    cap = int(args[1]) if args[:1] == ["--memory-mb"] and len(args) > 1 else 0
    if cap > 0:
        limit = cap * 2**20
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        out: dict[str, Any] = summarize_file(sys.stdin.buffer)
    except TraceError as e:
        out = {"error": str(e)}
    except MemoryError:
        out = {
            "error": f"the trace needs more than {cap} MiB to summarize, the summarizer's cap "
            "(a trace of a few steps needs tens of MB: is it a trace?)"
        }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
