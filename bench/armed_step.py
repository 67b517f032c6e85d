"""What an armed, idle profiler costs a decode step on a GPU, as vLLM 0.16 runs it.

vLLM 0.16's GPU worker, when `--profiler-config` names the torch profiler, builds a
`torch.profiler.profile(CPU, CUDA)` at start and never starts it until /start_profile
(vllm/profiler/wrapper.py, TorchProfilerWrapper). On every step, `Worker.annotate_profile`
(vllm/v1/worker/gpu_worker.py) calls `profiler.step()` (a boolean check while idle), builds the
step's annotation string and enters `torch.profiler.record_function(annotation)` around the
step. A plain worker has no profiler and enters a nullcontext. Both are copied below, line for
line in what they do, from the installed vllm 0.16 (the real-vLLM tier's build).

The step: one tensor-parallel rank of a Kimi-K2.5-sized decode step at batch 64 (61 layers of
hidden 7168; per layer an attention projection pair and an expert MLP pair, bf16, about 5.4 GB
of weights read per step), ending as vLLM's does, with the sampled tokens copied to the host.
It is shorter than a real step of the seed's host (no attention over a KV cache, no all-reduce),
so the per-step overhead weighs more here than there: a bound from above.

Arms, one process each so that a capture's after-effects stay in its arm, taken in turn round by
round (bench/abtest.py judges them): plain; armed; armed after one capture (start, 8 steps, stop,
export, at the process's start); the same with TEARDOWN_CUPTI=1 in its environment (Kineto then
tears CUPTI down after the capture); and a second plain process, whose difference from the first is
the noise between processes. Each arm runs the step eager (launch-bound: about 500 kernel
launches) and as one CUDA graph (as vLLM runs decode).

    python3 -m bench.armed_step --rounds 12 --steps 300 --out armed-step.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any

import torch

from bench.abtest import paired, sentence

HIDDEN = 7168
LAYERS = 61
BATCH = 64


class Profiler:
    """vLLM 0.16's TorchProfilerWrapper, the parts a step touches (no delay, no max iterations)."""

    def __init__(self, trace_dir: str) -> None:
        self._active = False
        self._running = False
        self._count = 0
        self.profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            record_shapes=False, profile_memory=False, with_stack=False, with_flops=False,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, use_gzip=False),
        )  # fmt: skip

    def step(self) -> None:
        if not self._active:
            return
        self._count += 1

    def start(self) -> None:
        self._active = True
        self.profiler.start()
        self._running = True

    def stop(self) -> None:
        self._active = False
        self.profiler.stop()
        self._running = False


def annotate(profiler: Profiler | None, running: int) -> Any:
    """Worker.annotate_profile: nothing without a profiler; else step() and a named range."""
    if profiler is None:
        return nullcontext()
    profiler.step()
    annotation = "".join(["execute_context_", "0", "(", "0", ")_generation_", str(running),
                          "(", str(running), ")"])  # fmt: skip
    return torch.profiler.record_function(annotation)


def model() -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(i: int, o: int) -> torch.Tensor:
        return torch.randn(i, o, device="cuda", dtype=torch.bfloat16, generator=g) * 0.01

    return [(w(HIDDEN, 2048), w(2048, HIDDEN), w(HIDDEN, 4096), w(4096, HIDDEN))
            for _ in range(LAYERS)]  # fmt: skip


def decode_step(layers: list[tuple[torch.Tensor, ...]], x: torch.Tensor) -> int:
    for wq, wo, w1, w2 in layers:
        x = x + (x @ wq) @ wo
        x = x + torch.nn.functional.silu(x @ w1) @ w2
        x = torch.nn.functional.rms_norm(x, (HIDDEN,))
    return int(x[:, :8].argmax(dim=-1).sum().item())  # the sampled tokens, to the host


def round_s(step: Any, profiler: Profiler | None, steps: int) -> float:
    """Median wall time of one step, over `steps` steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with annotate(profiler, BATCH):
            step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker(kind: str, graph: bool, conn: Any) -> None:
    """One arm in a process of its own, so that a capture's after-effects stay in its arm."""
    layers = model()
    x = torch.randn(BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16)
    profiler = None if kind.startswith("plain") else Profiler(tempfile.mkdtemp(prefix="armed-"))

    def eager() -> int:
        return decode_step(layers, x)

    step = eager
    if graph:  # as vLLM runs decode: one CUDA graph replayed, the sampled tokens copied out
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                decode_step(layers, x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        out = torch.empty(BATCH, HIDDEN, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.graph(g):
            y = x
            for wq, wo, w1, w2 in layers:
                y = y + (y @ wq) @ wo
                y = y + torch.nn.functional.silu(y @ w1) @ w2
                y = torch.nn.functional.rms_norm(y, (HIDDEN,))
            out.copy_(y)

        def replay() -> int:
            g.replay()
            return int(out[:, :8].argmax(dim=-1).sum().item())

        step = replay
    for _ in range(3):
        round_s(step, None, 20)  # warm-up: kernels chosen, clocks up
    info: dict[str, Any] = {}
    if kind.startswith("captured"):
        assert profiler is not None
        t0 = time.perf_counter()
        profiler.start()
        for _ in range(8):
            with annotate(profiler, BATCH):
                step()
        profiler.stop()
        info["capture_s"] = round(time.perf_counter() - t0, 3)
    conn.send(info)
    while (steps := conn.recv()) is not None:
        conn.send(round_s(step, profiler, steps))


ARMS = ("plain", "armed", "captured", "captured_teardown", "plain_b")
# Kineto leaves CUPTI subscribed after a capture unless TEARDOWN_CUPTI=1 (pytorch #144455: 10-20 %
# slower training after profiling; kineto #1264 turns teardown on by default for CUDA 12.6+).
ENV = {"captured_teardown": {"TEARDOWN_CUPTI": "1"}}


def run(rounds: int, steps: int, graph: bool) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    for kind in ARMS:
        mine, theirs = ctx.Pipe()
        procs[kind] = ctx.Process(target=worker, args=(kind, graph, theirs), daemon=True)
        saved = dict(os.environ)
        os.environ.update(ENV.get(kind, {}))  # a spawned child takes the environment at start
        try:
            procs[kind].start()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        conns[kind] = mine
    try:
        info = {kind: conns[kind].recv() for kind in ARMS}
        times: dict[str, list[float]] = {kind: [] for kind in ARMS}
        for i in range(rounds):  # in turn, one process at a time, the order rotated each round
            for kind in ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]:
                conns[kind].send(steps)
                times[kind].append(conns[kind].recv())
    finally:
        for kind in ARMS:
            with suppress(OSError):
                conns[kind].send(None)
            procs[kind].join(30)
    return {
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "graph": graph,
        "steps_per_round": steps, "rounds": rounds, "capture_s": info["captured"]["capture_s"],
        "step_s": times,
        "armed": paired(times["plain"], times["armed"], higher_is_better=False),
        "after_capture": paired(times["plain"], times["captured"], higher_is_better=False),
        "after_capture_teardown": paired(
            times["plain"], times["captured_teardown"], higher_is_better=False
        ),
        "plain_against_plain": paired(times["plain"], times["plain_b"], higher_is_better=False),
    }  # fmt: skip


def render(d: dict[str, Any]) -> str:
    how = "CUDA-graphed (as vLLM runs decode)" if d["graph"] else "eager (launch-bound)"
    return "\n".join([
        f"{d['gpu']}, torch {d['torch']}, {how}: {d['rounds']} rounds per arm of "
        f"{d['steps_per_round']} steps, one process per arm; a round's figure is its median step.",
        "- " + sentence("armed, idle", d["armed"], "step s"),
        "- " + sentence("armed after one capture", d["after_capture"], "step s"),
        "- " + sentence("armed after one capture, TEARDOWN_CUPTI=1", d["after_capture_teardown"],
                        "step s"),
        "- " + sentence("plain against a second plain process", d["plain_against_plain"], "step s"),
        f"- the capture itself (8 steps, stop and export): {d['capture_s']} s",
    ])  # fmt: skip


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--rounds", type=int, default=12)
    a.add_argument("--steps", type=int, default=300)
    a.add_argument("--out", type=Path, default=None)
    args = a.parse_args()
    runs = [run(args.rounds, args.steps, graph) for graph in (True, False)]
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1) + "\n")
    print("\n\n".join(render(d) for d in runs))


if __name__ == "__main__":
    main()
