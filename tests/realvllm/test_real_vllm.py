"""Real vLLM 0.16 (its CPU build, tensor parallel 2) as the sandbox's vLLM, driven by the daemon:
the reference the fake vLLM copies. The simulated GPU host stays the GPU backend: real vLLM on a
CPU holds no GPU memory, so a teardown here is judged by the processes alone (the fake allocates
simulated memory; this is the seam). One vLLM start is shared by the tests in order."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.ports import processes
from supervisor.ports.http import request
from supervisor.sandbox.sandbox import DAEMON_UNIT, Sandbox
from supervisor.sandbox.usermanager import unavailable_reason

from ..conftest import (
    DaemonHelper,
    HealthWatch,
    SandboxHelper,
    assert_starts_like_vllm_0_16,
    wait_until,
)
from . import env

pytestmark = [pytest.mark.realvllm, pytest.mark.systemd]

READY_S = 600  # 38-105 s measured here; a loaded CI machine is slower


@pytest.fixture(scope="module")
def real() -> Iterator[DaemonHelper]:
    why = env.unavailable() or unavailable_reason()
    if why:
        pytest.skip(f"no real vLLM here: {why}")
    try:
        venv = env.venv()
        model = env.model(venv)
    except env.Unavailable as e:
        pytest.skip(f"no real vLLM here: {e}")
    root = Path(tempfile.mkdtemp(prefix="kimi-real-"))
    (root / "tmp").mkdir()
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": "{sandbox}/traces"})
    overrides = {
        "vllm": {"command": [str(venv / "bin" / "vllm"), "serve", str(model),
                             "--tensor-parallel-size", "2", "--dtype", "bfloat16"]},
        "modes": {"production": {"args": ["--max-model-len", "256"]},
                  "profile": {"args": ["--max-model-len", "256", "--profiler-config", profiler]}},
        "daemon": {"start_timeout_s": READY_S},
        "teardown": {"term_grace_s": 30},
    }  # fmt: skip
    vllm_env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_SLEEP_WHEN_IDLE": "1",  # else the idle workers spin at 100 % CPU
        "TMPDIR": str(root / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(env.CACHE / "inductor"),
    }
    sb = Sandbox.up(root, gpus=2, daemon=False, overrides=overrides, vllm_env=vllm_env)
    helper = SandboxHelper(sb)
    helper.indices = [0, 1]
    daemon = DaemonHelper(helper)
    try:
        daemon.start()
        daemon.wait_serving("production", READY_S)
        yield daemon
    finally:
        sb.down()
        shutil.rmtree(root, ignore_errors=True)


def as_executed(argv: list[str]) -> list[str]:
    """The command line the kernel shows for `argv`: a script (vLLM's console script) runs as
    its #! interpreter with the script's path in front of the arguments."""
    with open(argv[0], "rb") as f:
        first = f.readline()
    if first.startswith(b"#!"):
        return [*first[2:].decode().split(), *argv]
    return argv


def unit_tree(real: DaemonHelper) -> dict[int, str]:
    """PID -> argv[0] of every process in vLLM's unit."""
    cgroup = processes.cgroup_of(real.vllm_pid())
    return {
        pid: (processes.cmdline_of(pid) or [""])[0]
        for pid in processes.all_pids()
        if processes.cgroup_of(pid) == cgroup
    }


def test_real_vllm_serves_production_byte_exact_with_its_real_tree_and_health(
    real: DaemonHelper,
) -> None:
    pid = real.vllm_pid()
    argv = json.loads(real.config.vllm.argv_file.read_text())["argv"]
    assert processes.cmdline_of(pid) == as_executed(argv)  # byte for byte
    titles = sorted(unit_tree(real).values())
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(titles), titles
    health = request(real.config.vllm.health_url, timeout_s=5)
    assert health.status == 200 and not health.body


def test_a_real_capture_switches_records_and_lists_both_ranks(
    real: DaemonHelper, tmp_path: Path
) -> None:
    r = real.kimi_mode(
        "capture", "--switch", "--seconds", "1", "--then", "stay", "--out", str(tmp_path),
        timeout=READY_S + 300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (folder,) = tmp_path.iterdir()
    names = sorted(p.name for p in folder.iterdir())
    assert any("-rank-0." in n for n in names) and any("-rank-1." in n for n in names), names
    assert "rank   0" in r.stdout and "rank   1" in r.stdout, r.stdout
    argv = json.loads(real.config.vllm.argv_file.read_text())["argv"]
    assert "--profiler-config" in argv
    assert processes.cmdline_of(real.vllm_pid()) == as_executed(argv)


def test_back_to_production_tears_the_real_tree_down_and_starts_it_again(
    real: DaemonHelper,
) -> None:
    before = unit_tree(real)
    watch = HealthWatch(real.config.vllm.health_url)
    r = real.kimi_mode("production", timeout=READY_S + 120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_starts_like_vllm_0_16(watch.stop())  # the check the fake passes too (test_sandbox)
    assert not any(processes.ref_of(pid) for pid in before), "the old tree is gone"
    assert "--profiler-config" not in processes.cmdline_of(real.vllm_pid())


def test_the_daemon_follows_the_real_load_output_and_a_crashed_daemon_adopts_real_vllm(
    real: DaemonHelper,
) -> None:
    # Real vLLM writes `(Worker_TP0 pid=N) \rLoading safetensors checkpoint shards: 50% ...`:
    # the daemon's progress came from it.
    assert '"phase": "loading"' in real.log() and '"percent": 100' in real.log()
    vllm, first, teardowns = real.vllm_pid(), real.pid(), real.teardown_count()
    real.h.systemd.kill(DAEMON_UNIT, "main", signal.SIGKILL)
    wait_until(lambda: real.pid() not in (0, first), 20, "systemd to restart the daemon")
    real.wait_serving("production", 60)
    assert real.vllm_pid() == vllm and real.teardown_count() == teardowns


def test_sigkill_of_the_real_api_server_alone_orphans_its_engine_and_the_teardown_ends_them(
    real: DaemonHelper,
) -> None:
    bystander = real.h.spawn([sys.executable, "-c", "import time; time.sleep(900)"])
    tree = unit_tree(real)
    api = real.vllm_pid()
    engine = [pid for pid, title in tree.items() if title.startswith("VLLM::")]
    assert len(engine) == 3, tree  # EngineCore, Worker_TP0, Worker_TP1
    processes.send_signal(processes.ref_of(api), signal.SIGKILL)  # type: ignore[arg-type]
    # vLLM 0.16 leaves the engine and workers running without their API server (upstream
    # #55510): the daemon notices the death, tears down (they are among the first killed) and
    # serves again.
    try:
        wait_until(lambda: real.vllm_pid() not in (0, api), READY_S, "a new vLLM")
        real.wait_serving("production", READY_S)
        assert not [pid for pid in engine if processes.ref_of(pid)], "an orphan survived"
        assert processes.is_alive(bystander)
    finally:
        processes.send_signal(bystander, signal.SIGKILL)
