"""What vLLM 0.16 does, as measured with its CPU build in the real-vLLM tier: checks that run on
the fake vLLM (tests/sandbox/test_sandbox.py) and on real vLLM (tests/realvllm), so that the two
cannot drift apart. /health's behaviour is checked by conftest's HealthWatch and
assert_starts_like_vllm_0_16."""

from __future__ import annotations

import re
import time

from kimi_supervisor.ports import processes

TRACKER = re.compile(r"from multiprocessing\.resource_tracker import main;main\(\d+\)")


def tree_of(cgroup_pid: int) -> dict[int, list[str]]:
    """PID -> argv of every process in the cgroup of `cgroup_pid` (vLLM's unit)."""
    cgroup = processes.cgroup_of(cgroup_pid)
    return {
        pid: processes.cmdline_of(pid) or []
        for pid in processes.all_pids()
        if processes.cgroup_of(pid) == cgroup
    }


def assert_tree_like_vllm_0_16(api_server: int, tree: dict[int, list[str]], tp: int) -> None:
    """The API server's children are the engine core and the multiprocessing resource tracker
    (`python -c from multiprocessing.resource_tracker import main;main(N)`, with the
    interpreter's flags before -c: `-B` where it runs with PYTHONDONTWRITEBYTECODE, none under
    the unit); the engine's are the workers. Titles as vLLM sets them, and the kernel's
    15-character comm of each."""
    by_title = {argv[0]: pid for pid, argv in tree.items() if argv and argv[0].startswith("VLLM::")}
    workers = [f"VLLM::Worker_TP{r}" for r in range(tp)]
    assert sorted(by_title) == sorted(["VLLM::EngineCore", *workers]), tree
    engine = by_title["VLLM::EngineCore"]
    assert processes.comm_of(engine) == "VLLM::EngineCor"
    assert processes.ppid_of(engine) == api_server
    for title in workers:
        assert processes.comm_of(by_title[title]) == "VLLM::Worker_TP"
        assert processes.ppid_of(by_title[title]) == engine
    trackers = [
        pid
        for pid, argv in tree.items()
        if len(argv) >= 3 and argv[-2] == "-c" and TRACKER.fullmatch(argv[-1])
    ]
    assert len(trackers) == 1, tree
    assert processes.ppid_of(trackers[0]) == api_server


def assert_traces_like_vllm_0_16(names: list[str], tp: int) -> None:
    """One `<instance id>-rank-N.<ns>.pt.trace.json.gz` and one `profiler_out_N.txt` per rank,
    and the API server's `vm_<pid>.async_llm.<ns>.pt.trace.json.gz`."""
    for r in range(tp):
        assert [n for n in names if re.fullmatch(rf"\d+-rank-{r}\.\d+\.pt\.trace\.json\.gz", n)]
        assert f"profiler_out_{r}.txt" in names, names
    api = [n for n in names if re.fullmatch(r"vm_\d+\.async_llm\.\d+\.pt\.trace\.json\.gz", n)]
    assert len(api) == 1, names


LOAD = re.compile(
    rb"^\(Worker_TP0 pid=\d+\) +\rLoading safetensors checkpoint shards: +(\d+)% Completed \| "
    rb"\d+/\d+ \[",
    re.MULTILINE,
)


def assert_load_output_like_vllm_0_16(output: bytes) -> None:
    """Worker 0's shard bar: each update a carriage return after the process prefix, ending in
    a newline, from 0 % to 100 %; no other process prints one. tqdm pads some updates with a
    space before the carriage return (seen once in 16 updates, 2026-12-02)."""
    percents = [int(m.group(1)) for m in LOAD.finditer(output)]
    assert percents[:1] == [0] and percents[-1] == 100, percents
    bars = output.count(b"Loading safetensors checkpoint shards:")
    assert bars == len(percents), "a bar update without worker 0's prefix"


def assert_stops_like_vllm_0_16(pids: list[int], since: float) -> None:
    """After SIGTERM to the API server, the whole tree is gone within 5 s (0.3 to 3.6 s
    measured)."""
    deadline = since + 5
    while any(processes.ref_of(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if processes.ref_of(p)]
        time.sleep(0.05)
