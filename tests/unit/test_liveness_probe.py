"""The liveness probe (loop/liveness.py) as it reads a real process tree: an "API server" (this
test's process, the tree's root, as vLLM's MainPID is) with a `VLLM::EngineCore` child, and a
small HTTP server in vLLM's place whose /metrics says idle and whose /v1/completions never
answers in time. An API server busy tokenizing a long prompt holds the canary while its engine
idles, and /metrics does not show that work yet (an outside review got a false hang from it when
the canary was judged on the engine alone): its own CPU over the canary's wait makes a doubt."""

from __future__ import annotations

import http.server
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import pytest

from kimi_supervisor.config import Config
from kimi_supervisor.decide.liveness import API_BUSY_FRACTION, Hang, gpu_said
from kimi_supervisor.loop.liveness import Liveness, Reading
from kimi_supervisor.model import GpuActivity
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.gpu import GpuPort
from kimi_supervisor.sandbox.simreader import COUNTERS
from tests.conftest import wait_until

from .loophost import config_for

# The tree's root: busy (a tokenization that takes a core) or idle; its child is titled as
# vLLM 0.16 titles its engine core, and sleeps (an idle engine: /metrics says nothing runs).
# argv[2]: `sleep` under the engine's title (see `titled`).
API_SERVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.argv[2], "60"])
print(child.pid, flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    if sys.argv[1] != "busy":
        time.sleep(0.05)
"""

IDLE_METRICS = (
    "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    "vllm:generation_tokens_total 5\nvllm:prompt_tokens_total 9\n"
    "vllm:iteration_tokens_total_count 3\n"
)


class Vllm(http.server.ThreadingHTTPServer):
    daemon_threads = True
    released = threading.Event()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = IDLE_METRICS if self.path == "/metrics" else json.dumps({"data": [{"id": "m"}]})
        self.answer(body.encode())

    def do_POST(self) -> None:
        Vllm.released.wait(10)  # the canary waits behind whatever holds the server

    def answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_a: object) -> None:
        pass


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Config]:
    """The loop's configuration, with this HTTP server listening where it says vLLM is."""
    config = config_for(tmp_path)
    server = Vllm(("127.0.0.1", config.vllm.port), Handler)
    Vllm.released.clear()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield config
    finally:
        Vllm.released.set()
        server.shutdown()
        server.server_close()


def titled(folder: Path, title: str, program: str) -> str:
    """`program` under a name that makes its comm `title` (cut to 15 characters), as vLLM's
    setproctitle does: a link named so (`exec -a` gives argv[0] only; the kernel takes the comm
    from the path executed). Quoted for a shell."""
    link = folder / title
    if not link.is_symlink():
        found = shutil.which(program)
        assert found, program
        link.symlink_to(found)
    return shlex.quote(str(link))


def verdict(config: Config, api_server: str) -> tuple[Hang | None, str, Reading]:
    """One canary against the tree whose root is `api_server` ("busy" or "idle"): the verdict,
    the doubt, and the reading."""
    folder = Path(tempfile.mkdtemp(prefix="kimi-titled-"))
    engine = shlex.split(titled(folder, "VLLM::EngineCore", "sleep"))[0]
    api = subprocess.Popen(
        [sys.executable, "-c", API_SERVER, api_server, engine], stdout=subprocess.PIPE, text=True
    )
    planted = [processes.ref_of(api.pid)]
    try:
        assert api.stdout is not None
        planted.append(processes.ref_of(int(api.stdout.readline())))
        readings: list[Reading] = []
        # A 3 s wait: a busy API server's share of a core, over it, holds on a loaded host.
        c = config.liveness.model_copy(update={"canary_timeout_s": 3.0})
        config = config.model_copy(update={"liveness": c})
        live = Liveness(config, readings.append)
        live.serving(api.pid, 0.0, capturing=False)  # the first reading: no canary yet
        deadline = time.monotonic() + 30  # a loaded host's threads
        while not readings and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.seen(readings.pop(), 0.1) is None
        live.serving(api.pid, config.liveness.canary_interval_s + 1, capturing=False)
        deadline = time.monotonic() + 30  # a loaded host's threads
        # The canary's reading comes on its own thread, beside the probe's.
        while not any(r.kind == "canary" for r in readings) and time.monotonic() < deadline:
            time.sleep(0.01)
        (reading,) = [r for r in readings if r.kind == "canary"]
        assert reading.canary is not None and not reading.canary.answered, reading
        hang = live.seen(reading, config.liveness.canary_interval_s + 3)
        if live.gathering:  # a verdict: handed on once its evidence is read
            assert hang is None
            while not any(r.kind == "evidence" for r in readings) and time.monotonic() < deadline:
                time.sleep(0.01)
            (kept,) = [r for r in readings if r.kind == "evidence"]
            hang = live.seen(kept, config.liveness.canary_interval_s + 4)
            assert hang is not None and live.kept is not None
            for ref in planted:  # every process of vLLM's tree, by PID
                assert ref is not None and f"-- PID {ref.pid} (" in live.kept["stacks"]
        return hang, live.judge.doubt, reading
    finally:
        for ref in planted:
            if ref is not None:
                processes.send_signal(ref, signal.SIGKILL)
        api.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_canary_held_by_a_busy_api_server_while_the_engine_idles_is_a_doubt_not_a_hang(
    config: Config,
) -> None:
    # The case needs an API server that got its share of a core during the canary's wait; a
    # host loaded past what it can give (load 15 on 2 cores) starves it, and the rule then
    # rightly says hung: that run is not this case, and it is made again (3 tries).
    for _ in range(3):
        hang, doubt, reading = verdict(config, "busy")
        assert reading.canary is not None and reading.canary.others_s is not None
        if reading.canary.others_s >= API_BUSY_FRACTION * reading.canary.took_s:
            break
    assert hang is None, hang
    assert doubt.startswith("a one-token request got no answer in 3 s, but vLLM's API"), doubt
    assert "(the canary may wait behind them): not hung" in doubt
    assert reading.canary is not None and reading.canary.others_s is not None
    # The busy API server's CPU over the canary's wait (a core it wants; a loaded host gives
    # it less), past the rule's share.
    busy = API_BUSY_FRACTION * reading.canary.took_s
    assert reading.canary.others_s >= busy, reading.canary
    # The engine's own reading is the idle child's alone.
    assert reading.cpu is not None and reading.cpu.processes == 1


def test_a_canary_unanswered_while_the_whole_tree_idles_is_a_hang(
    config: Config,
) -> None:
    hang, _doubt, _reading = verdict(config, "idle")
    assert hang is not None
    assert hang.reason.startswith("a one-token request got no answer in 3 s; the engine: 1 proc")
    assert hang.evidence["api_cpu_s"] < 0.5, hang.evidence


# Burns `seconds` of its own CPU once the file `go` exists (CPU time, not wall time: the same
# work however loaded the host), then exits, or stays ("stay") once it wrote the file `done`.
BURNER = """
import os, sys, time
go, seconds, stay = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "stay"
while not os.path.exists(go):
    time.sleep(0.01)
t = time.process_time()
while time.process_time() - t < seconds:
    pass
if stay:  # and says it burned (the tree's cwd)
    open("done", "w").close()
    time.sleep(60)
"""


def cpu_counted(tmp_path: Path, script: str, engine_only: bool) -> float:
    """The CPU seconds engine_cpu counts for the tree `bash -c script` builds (its burners wait
    for tmp_path/go; the script touches tmp_path/done once they have burned), from before the
    go to the done. The tree runs in a process group of its own, ended by its group after."""
    from kimi_supervisor.loop.liveness import engine_cpu

    burner = tmp_path / "burner.py"
    burner.write_text(BURNER)
    script = script.replace("BURN", f"{sys.executable} {burner} {tmp_path / 'go'}")
    tree = subprocess.Popen(["bash", "-c", script], start_new_session=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120  # a loaded host starts interpreters slowly
        while not processes.descendants(tree.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the burners' interpreters started and waiting
        before = engine_cpu(tree.pid, engine_only=engine_only)
        (tmp_path / "go").touch()
        while not (tmp_path / "done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        after = engine_cpu(tree.pid, engine_only=engine_only)
        assert before is not None and after is not None and (tmp_path / "done").exists()
        return after.seconds - before.seconds
    finally:
        os.killpg(tree.pid, signal.SIGKILL)  # the group this test made, and nothing else
        tree.wait(10)


def test_the_stall_rule_counts_what_the_engines_own_children_do_such_as_a_jit_compiler(
    tmp_path: Path,
) -> None:
    """An outside review: FlashInfer compiles its kernels at the first call, in a child of
    the engine, for up to 10 minutes with no log; counted as the engine's, requests pending and
    no step for stall_s are a busy engine, not a hang (the engine-only sum read 0.00 s)."""
    engine = f"{titled(tmp_path, 'VLLM::EngineCore', 'bash')} -c 'BURN 0.6 stay & wait'"
    used = cpu_counted(tmp_path, f"{engine} & sleep 60", engine_only=True)
    assert used >= 0.5, f"the engine's compiler child burned 0.6 s of CPU, {used:.2f} s counted"


def test_work_done_in_short_lived_children_stays_in_the_trees_sum(tmp_path: Path) -> None:
    """An outside review: a tree whose work runs in helpers that exit (a launcher script's
    commands) read as idle, 20 hangs in 24 tries: an exited child's CPU left the sum. Its
    parent's reaped-children time keeps it there."""
    script = "for i in 1 2 3 4 5; do BURN 0.12 exit; done; touch done; sleep 60"
    used = cpu_counted(tmp_path, script, engine_only=False)
    assert used >= 0.5, f"helpers that exited burned 0.6 s of CPU, {used:.2f} s counted"


def test_a_stopped_process_counts_only_on_the_serving_path_not_a_bystander_of_the_tree(
    tmp_path: Path,
) -> None:
    """An outside review: the multiprocessing resource tracker, a child of vLLM's
    API server, SIGSTOPped while the engine ran a long prefill: "vLLM hung ... stopped: PID N
    (resource_tracker, state T)", 3 of 3, a working vLLM torn down. A stopped worker of the
    engine still counts, and so does MainPID."""
    from kimi_supervisor.loop.liveness import engine_cpu

    engine = titled(tmp_path, "VLLM::EngineCore", "bash")
    worker = titled(tmp_path, "VLLM::Worker_TP1", "sleep")
    tracker = titled(tmp_path, "resource_tracker", "sleep")
    script = f"{engine} -c '{worker} 60 & wait' & {tracker} 60 & wait"
    tree = subprocess.Popen(["bash", "-c", script], start_new_session=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60

        def of(comm: str) -> int | None:
            return next((p for p in processes.descendants(tree.pid)
                         if processes.comm_of(p) == comm), None)  # fmt: skip

        while (of("VLLM::Worker_TP") is None or of("resource_tracke") is None) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
        worker_pid, tracker_pid = of("VLLM::Worker_TP"), of("resource_tracke")
        assert worker_pid and tracker_pid
        os.kill(tracker_pid, signal.SIGSTOP)  # ours: this test's tree
        while processes.cpu_of(tracker_pid) and processes.cpu_of(tracker_pid)[0] != "T":  # type: ignore[index]
            time.sleep(0.01)
        cpu = engine_cpu(tree.pid)
        assert cpu is not None and cpu.stopped == (), cpu.stopped
        os.kill(worker_pid, signal.SIGSTOP)
        while processes.cpu_of(worker_pid) and processes.cpu_of(worker_pid)[0] != "T":  # type: ignore[index]
            time.sleep(0.01)
        cpu = engine_cpu(tree.pid)
        assert cpu is not None and [s.split(" (")[0] for s in cpu.stopped] == [f"PID {worker_pid}"]
        os.kill(tree.pid, signal.SIGSTOP)
        while processes.cpu_of(tree.pid) and processes.cpu_of(tree.pid)[0] != "T":  # type: ignore[index]
            time.sleep(0.01)
        cpu = engine_cpu(tree.pid)
        assert cpu is not None and len(cpu.stopped) == 2, cpu.stopped
    finally:
        os.killpg(tree.pid, signal.SIGKILL)  # the group this test made, and nothing else
        tree.wait(10)


def test_vllms_roles_are_told_by_comm_whatever_the_prefix_or_the_kernels_cut() -> None:
    """An outside review: a cmdline read takes the process's mmap lock, and an
    exiting engine has none left, where its comm ("VLLM::EngineCor", cut to 15) remains; vLLM
    0.16 takes the prefix from VLLM_PROCESS_NAME_PREFIX."""
    from kimi_supervisor.loop.liveness import ENGINE_ROLES, SERVING_ROLES, role_of

    assert role_of("VLLM::EngineCor", ENGINE_ROLES) and role_of("VLLM::Worker_TP", ENGINE_ROLES)
    assert role_of("myvllm::EngineC", ENGINE_ROLES)  # another prefix, the role cut short
    assert role_of("VLLM::DPCoordin", SERVING_ROLES) and role_of("VLLM::APIServer", SERVING_ROLES)
    assert not role_of("VLLM::APIServer", ENGINE_ROLES)
    for other in ("python3", "resource_tracke", "pt_main_thread", "VLLM::", "a::b"):
        assert not role_of(other, SERVING_ROLES), other


def test_a_tree_with_no_engine_role_counts_every_stopped_process(tmp_path: Path) -> None:
    """vLLM without setproctitle, or a prefix too long to leave the role in the comm: the tree
    cannot be told apart, and a stopped process of it counts, as before the serving path."""
    from kimi_supervisor.loop.liveness import engine_cpu

    tree = subprocess.Popen(["bash", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not processes.descendants(tree.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        (child,) = processes.descendants(tree.pid)
        os.kill(child, signal.SIGSTOP)  # ours: this test's tree
        while processes.cpu_of(child) and processes.cpu_of(child)[0] != "T":  # type: ignore[index]
            time.sleep(0.01)
        cpu = engine_cpu(tree.pid)
        assert cpu is not None and [s.split(" (")[0] for s in cpu.stopped] == [f"PID {child}"]
    finally:
        os.killpg(tree.pid, signal.SIGKILL)  # the group this test made, and nothing else
        tree.wait(10)


STACKED = """
import time
def waiting_on_a_collective():
    time.sleep(60)
print("ready", flush=True)
waiting_on_a_collective()
"""


@pytest.fixture
def stacked() -> Iterator[int]:
    """A Python process blocked in a function of its own, as an engine waits in a collective."""
    child = subprocess.Popen([sys.executable, "-c", STACKED], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        deadline = time.monotonic() + 30  # asleep in its function, on a loaded host too
        while processes.state_of(child.pid) != "S" and time.monotonic() < deadline:
            time.sleep(0.01)
        yield child.pid
    finally:
        child.kill()  # ours, by its handle
        child.wait(10)


@pytest.mark.skipif(
    __import__("kimi_supervisor.ports.stacks").ports.stacks.py_spy() is None,
    reason="py-spy is not installed",
)
def test_a_hangs_evidence_holds_each_processs_python_stack_where_py_spy_is_installed(
    stacked: int,
) -> None:
    from kimi_supervisor.ports import stacks

    text = stacks.dump([stacked], time.monotonic() + 30)
    assert f"-- PID {stacked} (python" in text
    assert "waiting_on_a_collective" in text, text


def test_without_py_spy_each_thread_says_its_state_and_where_it_sleeps_in_the_kernel(
    stacked: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kimi_supervisor.ports import stacks

    monkeypatch.setattr(stacks, "py_spy", lambda: None)
    text = stacks.dump([stacked, 2**22 + 7], time.monotonic() + 30)
    assert "Python stacks by nobody (py-spy is not installed)" in text
    assert f"thread {stacked} (python" in text and ", state S, wchan " in text, text
    assert f"-- PID {2**22 + 7} (gone), state gone" in text
    # Bounded: past its deadline, no process is read, and that is said.
    late = stacks.dump([stacked], time.monotonic() - 1)
    assert f"the time for stacks ran out: 1 process(es) not read: {stacked}" in late


def test_a_py_spy_that_stalls_leaves_every_processs_kernel_stack_and_each_its_own_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside review: with py-spy stalled on each process (its ptrace interrupt never
    completes on a process in D), one after another within 15 s, only the first 3 of 6
    processes were read at all: the workers, where a D-state hang is, got neither py-spy nor
    their kernel stacks."""
    from kimi_supervisor.ports import stacks

    spy = tmp_path / "py-spy"
    spy.write_text("#!/bin/sh\nexec sleep 60\n")
    spy.chmod(0o755)
    monkeypatch.setattr(stacks, "py_spy", lambda: str(spy))
    monkeypatch.setattr(stacks, "PY_SPY_S", 1.0)
    kids = [subprocess.Popen(["sleep", "60"]) for _ in range(6)]
    try:
        # Each asleep in sleep(1) (a loaded host may not have run its exec yet).
        wait_until(
            lambda: all(processes.state_of(k.pid) == "S" and processes.comm_of(k.pid) == "sleep"
                        for k in kids), 60, "the sleeps to sleep",
        )  # fmt: skip
        text = stacks.dump([k.pid for k in kids], time.monotonic() + 20.0)
    finally:
        for k in kids:
            k.kill()  # ours, by their handles
            k.wait(10)
    for k in kids:
        part = text.split(f"-- PID {k.pid} (sleep)")[1].split("-- PID")[0]
        assert f"thread {k.pid} (sleep), state S, wchan " in part, text
        assert "(py-spy: out of time)" in part, text
    assert "the time for stacks ran out" not in text, text


def test_readings_go_on_beside_a_canary_that_waits(config: Config) -> None:
    """With vLLM's stats off the canary is the only judge of an idle engine, and it may wait
    `canary_timeout_s`: on a thread of its own, the readings of /metrics and the processes go
    on meanwhile (before, none was taken while it waited)."""
    readings: list[Reading] = []
    # The canary waits until released (its timeout far off): whatever comes first is a probe's.
    c = config.liveness.model_copy(update={"canary_timeout_s": 60.0})
    live = Liveness(config.model_copy(update={"liveness": c}), readings.append)
    live.serving(os.getpid(), 0.0, capturing=False)
    deadline = time.monotonic() + 30  # a loaded host's threads
    while not readings and time.monotonic() < deadline:
        time.sleep(0.01)
    live.seen(readings.pop(), 0.1)
    live.serving(os.getpid(), c.canary_interval_s + 1, capturing=False)  # a probe, the canary
    while len(readings) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    (probe,) = readings
    assert probe.kind == "probe"
    live.seen(readings.pop(), c.canary_interval_s + 1.1)
    later = c.canary_interval_s + 1 + c.metrics_interval_s
    live.serving(os.getpid(), later, capturing=False)  # the canary still waits: a probe
    while len(readings) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.kind for r in readings] == ["probe"], readings
    Vllm.released.set()  # the canary's answer (an empty one: an answer all the same)
    while len(readings) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.kind for r in readings] == ["probe", "canary"], readings


def test_a_thread_name_with_a_newline_cannot_forge_a_process_in_the_kept_stacks() -> None:
    """An outside review: a thread's comm (its process's to choose) went into the incident
    bundle raw, so vLLM's user could forge whole "-- PID" blocks among root's reading."""
    from kimi_supervisor.ports import stacks

    forged = "w\n-- PID 1 (x"  # 15 bytes: the most a comm holds
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; open('/proc/self/comm', 'w').write(sys.argv[1]);"
         " print('ready', flush=True); time.sleep(60)", forged],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        text = stacks.dump([child.pid], time.monotonic() + 20.0)
    finally:
        child.kill()  # ours, by its handle
        child.wait(10)
    headers = [line for line in text.splitlines() if line.startswith("-- PID")]
    assert len(headers) == 1 and headers[0].startswith(f"-- PID {child.pid} ("), text
    assert "w\\n-- PID 1 (x" in text, text  # escaped, where it stands


class Listing:
    """GPUs that spin, GPU 0 held by vLLM alone, GPU 1 beside it by another user's process (a
    PID of nobody here, as one of another PID namespace may read) and one that reads PID 0."""

    def __init__(self, ours: int, nobody: int) -> None:
        self.lists = {0: (ours,), 1: (0, ours, nobody)}

    def activity(self, indices: Sequence[int]) -> list[GpuActivity]:
        return [GpuActivity(i, **COUNTERS["spin"], pids=self.lists[i]) for i in indices]  # type: ignore[arg-type]


def test_a_process_on_a_gpu_that_is_not_vllms_is_named_with_its_reading(config: Config) -> None:
    """Any user may open the GPUs' device nodes (0666): a process of theirs makes the GPU's
    counters its own as much as vLLM's. Whatever is not vLLM's tree is another's."""
    nobody = int(Path("/proc/sys/kernel/pid_max").read_text())  # PIDs are below it
    readings: list[Reading] = []
    port = cast(GpuPort, Listing(os.getpid(), nobody))
    live = Liveness(config, readings.append, gpu=port, indices=lambda: [0, 1])
    live.serving(os.getpid(), 0.0, capturing=False)
    wait_until(lambda: bool(readings), 30, "a reading")  # a loaded host's threads
    (reading,) = readings
    assert isinstance(reading.gpu, tuple), reading
    alone, beside = reading.gpu
    assert alone.foreign == () and beside.foreign == (0, nobody), reading.gpu
    assert "GPU 1: busy 100 %" in gpu_said(beside, None)
    assert f"shared with PID 0, {nobody} (not vLLM's: not judged)" in gpu_said(beside, None)


def test_on_real_processes_a_sidecar_of_the_unit_out_of_the_tree_is_no_engine_work(
    tmp_path: Path,
) -> None:
    """On /proc (the unit's cgroup listing stood in for: no unit here): a tree titled as vLLM's
    (EngineCore, its Worker) waiting on a FIFO with an idle child titled python3 under the
    worker, and a process out of the tree spinning a core (a sidecar). The sidecar is vLLM's
    (`apart`: a GPU it holds is not another's) but its CPU is not the engine's."""
    from kimi_supervisor.loop.liveness import engine_cpu
    from kimi_supervisor.ports import processes

    def titled(title: str, program: str) -> str:
        found = shutil.which(program)
        assert found, program
        (tmp_path / title).symlink_to(found)
        return str(tmp_path / title)

    core, worker, idle = (titled("VLLM::EngineCore", "sh"), titled("VLLM::Worker_TP0", "sh"),
                          titled("python3", "sleep"))  # fmt: skip
    fifo = tmp_path / "wait"
    os.mkfifo(fifo)
    spin = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    sidecar = subprocess.Popen([sys.executable, "-c", spin])
    inner = f"{idle} 30 & read x < {fifo}"
    main = subprocess.Popen(["sh", "-c", f"{core} -c '{worker} -c \"{inner}\" & wait' & wait"])
    try:
        wait_until(lambda: len(processes.descendants(main.pid)) >= 3, 30, "the tree to start")
        tree = [main.pid, *processes.descendants(main.pid)]

        def members(pid: int, unit: str, limit: int) -> tuple[list[int], bool]:
            return [*tree, sidecar.pid], False

        with pytest.MonkeyPatch.context() as m:
            m.setattr(processes, "unit_pids", members)
            before = engine_cpu(main.pid, engine_only=True, unit="vllm.service")
            assert before is not None

            def spun() -> float:
                got = processes.times_of(sidecar.pid)
                return got.cpu_s if got is not None else 0.0

            start = spun()  # the sidecar spins a second more, however slow the machine
            wait_until(lambda: spun() >= start + 1.0, 60, "the sidecar to spin a second")
            after = engine_cpu(main.pid, engine_only=True, unit="vllm.service")
        assert after is not None and sidecar.pid in after.apart
        assert sidecar.pid not in {t.pid for t in after.tree}
        assert after.seconds - before.seconds < 0.5, "the sidecar's second is not the engine's"
    finally:
        for p in processes.descendants(main.pid):
            if processes.comm_of(p) == "python3":
                os.kill(p, signal.SIGTERM)  # the idle child this test started
        with open(fifo, "w"):
            pass
        main.wait(timeout=30)
        sidecar.kill()  # our own child, by its handle
        sidecar.wait()
