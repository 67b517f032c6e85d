"""The fake vLLM's fault switches (FakeOptions, from the JSON file named by
KIMI_FAKE_VLLM_CONFIG) and its log line, shared by its processes (sandbox/fake_vllm.py) and its
API server (sandbox/fake_api.py)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


@dataclass
class FakeOptions:
    load_s: float = 1.0  # time to "load the safetensors shards"
    shards: int = 64
    graph_capture_s: float = 0.2
    mib_per_worker: int = 90_000
    ignore_sigterm: bool = False  # every process of the tree ignores SIGTERM
    # The API server's orderly shutdown takes this long: real vLLM 0.16 took 0.3 to 3.6 s from
    # SIGTERM to its whole tree gone (CPU build, tensor parallel 2; tests/vllm_0_16.py).
    shutdown_delay_s: float = 0.3
    crash_during_load_at: int | None = None  # percent of shards: exit 1 there
    hang_during_load_at: int | None = None  # percent of shards: stop making progress
    # The two faults above hit only a vLLM started with --profiler-config (profile mode).
    load_faults_only_when_profiling: bool = False
    # A detached process started by worker 0 that escapes the unit's cgroup and keeps memory.
    ghost_title: str | None = None
    ghost_mib: int = 0
    ghost_cgroup_procs: list[str] = field(default_factory=list)
    # /stop_profile's stop and export: this long, with the engine blocked and busy (as vLLM 0.16
    # runs them on the engine core's loop: no step, no token, the CPU in use).
    profile_flush_s: float = 0.5
    # The engine's steps (see fake_vllm._generate): a prefill takes this per prompt token (a
    # word of the prompt), on the CPU; a decode step 1 ms, this share of it on the CPU.
    prefill_s_per_token: float = 0.0
    engine_busy_fraction: float = 0.25
    # While this file exists, the engine begins no step and uses no CPU (a deadlock).
    deadlock_file: str | None = None
    # While this file exists, the engine begins no step and a thread of it spins a core (as one
    # waits in torch.cuda.synchronize() behind a collective stuck on the GPU: 8.0 s of CPU in
    # 8.2 s, bench/cuda_wait_cpu.py), and the simulated GPUs read a kernel that spins (busy, no
    # memory or PCIe traffic, idle power: sandbox/simreader.COUNTERS, measured on an H100).
    stuck_collective_file: str | None = None
    # While this file exists, a thread of the engine spins a core, whatever else it does (steps
    # go on beside it).
    spinning_thread_file: str | None = None
    # While this file exists, the engine begins no step and waits for a child of its own that
    # uses a core, titled as a compiler's (`cc1plus`: FlashInfer's JIT compile of up to 10
    # minutes, ninja running nvcc and the C++ compiler); the simulated GPUs idle.
    compile_file: str | None = None
    # The compiler runs as a server out of the engine's tree (sccache's, started by a double
    # fork: its parent is the user manager, a subreaper, or PID 1), still in the unit's cgroup.
    compile_server: bool = False
    # From its start, the engine has a process of vLLM's user out of its tree (double forked) in
    # the unit's cgroup, using a core: a sidecar, no compiler's server (no client waits on it).
    sidecar: bool = False
    # While this file exists, the API server is busy (its event loop held by work, as a long
    # tokenization holds real vLLM's): it uses a core, and /health answers only once the
    # file is gone.
    api_busy_file: str | None = None
    # As if started with --disable-log-stats: /metrics has no vllm:* series.
    disable_log_stats: bool = False
    # The profiler endpoints fail: "404", "500", or "hang" (no answer for a minute).
    profiler_fault: str | None = None
    devices: list[int] | None = None  # GPU of each rank; default rank i -> GPU i
    # The trace names of vLLM 0.16 (`<id>-rank-N.<ts>.pt.trace.json.gz`) or 0.32 (`rankN.<ts>...`)
    trace_naming: str = "0.16"

    @classmethod
    def load(cls) -> FakeOptions:
        path = os.environ.get("KIMI_FAKE_VLLM_CONFIG", "")
        if not path or not Path(path).exists():
            return cls()
        raw = json.loads(Path(path).read_text() or "{}")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise SystemExit(f"{path}: unknown fake vLLM option(s): {', '.join(sorted(unknown))}")
        return cls(**raw)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


def log(msg: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"INFO {stamp} [fake_vllm] {msg}", flush=True)
