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

import bisect
import gzip
import json
import re
import resource
import sys
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from kimi_supervisor.analysis.collectives import KINDS, collective, from_args, group_of
from kimi_supervisor.analysis.jsonstream import TraceError, events, open_text
from kimi_supervisor.analysis.timeline import (
    STEP,
    overlap,
    step_times,
    steps_of,
    timeline,
    union,
)
from kimi_supervisor.analysis.timeline import kind_of as _kind

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
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
CPU_STEP_CATS = {"user_annotation", "cpu_op"}
TOP = 8


def classify(name: str) -> str:
    if collective(name) is not None:
        return "communication"
    for cls, pattern in CLASSES:
        if pattern.search(name):
            return cls
    return OTHER


@dataclass
class _Ops:
    """Operators or kernels as compact columns: start, duration (µs) and a name index."""

    ts: array[float] = field(default_factory=lambda: array("d"))
    dur: array[float] = field(default_factory=lambda: array("d"))
    name: array[int] = field(default_factory=lambda: array("l"))
    link: array[int] = field(default_factory=lambda: array("q"))  # a kernel's correlation id


@dataclass
class _Reader:
    names: dict[str, int] = field(default_factory=dict)
    kernels: _Ops = field(default_factory=_Ops)
    cpu_ops: dict[int, _Ops] = field(default_factory=dict)  # per thread
    cpu_steps: list[tuple[float, float, str, int]] = field(default_factory=list)
    gpu_steps: list[tuple[float, float, str]] = field(default_factory=list)
    # The CPU calls that launched kernels (cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch):
    # correlation id and start, to place each kernel in the step that launched it.
    launch_link: array[int] = field(default_factory=lambda: array("q"))
    launch_ts: array[float] = field(default_factory=lambda: array("d"))
    # NCCL kernels, by index: the collective and the process group their arguments name.
    nccl_args: dict[int, tuple[str | None, str]] = field(default_factory=dict)
    process_name: str = ""
    count: int = 0

    def index(self, name: str) -> int:
        n = self.names.get(name)
        if n is None:
            n = self.names[name] = len(self.names)
        return n

    def add(self, ev: dict[str, Any]) -> None:
        self.count += 1
        ph, cat = ev.get("ph"), ev.get("cat")
        if ph == "M":
            if ev.get("name") == "process_name" and not self.process_name:
                self.process_name = str((ev.get("args") or {}).get("name", ""))
            return
        if ph != "X" or cat == "python_function":  # with_stack's millions of frames
            return
        name = ev.get("name")
        try:
            ts, dur = float(ev["ts"]), float(ev.get("dur", 0))
        except (KeyError, TypeError, ValueError):
            return
        if not isinstance(name, str):
            return
        if cat in GPU_CATS:
            k = self.kernels
            if name[:4].lower() == "nccl":
                args = ev.get("args")
                self.nccl_args[len(k.ts)] = (from_args(args), group_of(args))
            k.ts.append(ts)
            k.dur.append(dur)
            k.name.append(self.index(name))
            k.link.append(_correlation(ev))
        elif cat in LAUNCH_CATS:
            if (link := _correlation(ev)) >= 0:
                self.launch_link.append(link)
                self.launch_ts.append(ts)
        elif cat == "gpu_user_annotation" and STEP.match(name):
            self.gpu_steps.append((ts, ts + dur, name))
        elif cat in CPU_STEP_CATS:
            tid = ev.get("tid")
            tid = tid if isinstance(tid, int) else hash(tid)
            if STEP.match(name):
                self.cpu_steps.append((ts, ts + dur, name, tid))
            elif cat == "cpu_op":
                ops = self.cpu_ops.get(tid)
                if ops is None:
                    ops = self.cpu_ops[tid] = _Ops()
                ops.ts.append(ts)
                ops.dur.append(dur)
                ops.name.append(self.index(name))


def _correlation(ev: dict[str, Any]) -> int:
    link = (ev.get("args") or {}).get("correlation")
    return link if isinstance(link, int) else -1


class _Launches:
    """When the CPU launched each kernel, by correlation id."""

    def __init__(self, links: array[int], starts: array[float]) -> None:
        if any(links[j] > links[j + 1] for j in range(len(links) - 1)):
            order = sorted(range(len(links)), key=links.__getitem__)
            links = array("q", (links[j] for j in order))
            starts = array("d", (starts[j] for j in order))
        self.links, self.starts = links, starts

    def start(self, link: int) -> float | None:
        k = bisect.bisect_left(self.links, link)
        if link >= 0 and k < len(self.links) and self.links[k] == link:
            return self.starts[k]
        return None


def _self_times(ops: _Ops) -> Iterator[tuple[float, float, int]]:
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


class _Windows:
    """Sorted, merged [start, end) ranges; `holds(t)` by bisection."""

    def __init__(self, ranges: list[tuple[float, float]]) -> None:
        merged = union(ranges)
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]

    def holds(self, t: float) -> bool:
        k = bisect.bisect_right(self.starts, t) - 1
        return k >= 0 and t < self.ends[k]


def summarize(text: IO[str]) -> dict[str, Any]:
    """The summary of one rank's trace (see the module's docstring); raises TraceError."""
    meta: dict[str, Any] = {}
    r = _Reader()
    for ev in events(text, meta):
        r.add(ev)
    device = "gpu" if len(r.kernels.ts) else "cpu"
    steps: dict[str, int] = {}
    for *_, name, _tid in r.cpu_steps:
        steps[_kind(name)] = steps.get(_kind(name), 0) + 1
    if not r.cpu_steps:
        for *_, name in r.gpu_steps:
            steps[_kind(name)] = steps.get(_kind(name), 0) + 1
    chosen = "decode" if steps.get("decode") else None

    def wanted(name: str) -> bool:
        return chosen is None or _kind(name) == chosen

    # A step's time is its execute_model on the CPU, which waits for the GPU's result; the GPU
    # ranges (start of the first kernel to the end of the last) include the launch queue.
    gpu_spans = [(s, e) for s, e, n in r.gpu_steps if wanted(n)]
    spans = [(s, e) for s, e, n, _ in r.cpu_steps if wanted(n)] or gpu_spans
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
    cpu_windows = _Windows([(s, e) for s, e, n, _ in r.cpu_steps if wanted(n)])
    attributed = "by step" if n_steps else "whole trace"
    launches = _Launches(r.launch_link, r.launch_ts)
    if device == "gpu":
        # A kernel belongs to the step whose CPU range launched it; without its launch, to the
        # step whose GPU range it starts in; without step marks, to the whole trace.
        gpu_windows = _Windows(gpu_spans) if gpu_spans else None
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
        step_threads = {tid for *_, n, tid in r.cpu_steps if wanted(n)}
        for tid, ops in r.cpu_ops.items():
            if step_threads and tid not in step_threads:
                continue
            for ts, own, n in _self_times(ops):
                if not n_steps or cpu_windows.holds(ts):
                    count(own, n)
    busy = sum(totals.values())
    divide = n_steps or 1
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    return {
        "device": device,
        "process": r.process_name,
        "rank": (meta.get("distributedInfo") or {}).get("rank"),
        "events": r.count,
        "steps": steps,
        "scope": scope,
        "attributed": attributed,
        "step_ms": round(sum(e - s for s, e in spans) / divide / 1000, 3) if n_steps else None,
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
        "collectives": _collectives(per_name, names, divide, busy),
        "step_times": step_times(steps_of(r)),
        "overlap": overlap(r, names),
        "timeline": timeline(r, names, launches, int(meta.get("baseTimeNanoseconds") or 0)),
    }


def _collectives(
    per_name: dict[int, list[float]], names: dict[int, str], divide: int, busy: float
) -> dict[str, Any]:
    """The communication class by collective: time per step, share of the busy time, calls, the
    implementations seen, and for `other`, the names (an unknown kernel is listed, never hidden)."""
    out: dict[str, Any] = {}
    for n, (t, calls) in per_name.items():
        c = collective(names[n])
        if c is None:
            continue
        kind, impl = c
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
