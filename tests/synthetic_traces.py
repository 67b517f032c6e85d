"""A synthetic GPU capture with a known skew: `world` ranks' traces shaped like the H200 fixture's
(tests/fixtures/make_gpu_trace.py: vLLM's step marks, kernels launched from them, NCCL all-reduce
kernels with their arguments), where one rank arrives late at every all-reduce by a set amount.

What the generator injects follows what the fixture measured on two H200s: a rank's NCCL kernel
starts when that rank arrives and spins until the last rank is there; every rank's kernel then
ends at the same moment (the fixture's ends of each all-reduce agree within 1 µs), after the
transfer. So a rank's wait is the last arrival less its own, which is what analysis/skew.py must
recover; `write_capture` returns that truth, summed per rank.

Written as a stream (one event at a time), so that the bench can make 8 ranks x 200 MB.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import IO, Any

STEP_NAME = "execute_context_0(0)_generation_16(16)"
GEMM = "nvjet_sm90_tst_64x16_64x16_2x1_v_bz_splitK_NNT"
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
BASE_NS = 1790857026000000000  # the fixture's baseTimeNanoseconds
T0 = 5223768000000.0  # µs, of the fixture's order


def _arrivals(
    seed: int, step: int, layer: int, world: int, late: int, late_us: float, jitter_us: float
) -> list[float]:
    """Each rank's arrival at one all-reduce, after the layer's compute (µs): the same on every
    rank's generator (seeded by the call), the late rank `late_us` behind."""
    rng = random.Random(hash((seed, step, layer)))
    return [late_us if r == late else rng.uniform(0, jitter_us) for r in range(world)]


def write_rank(
    out: IO[str],
    rank: int,
    world: int,
    steps: int,
    layers: int,
    late: int = -1,
    late_us: float = 0.0,
    transfer_us: float = 30.0,
    compute_us: float = 100.0,
    jitter_us: float = 0.0,
    seed: int = 1,
    cpu_ops: int = 2,
    clock_us: Any = 0.0,
    startup_us: float = 0.0,
) -> dict[str, float]:
    """One rank's trace, written to `out`; returns its true wait and transfer in µs (the decode
    steps after the first, as the split counts them). `cpu_ops` CPU operators per layer give the
    trace a real one's bulk (most of a trace's events are CPU operators). `clock_us` (a number,
    or one per rank) is added to every time of the rank's: a trace from another host's clock.
    `startup_us`: the second step is a start-up step (a shape compiled on one rank), its late
    rank later by that much at every layer; the split leaves it out, and so does the truth."""
    offset = clock_us[rank] if isinstance(clock_us, list | tuple) else clock_us
    normal_us = compute_us + late_us + jitter_us + transfer_us + 20
    head = {
        "schemaVersion": 1,
        "baseTimeNanoseconds": BASE_NS,
        "displayTimeUnit": "ms",
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
    }
    out.write(json.dumps(head)[:-1] + ', "traceEvents": [\n')
    out.write(
        json.dumps(
            {
                "ph": "M",
                "name": "process_name",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"VLLM::Worker_TP{rank}"},
            }
        )
    )
    truth = {"wait_us": 0.0, "transfer_us": 0.0}
    link = 0

    def ev(**e: Any) -> None:
        out.write(",\n" + json.dumps(e, separators=(",", ":")))

    t = T0 + offset
    for s in range(steps):
        slow = startup_us if s == 1 else 0.0
        layer_us = normal_us + slow
        step_us = layers * layer_us + 50
        ev(ph="X", cat="user_annotation", name=STEP_NAME, pid=rank, tid=1, ts=t, dur=step_us - 10)
        for layer in range(layers):
            start = t + 5 + layer * layer_us
            arrive = _arrivals(seed, s, layer, world, late, late_us + slow, jitter_us)
            last = max(arrive)
            for j in range(cpu_ops):
                ev(
                    ph="X",
                    cat="cpu_op",
                    name="aten::mm" if j % 2 == 0 else "aten::empty",
                    pid=rank,
                    tid=1,
                    ts=start + j,
                    dur=0.5,
                    args={"External id": link * 8 + j, "Record function id": 0, "Ev Idx": j},
                )
            for name, k_start, k_end, extra in (
                (GEMM, start, start + compute_us + (arrive[rank] if rank == late else 0), {}),
                (
                    ALL_REDUCE,
                    start + compute_us + arrive[rank],
                    start + compute_us + last + transfer_us,
                    {
                        "Collective name": "allreduce",
                        "Process Group Name": "0",
                        "Group size": world,
                    },
                ),
            ):
                link += 1
                ev(
                    ph="X",
                    cat="cuda_runtime",
                    name="cudaLaunchKernel",
                    pid=rank,
                    tid=1,
                    ts=start + 1,
                    dur=2,
                    args={"correlation": link},
                )
                ev(
                    ph="X",
                    cat="kernel",
                    name=name,
                    pid=0,
                    tid=7,
                    ts=k_start,
                    dur=k_end - k_start,
                    args={"correlation": link, "device": rank, "stream": 7, **extra},
                )
            if s > (1 if startup_us else 0):
                truth["wait_us"] += last - arrive[rank]
                truth["transfer_us"] += transfer_us
        t += step_us
    out.write("\n]}\n")
    return truth


def write_capture(
    folder: Path, world: int, steps: int, layers: int, gz: bool = True, **kw: Any
) -> dict[int, dict[str, float]]:
    """`world` ranks' traces in `folder`, named as vLLM 0.16 names them; the truth per rank."""
    folder.mkdir(parents=True, exist_ok=True)
    truth = {}
    for rank in range(world):
        name = f"1796000000000000000-rank-{rank}.1796080794321189670.pt.trace.json"
        if gz:
            with gzip.open(folder / f"{name}.gz", "wt", compresslevel=1) as f:
                truth[rank] = write_rank(f, rank, world, steps, layers, **kw)
        else:
            with open(folder / name, "w") as f:
                truth[rank] = write_rank(f, rank, world, steps, layers, **kw)
    return truth
