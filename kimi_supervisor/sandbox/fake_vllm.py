"""A fake vLLM with the CLI shape and the process tree of vLLM V1, for the sandbox and GPU tests.

    vllm serve MODEL --tensor-parallel-size N --port P [--host H] [--profiler-config JSON] ...

The API server (this process) starts an engine-core process titled `VLLM::EngineCore`, which
starts N workers titled `VLLM::Worker_TP0..N-1`; each worker holds memory on its GPU (simulated,
or real CUDA with KIMI_FAKE_CUDA=1). It prints vLLM's startup phases, listens only once ready (as
real vLLM 0.16 does: /health refuses connections while loading, then answers 200 with an empty
body), and answers GET /v1/models and POST /start_profile, /stop_profile.

Fault switches come from the JSON file named by KIMI_FAKE_VLLM_CONFIG (see FakeOptions).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from multiprocessing import resource_tracker
from typing import Any

from setproctitle import setproctitle

from kimi_supervisor.ports import processes
from kimi_supervisor.sandbox import holder, simgpu
from kimi_supervisor.sandbox.fake_api import EngineLink, Server, _handler
from kimi_supervisor.sandbox.fake_options import FakeOptions, log

__all__ = ["FakeOptions", "main"]


# -- workers and engine core ---------------------------------------------------------------------
def _child(
    role: str, *args: str, keep: tuple[int, ...] = (), talk: bool = False
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kimi_supervisor.sandbox.fake_vllm", role, *args],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE if talk else None,
        pass_fds=keep,
    )


def _wait_line(proc: subprocess.Popen[bytes], expect: bytes) -> bytes:
    """Waits for the child's line starting with `expect`; the rest of that line."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(expect):
        raise SystemExit(f"child {proc.pid} did not report {expect!r} (got {line!r})")
    return line[len(expect) :].strip()


_SOCKETS: list[socket.socket] = []


def _ipc_socket() -> None:
    """A ZMQ-like IPC socket bound at `$TMPDIR/<uuid4>` and never unlinked: real vLLM 0.16
    leaves about 7 of these behind even after a clean stop."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(os.environ.get("TMPDIR", "/tmp"), str(uuid.uuid4())))
    s.listen()
    _SOCKETS.append(s)


def _tracker_fds() -> tuple[int, ...]:
    """The write end of the API server's multiprocessing resource tracker, inherited by the
    engine and the workers as real vLLM's spawned processes inherit it. So the helper
    (`python -c from multiprocessing.resource_tracker import main;main(N)`) outlives a
    SIGKILLed API server while the orphaned engine lives, as measured with real vLLM 0.16."""
    fd = os.environ.get("KIMI_FAKE_TRACKER_FD")
    return (int(fd),) if fd else ()


def _terminate_on_signal(opts: FakeOptions, on_term: Any) -> None:
    handler = signal.SIG_IGN if opts.ignore_sigterm else on_term
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def worker_main(rank: int) -> None:
    opts = FakeOptions.load()
    setproctitle(f"VLLM::Worker_TP{rank}")
    stop = threading.Event()
    _terminate_on_signal(opts, lambda *_: stop.set())
    device = opts.devices[rank] if opts.devices else rank
    held = holder.hold([device], opts.mib_per_worker)
    if rank == 0 and opts.ghost_title:
        _spawn_ghost(opts)
    sys.stdout.buffer.write(f"ready {os.getpid()}\n".encode())
    sys.stdout.flush()
    stop.wait()
    held.release()


def _spawn_ghost(opts: FakeOptions) -> None:
    devices = ",".join(str(d) for d in (opts.devices or []))
    args = [
        sys.executable,
        "-m",
        "kimi_supervisor.sandbox.ghost",
        "--title",
        opts.ghost_title or "",
        "--mib",
        str(opts.ghost_mib),
        "--gpu",
        devices or "all",
    ]
    for procs in opts.ghost_cgroup_procs:
        args += ["--cgroup-procs", procs]
    ghost = subprocess.Popen(args, stdout=subprocess.PIPE, start_new_session=True)
    _wait_line(ghost, b"ready")


def _busy(seconds: float) -> None:
    """Work on the CPU, as an engine's step does."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _spin(until: threading.Event) -> None:
    """A core used until `until` is set, with the GIL let go (hashing a large buffer), as a
    thread in CUDA's synchronize spins outside Python: the engine's other threads go on."""
    block = bytes(1 << 20)
    while not until.is_set():
        hashlib.sha256(block).digest()


COMPILER = "import setproctitle, time; setproctitle.setproctitle('cc1plus')\nwhile True: pass"
# A compile's client, as sccache's: under the engine, waiting on the server for the result.
CLIENT = "import setproctitle, time; setproctitle.setproctitle('sccache')\nwhile 1: time.sleep(1)"
# A sidecar of vLLM's user, double forked out of the tree, spinning a core in the unit's cgroup.
SIDECAR = "import setproctitle; setproctitle.setproctitle('python3')\nwhile True: pass"
# The compiler as a server out of the tree: started by a child that says its PID and exits.
SERVER = (
    "import subprocess, sys\n"
    "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True,\n"
    "                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,\n"
    "                     stderr=subprocess.DEVNULL)\n"
    "print(p.pid, flush=True)\n"
)


class _Faults:
    """The engine's faults that come and go with their files (FakeOptions): a stuck collective
    (no step, a thread spinning, the GPUs reading a spinning kernel), a thread spinning beside
    the steps, a JIT compile (no step, a compiler child using a core). Its `blocked` says a
    step may not begin; `worked` marks the GPUs at work after a step (simgpu.set_activity)."""

    def __init__(self, opts: FakeOptions, devices: list[int]) -> None:
        self.opts = opts
        self.devices = devices
        self.root = None if holder.real_cuda() else holder.sim_dir()
        self.stuck = self.spinning = self.compiling = False
        self._spinners: dict[str, threading.Event] = {}
        self._compiler: subprocess.Popen[bytes] | None = None
        self._server: processes.ProcessRef | None = None  # the compiler out of the tree
        self._client: subprocess.Popen[bytes] | None = None  # and its client, in the tree
        self._sidecar = False
        self._worked_at = 0.0
        self._lock = threading.Lock()

    @staticmethod
    def _on(path: str | None) -> bool:
        return bool(path) and os.path.exists(path)  # type: ignore[arg-type]

    def blocked(self) -> bool:
        o = self.opts
        return self._on(o.deadlock_file) or self.stuck or self.compiling

    def _gpus(self, state: str) -> None:
        if self.root is not None:
            simgpu.set_activity(self.root, self.devices, state)

    def worked(self) -> None:
        now = time.monotonic()
        with self._lock:  # never "work" written over a stuck collective's "spin"
            if now - self._worked_at >= 0.2 and not self.stuck:
                self._worked_at = now
                self._gpus("work")

    def _spinner(self, name: str, on: bool) -> None:
        if on and name not in self._spinners:
            until = self._spinners[name] = threading.Event()
            threading.Thread(target=_spin, args=(until,), daemon=True).start()
        elif not on and name in self._spinners:
            self._spinners.pop(name).set()

    @staticmethod
    def _serve(script: str = COMPILER) -> processes.ProcessRef | None:
        """`script` (the compiler) as a server out of the engine's tree, by its identity."""
        starter = subprocess.run(
            [sys.executable, "-c", SERVER, script], stdin=subprocess.DEVNULL,
            capture_output=True, timeout=30, check=True,
        )  # fmt: skip
        return processes.ref_of(int(starter.stdout))

    def watch(self) -> None:
        """Follows the fault files, every 50 ms, for the engine's life."""
        o = self.opts
        while True:
            stuck = self._on(o.stuck_collective_file)
            with self._lock:
                if stuck != self.stuck:
                    self._gpus("spin" if stuck else "idle")
                self.stuck = stuck
            self._spinner("collective", stuck)
            self._spinner("thread", self._on(o.spinning_thread_file))
            if o.sidecar and not self._sidecar:
                self._sidecar = True  # once: it ends with the unit's cgroup
                self._serve(SIDECAR)
            compiling = self._on(o.compile_file)
            if compiling and o.compile_server and self._server is None:
                self._server = self._serve()
                self._client = subprocess.Popen(
                    [sys.executable, "-c", CLIENT],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                )  # fmt: skip
            elif compiling and not o.compile_server and self._compiler is None:
                self._compiler = subprocess.Popen(
                    [sys.executable, "-c", COMPILER],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                )  # fmt: skip
            elif not compiling and self._server is not None:
                processes.send_signal(self._server, signal.SIGKILL)  # the server we started
                self._server = None
                self._compiler, self._client = self._client, None  # ended as the compiler is
            if not compiling and self._compiler is not None:
                self._compiler.kill()  # our own child, by its handle
                self._compiler.wait()
                self._compiler = None
            self.compiling = compiling
            time.sleep(0.05)


def _generate(faults: _Faults) -> None:
    """The API server's requests, one at a time, as engine steps: `gen P N` -> one prefill step
    (P prompt tokens, `prefill_s_per_token` each, on the CPU) -> N decode steps of 1 ms, each
    `engine_busy_fraction` of it on the CPU -> `step p n` after each -> `done N`. `flush S`:
    the profiler's export, S seconds on the CPU, no step -> `flushed`. While the options'
    `deadlock_file` exists, no step begins and no CPU is used (a deadlocked engine). Raw reads
    and writes of fds 0 and 1: a daemon thread blocked inside sys.stdin's buffered reader would
    hold its lock through the interpreter's exit, which then aborts."""
    opts = FakeOptions.load()
    pending = b""

    def step(prompt: int, tokens: int, cpu_s: float, *, wall_s: float) -> None:
        while faults.blocked():
            time.sleep(0.05)
        _busy(cpu_s)
        if wall_s > cpu_s:
            time.sleep(wall_s - cpu_s)
        faults.worked()
        os.write(1, f"step {prompt} {tokens}\n".encode())

    while chunk := os.read(0, 4096):
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            words = line.split()
            if words[0] == b"flush":
                _busy(float(words[1]))
                os.write(1, b"flushed\n")
                continue
            prompt, n = int(words[1]), int(words[2])
            prefill = prompt * opts.prefill_s_per_token
            step(prompt, 1, prefill, wall_s=prefill)  # the prefill step makes the first token
            for _ in range(n - 1):
                step(0, 1, 0.001 * opts.engine_busy_fraction, wall_s=0.001)
            os.write(1, f"done {n}\n".encode())


def engine_main(tp: int) -> None:
    opts = FakeOptions.load()
    setproctitle("VLLM::EngineCore")
    _ipc_socket()
    stop = threading.Event()
    _terminate_on_signal(opts, lambda *_: stop.set())
    workers = [_child("worker", str(rank), keep=_tracker_fds()) for rank in range(tp)]
    pids = [_wait_line(w, b"ready") for w in workers]
    sys.stdout.buffer.write(b"ready " + b" ".join(pids) + b"\n")
    sys.stdout.flush()
    faults = _Faults(opts, opts.devices[:tp] if opts.devices else list(range(tp)))
    threading.Thread(target=faults.watch, daemon=True).start()
    threading.Thread(target=_generate, args=(faults,), daemon=True).start()
    stop.wait()
    for w in workers:
        w.terminate()
    for w in workers:
        w.wait()


def _load(opts: FakeOptions, profiling: bool, worker0: int) -> None:
    """The shard progress as real vLLM 0.16 writes it: on stderr, from worker 0, each update
    `\r...\n` behind the process prefix (tqdm's bar format ends in a newline)."""
    shards = max(opts.shards, 1)
    faults = profiling or not opts.load_faults_only_when_profiling

    def bar(done: int) -> None:
        sys.stderr.write(
            f"(Worker_TP0 pid={worker0}) \rLoading safetensors checkpoint shards: "
            f"{done * 100 // shards:3d}% Completed | {done}/{shards} [00:00<00:00, 3.2it/s]\n"
        )
        sys.stderr.flush()

    bar(0)
    for done in range(1, shards + 1):
        pct = done * 100 // shards
        if faults and opts.crash_during_load_at is not None and pct >= opts.crash_during_load_at:
            log(f"ERROR: simulated crash while loading at {pct}%")
            raise SystemExit(1)
        if faults and opts.hang_during_load_at is not None and pct >= opts.hang_during_load_at:
            log(f"loading stalls at {pct}% (simulated hang)")
            threading.Event().wait()
        time.sleep(opts.load_s / shards)
        bar(done)
    # As real vLLM 0.16's workers after the last shard (measured with its CPU build).
    log(f"(Worker_TP0 pid={worker0}) Loading weights took {opts.load_s:.2f} seconds")


def serve_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="vllm serve")
    p.add_argument("model")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--profiler-config", default=None)
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--middleware", action="append", default=[])
    args, _unknown = p.parse_known_args(argv)
    opts = FakeOptions.load()
    server = Server(args, opts)
    stop = threading.Event()
    _terminate_on_signal(opts, lambda *_: stop.set())

    log(
        f"vLLM API server version 0.16.0 (fake) serving {args.model} "
        f"with tensor parallel {args.tensor_parallel_size}"
    )
    if server.profiler is not None:
        log(f"Torch profiler enabled: {json.dumps(server.profiler)}")
    _ipc_socket()
    resource_tracker.ensure_running()
    tracker = resource_tracker._resource_tracker._fd  # type: ignore[attr-defined]
    os.environ["KIMI_FAKE_TRACKER_FD"] = str(tracker)
    engine = _child("engine", str(args.tensor_parallel_size), keep=(tracker,), talk=True)
    listening: list[ThreadingHTTPServer] = []

    def boot() -> None:
        try:
            server.worker_pids = [int(p) for p in _wait_line(engine, b"ready").split()]
            stats = not (args.disable_log_stats or opts.disable_log_stats)
            server.link = EngineLink(engine, stats=stats)
            _load(opts, server.profiler is not None, server.worker_pids[0])
            log("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%")
            time.sleep(opts.graph_capture_s)
            # As real vLLM 0.16 (measured with its CPU build): the API server binds its port only
            # now, so /health refuses connections while loading; there is no 503 phase.
            http = ThreadingHTTPServer((args.host, args.port), _handler(server))
            listening.append(http)
            threading.Thread(target=http.serve_forever, daemon=True).start()
            log(f"Starting vLLM API server 0 on http://{args.host}:{args.port}")
            server.ready.set()
            print("INFO:     Application startup complete.", flush=True)
        except SystemExit as e:
            with contextlib.suppress(ProcessLookupError):
                engine.kill()
            # SystemExit carries a status or, from _wait_line, what went wrong: said, then 1.
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr, flush=True)
            os._exit(e.code if isinstance(e.code, int) and e.code else 1)

    threading.Thread(target=boot, daemon=True).start()
    stop.wait()
    log("Shutting down")
    if opts.shutdown_delay_s:
        time.sleep(opts.shutdown_delay_s)
    server.ready.clear()
    for http in listening:
        http.shutdown()
    engine.terminate()
    engine.wait()
    log("Shutdown complete")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: vllm serve MODEL [--tensor-parallel-size N] [--port P] ...")
    role, rest = argv[0], argv[1:]
    if role == "serve":
        serve_main(rest)
    elif role == "engine":
        engine_main(int(rest[0]))
    elif role == "worker":
        worker_main(int(rest[0]))
    else:
        raise SystemExit(f"fake vllm: unknown command {role!r} (expected serve)")


if __name__ == "__main__":
    main()
