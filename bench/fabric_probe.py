"""The fabric as NVML reports it on a GPU host, and a capture's summary naming it: for the lead to
run on the GPU host (no daemon needed).

    python3 -m bench.fabric_probe [--capture DIR] [--out FILE.json]

Prints the fabric reading (ports/gpu.py's NvmlGpu.fabric: per GPU, PCIe generation and width now
and at most, NVLink links, active and version), the fabric line a summary shows, and the
summary's lines of a capture folder that holds it: DIR when given (a capture of the daemon's;
its fabric.json is written there when it has none), else a fresh capture made here of one step
loop per visible GPU with torch (one process, NCCL when there are two GPUs or more, each rank's
trace as vLLM 0.16 names it), summarized as the daemon summarizes. --out keeps all of it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_supervisor.analysis import ranks  # noqa: E402
from kimi_supervisor.analysis.sizes import fabric_line  # noqa: E402
from kimi_supervisor.cli.summary_text import format_summary  # noqa: E402
from kimi_supervisor.ports.gpu import NvmlGpu, fabric_of  # noqa: E402
from kimi_supervisor.ports.safeopen import try_open  # noqa: E402

STEP = "execute_context_0(0)_generation_16(16)"


def _rank(rank: int, world: int, out: str, port: int) -> None:
    """One rank: a step loop of a GEMM and an all-reduce of a decode step's hidden state (16 x
    7168 bf16) and of 8x that, recorded as vLLM's workers record theirs."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.profiler import tensorboard_trace_handler as handler

    torch.cuda.set_device(rank)
    if world > 1:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)  # fmt: skip
    small = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16)
    large = torch.randn(128, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(7168, 7168, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        _ = small @ w
        if world > 1:
            dist.all_reduce(small)
            dist.all_reduce(large)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    trace = handler(out, worker_name=f"1796000000000000000-rank-{rank}", use_gzip=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], on_trace_ready=trace):
        for _ in range(20):
            with record_function(STEP):
                step()
                torch.cuda.synchronize()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def make_capture(folder: Path) -> dict[str, Any]:
    """A fresh capture in `folder` (see the module); what was made, or why not."""
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        return {"made": False, "why": f"no torch: {e}"}
    world = torch.cuda.device_count()
    if world < 1:
        return {"made": False, "why": "torch sees no GPU"}
    port = 29000 + os.getpid() % 1000
    mp.spawn(_rank, args=(world, str(folder), port), nprocs=world)
    return {"made": True, "gpus": world, "torch": torch.__version__}


def run(capture: Path | None) -> dict[str, Any]:
    reading = fabric_of(NvmlGpu())
    assert reading is not None
    out: dict[str, Any] = {"fabric": reading, "line": fabric_line(reading)}
    with tempfile.TemporaryDirectory(prefix="fabric-probe-") as tmp:
        folder = capture or Path(tmp)
        if capture is None:
            out["capture"] = make_capture(folder)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if not (folder / ranks.FABRIC).exists():
                ranks.write(fd, reading, name=ranks.FABRIC)  # as the daemon's capture does
            summary = ranks.summarize(fd, os.listdir(fd), try_open)
        finally:
            os.close(fd)
        text = format_summary(summary)
        out["summary_fabric"] = summary.get("fabric")
        out["summary_lines"] = [
            line for line in text.splitlines() if "fabric" in line or "data:" in line
        ]
        out["summary"] = text
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capture", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    got = run(a.capture)
    print(json.dumps(got["fabric"], indent=1))
    print(got["line"])
    print(got["summary"])
    if a.out:
        a.out.write_text(json.dumps(got, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
