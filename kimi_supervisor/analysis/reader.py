"""What is kept of one rank's trace while it is read (analysis/trace.py feeds it the events one
at a time): the steps vLLM marks, the kernels and the CPU operators as compact columns, the CPU
calls that launched kernels, and what NCCL kernels' arguments say. Everything else is dropped.

Steps are vLLM's own marks: `execute_context_C(c)_generation_G(g)` around every execute_model
(vLLM 0.16), on the CPU and, on a GPU, on the GPU timeline too; a plain torch loop's
`ProfilerStep#N` counts as a step.
"""

from __future__ import annotations

import bisect
import re
from array import array
from dataclasses import dataclass, field
from typing import Any

from kimi_supervisor.analysis.collectives import (
    LOOKS_LIKE,
    from_args,
    group_of,
    nccl_bytes,
    shape_of,
)

STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$|^ProfilerStep#\d+$")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
CPU_STEP_CATS = {"user_annotation", "cpu_op"}
GLOO = "gloo:"  # the ranges gloo's worker threads record (ProcessGroupGloo's RECORD_FUNCTION)


@dataclass(frozen=True, slots=True)
class Step:
    """One step's range (µs) and its name; `thread` is the CPU thread that ran it (a CPU range),
    None for a GPU range."""

    start: float
    end: float
    name: str
    thread: int | None = None


@dataclass(frozen=True, slots=True)
class NcclArgs:
    """What an NCCL kernel's arguments name: its collective (None: they do not say) and its
    process group ("": they do not say)."""

    collective: str | None
    group: str
    nbytes: int | None = None  # the message, as nccl-tests sizes it (collectives.nccl_bytes)


@dataclass
class Ops:
    """Operators or kernels as compact columns: start, duration (µs) and a name index."""

    ts: array[float] = field(default_factory=lambda: array("d"))
    dur: array[float] = field(default_factory=lambda: array("d"))
    name: array[int] = field(default_factory=lambda: array("l"))
    link: array[int] = field(default_factory=lambda: array("q"))  # a kernel's correlation id
    # A collective operator's message as record_shapes gives it (collectives.shape_of), packed
    # in one number per operator: elements x 16 + bytes per element (0: not a dtype), -1: none.
    shape: array[int] = field(default_factory=lambda: array("q"))

    def shape_at(self, j: int) -> tuple[int, int | None] | None:
        """The j-th operator's (elements, bytes per element or None), None for no shape."""
        packed = self.shape[j] if j < len(self.shape) else -1
        if packed < 0:
            return None
        return packed >> 4, (packed & 15) or None


class Launches:
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


@dataclass
class Reader:
    """One rank's trace as it is read: `add` takes each event, and keeps what the summary and
    the timeline use of it."""

    names: dict[str, int] = field(default_factory=dict)
    kernels: Ops = field(default_factory=Ops)
    cpu_ops: dict[int, Ops] = field(default_factory=dict)  # per thread
    cpu_steps: list[Step] = field(default_factory=list)
    gpu_steps: list[Step] = field(default_factory=list)
    # The CPU calls that launched kernels (cudaLaunchKernel, cuLaunchKernelEx, cudaGraphLaunch):
    # correlation id and start, to place each kernel in the step that launched it.
    launch_link: array[int] = field(default_factory=lambda: array("q"))
    launch_ts: array[float] = field(default_factory=lambda: array("d"))
    # NCCL kernels, by index: the collective and the process group their arguments name.
    nccl_args: dict[int, NcclArgs] = field(default_factory=dict)
    # gloo's worker threads' ranges (`gloo:all_reduce`, a `user_annotation`): where a gloo
    # collective runs, waits included; the c10d operator on the calling thread only hands it
    # over (its wait is in `work.wait()`, which the profiler does not record).
    gloo: Ops = field(default_factory=Ops)
    process_name: str = ""
    count: int = 0
    _comm: dict[int, bool] = field(default_factory=dict)  # name index -> looks like a collective

    def _shape(self, n: int, ev: dict[str, Any]) -> int:
        """The packed message (Ops.shape) of a communication operator whose arguments carry
        shapes (record_shapes: vLLM's `torch_profiler_record_shapes`), else -1."""
        args = ev.get("args")
        if not isinstance(args, dict) or "Input Dims" not in args:
            return -1
        comm = self._comm.get(n)
        if comm is None:
            comm = self._comm[n] = bool(LOOKS_LIKE.search(ev["name"]))
        shape = shape_of(args) if comm else None
        if shape is None or shape[0] >= 1 << 58:
            return -1
        size = shape[1] if shape[1] is not None and shape[1] < 16 else 0
        return shape[0] << 4 | size

    def index(self, name: str) -> int:
        n = self.names.get(name)
        if n is None:
            n = self.names[name] = len(self.names)
        return n

    def launches(self) -> Launches:
        return Launches(self.launch_link, self.launch_ts)

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
                self.nccl_args[len(k.ts)] = NcclArgs(
                    from_args(args), group_of(args), nccl_bytes(args)
                )
            k.ts.append(ts)
            k.dur.append(dur)
            k.name.append(self.index(name))
            k.link.append(_correlation(ev))
        elif cat in LAUNCH_CATS:
            if (link := _correlation(ev)) >= 0:
                self.launch_link.append(link)
                self.launch_ts.append(ts)
        elif cat == "gpu_user_annotation" and STEP.match(name):
            self.gpu_steps.append(Step(ts, ts + dur, name))
        elif cat in CPU_STEP_CATS:
            tid = ev.get("tid")
            tid = tid if isinstance(tid, int) else hash(tid)
            if STEP.match(name):
                self.cpu_steps.append(Step(ts, ts + dur, name, tid))
            elif name.startswith(GLOO):
                g = self.gloo
                n = self.index(name)
                g.shape.append(self._shape(n, ev))
                g.ts.append(ts)
                g.dur.append(dur)
                g.name.append(n)
            elif cat == "cpu_op":
                ops = self.cpu_ops.get(tid)
                if ops is None:
                    ops = self.cpu_ops[tid] = Ops()
                n = self.index(name)
                ops.shape.append(self._shape(n, ev))
                ops.ts.append(ts)
                ops.dur.append(dur)
                ops.name.append(n)


def _correlation(ev: dict[str, Any]) -> int:
    link = (ev.get("args") or {}).get("correlation")
    return link if isinstance(link, int) else -1
