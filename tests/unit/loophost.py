"""An in-memory host for the loop's fast tests: the daemon's ports as plain objects, on a fake
clock, around real processes.

- `FakeSystemd` runs vLLM's "unit" as a real child process, through `kimi-supervisor
  launch-vllm` as the unit's ExecStart does; stopping it is SIGTERM then SIGKILL, and a child
  that exits leaves the unit `failed` with its exit code, as systemd reports them.
- the child is a tiny stand-in for vLLM's API server: it loads for `load_s` of the fake clock
  (held at a gate that the host opens once the clock has passed the load's end), then listens on
  vLLM's port and answers /health, /start_profile and /stop_profile with 200; or it exits with 1
  at once in a mode named in `fail_modes`.
- `FakeGpu` reads every GPU at its baseline plus what a test leaves on it (`extra`), with no
  process listed: memory no teardown can free, as a holder the supervisor must not kill leaves it.

`LoopHost.until` drives the daemon in-process, one `turn` at a time. Between turns the fake clock
moves on to the loop's next deadline, except while something real is under way (a teardown on
its thread, the child's interpreter starting). While a thread of the daemon's runs (a probe, a
capture), it moves at most `STEP_S` at a time and the loop's own wait is cut to a few real
milliseconds; when nothing but this thread can move, no real time passes at all.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kimi_supervisor.config import Config
from kimi_supervisor.configfile import parse_config
from kimi_supervisor.loop.daemon import Daemon
from kimi_supervisor.model import GpuActivity, GpuHealth, Mode, State
from kimi_supervisor.ports import launcher
from kimi_supervisor.ports.gpu import BoundedGpu, DeviceSample
from kimi_supervisor.ports.notify import Notifier
from kimi_supervisor.ports.output import FileOutput
from kimi_supervisor.ports.systemd import SystemdError, UnitStatus, Who
from tests.fakes import FakeClock

UNIT = "vllm-kimi-k25.service"
STEP_S = 0.25  # the most the fake clock moves between two turns while a daemon's thread runs
# The daemon's threads for blocking I/O (ports/bounded.py): they wait for calls, and a call on
# them is the loop's or the teardown's own, waited for there.
IO_THREADS = {"nvml", "state-io", "bundle-io", "bundle-proc"}

FAKE_VLLM = r"""
import http.server, os, sys, time
argv = sys.argv[1:]
if os.environ.get("FAKE_FAIL"):
    print("fake vLLM: this mode fails to start", flush=True)
    sys.exit(1)
GATE = os.environ.get("FAKE_GATE")  # while it exists, the load goes on
if GATE:
    open(os.environ["FAKE_AT_GATE"], "w").close()
    while os.path.exists(GATE):
        time.sleep(0.005)
HUNG = os.environ.get("FAKE_HUNG_FILE", "/nonexistent")  # while it exists, no completion ends
SILENT = HUNG + "-metrics"  # while it exists, /metrics does not answer
METRICS = ("vllm:num_requests_running{{engine=\"0\"}} {running}\n"
           "vllm:generation_tokens_total{{engine=\"0\"}} 7\n")
class H(http.server.BaseHTTPRequestHandler):
    def _send(self, body=b""):
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        while self.path == "/metrics" and os.path.exists(SILENT):
            time.sleep(0.05)
        if self.path == "/metrics":
            self._send(METRICS.format(running=int(os.path.exists(HUNG))).encode())
        elif self.path == "/v1/models":
            self._send(b'{"data": [{"id": "m"}]}')
        else:
            self._send()
    def do_POST(self):
        while self.path == "/v1/completions" and os.path.exists(HUNG):
            time.sleep(0.05)
        self._send(b"{}")
    def log_message(self, *a):
        pass
port = int(argv[argv.index("--port") + 1])
# A thread per request: /health answers while a completion hangs, as a hung vLLM's does.
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_for(
    root: Path,
    model: Path | None = None,
    extra: str = "",
    armed: bool = False,
    *,
    liveness: str = "",
    **daemon: float,
) -> Config:
    """`model`: a folder vLLM's argv names (`serve MODEL`), which a switch warms; `extra`: more
    TOML sections; `armed`: production starts vLLM with the profiler armed; `liveness`: more
    lines of its section."""
    for d in ("state", "shm", "tmp", "run", "captures", "traces"):
        (root / d).mkdir(parents=True, exist_ok=True)
    settings = {
        "tick_s": 1.0,
        "start_poll_s": 0.25,
        "start_timeout_s": 600,
        "health_grace_s": 5,
        "restart_backoff_initial_s": 4,
        "restart_backoff_max_s": 300,
        "max_failures": 3,
        "failure_window_s": 600,
        "stuck_retry_s": 10,
        "driver_retry_max_s": 2,
    } | daemon
    lines = "\n".join(f"{k} = {v}" for k, v in settings.items())
    code = json.dumps(FAKE_VLLM)
    served = f', "serve", "{model}"' if model is not None else ""
    profiler = json.dumps(json.dumps({"profiler": "torch", "torch_profiler_dir": f"{root}/traces"}))
    armed_args = f', "--profiler-config", {profiler}' if armed else ""
    return parse_config(
        f"""
[service]
unit = "{UNIT}"
[vllm]
command = ["{sys.executable}", "-c", {code}{served}]
host = "127.0.0.1"
port = {free_port()}
argv_file = "{root}/run/vllm-argv.json"
log_file = "{root}/vllm.log"
[modes.production]
args = ["--mode-production"{armed_args}]
[modes.profile]
args = [
  "--mode-profile",
  "--profiler-config", '{{"profiler": "torch", "torch_profiler_dir": "{root}/traces"}}',
]
[teardown]
term_grace_s = 2
cgroup_kill_timeout_s = 2
strays_timeout_s = 2
holders_timeout_s = 2
release_timeout_s = 2
poll_interval_s = 0.01
respawn_watch_s = 0
shm_dir = "{root}/shm"
tmp_dir = "{root}/tmp"
[state]
dir = "{root}/state"
[daemon]
{lines}
[control]
socket = "{root}/control.sock"
[liveness]
metrics_interval_s = 1
stall_s = 3
canary_interval_s = 5
canary_timeout_s = 1
{liveness}
[metrics]
enabled = false
[profiling]
captures_dir = "{root}/captures"
start_timeout_s = 2
stall_after_s = 0.2
{extra}
"""
    )


class FakeSystemd:
    def __init__(self, config: Config, log: Path, clock: FakeClock) -> None:
        self.config = config
        self.log = log
        self.clock = clock
        self.fail_modes: set[Mode] = set()
        self.hung_file = config.state.dir.parent / "vllm-hung"  # while it exists, vLLM hangs
        self.unreachable = ""  # while set, every call fails as with no bus
        self.load_s = 0.0  # how long a start loads, on the fake clock
        self.gate = config.state.dir.parent / "vllm-loading"  # the child waits while it exists
        self.at_gate = config.state.dir.parent / "vllm-loading-reached"  # made as it waits
        self.load_ends = 0.0
        self.child: subprocess.Popen[bytes] | None = None
        self.listening: subprocess.Popen[bytes] | None = None  # a child seen listening
        self.stopped = True  # by us (inactive), or it exited by itself (failed)
        self.starts: list[Mode] = []
        self.scopes: list[tuple[str, int]] = []  # (scope, PID) made for warming readers
        # Set by a test to hold every stop until it is released: a teardown that lasts.
        self.hold: threading.Event | None = None
        self._lock = threading.Lock()

    def status(self, unit: str) -> UnitStatus:
        if self.unreachable:
            raise SystemdError(self.unreachable)
        with self._lock:
            c = self.child
            if unit != UNIT or c is None:
                return UnitStatus(unit, "loaded", "inactive", "dead", 0, 0, "success")
            code = c.poll()
            if code is None:
                return UnitStatus(unit, "loaded", "active", "running", c.pid, 0, "success")
            if self.stopped or code == 0:
                return UnitStatus(unit, "loaded", "inactive", "dead", 0, code, "success")
            return UnitStatus(unit, "loaded", "failed", "failed", 0, code, "exit-code")

    def start(self, unit: str) -> None:
        mode = Mode(json.loads(self.config.vllm.argv_file.read_text())["mode"])
        env = dict(os.environ, FAKE_HUNG_FILE=str(self.hung_file))
        if mode in self.fail_modes:
            env["FAKE_FAIL"] = "1"
        self.gate.unlink(missing_ok=True)
        self.at_gate.unlink(missing_ok=True)
        if self.load_s > 0:
            self.gate.touch()
            self.load_ends = self.clock.now + self.load_s
            env.update(FAKE_GATE=str(self.gate), FAKE_AT_GATE=str(self.at_gate))
        with self._lock, self.log.open("ab") as out:
            self.starts.append(mode)
            self.stopped = False
            # As the unit's ExecStart does: `kimi-supervisor launch-vllm` execs the argv file's
            # argv; then, as its ExecStartPost does, `launch-record` records what it launched
            # (its PID and start time).
            argv_file = str(self.config.vllm.argv_file)
            launch = [
                sys.executable,
                "-m",
                "kimi_supervisor.cli.admin",
                "launch-vllm",
                "--argv-file",
                argv_file,
            ]
            self.child = subprocess.Popen(launch, env=env, stdout=out, stderr=out)
            launcher.record_launch(self.config.vllm.argv_file, self.child.pid)

    def stop(self, unit: str) -> None:
        if self.hold is not None:
            self.hold.wait(10)
        with self._lock:
            self.stopped = True
        c = self.child
        if c is not None and c.poll() is None:
            c.send_signal(signal.SIGTERM)
            try:
                c.wait(2)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()

    def kill(self, unit: str, who: Who, sig: int) -> None:
        c = self.child
        if c is not None and c.poll() is None:
            c.send_signal(sig)
            if sig == signal.SIGKILL:
                c.wait()

    def reset_failed(self, unit: str) -> None:
        with self._lock:
            self.stopped = True

    def activated_at(self, unit: str) -> float | None:
        return None

    def environment(self, unit: str) -> dict[str, str]:
        return {}

    def run_as(self, unit: str) -> int | None:
        return os.geteuid()  # the child runs as this process's user

    def cgroup_pids(self, unit: str) -> list[int]:
        c = self.child
        return [c.pid] if c is not None and c.poll() is None else []

    def daemon_reload(self) -> None:
        pass

    def starting(self) -> bool:
        """The child runs and does not listen yet, and is not held at the gate (its load, on the
        fake clock, which opens the gate once it has passed the load's end): real time must
        pass, not the fake clock's."""
        c = self.child
        if c is None or c.poll() is not None or c is self.listening:
            return False
        if self.gate.exists() and self.at_gate.exists():
            if self.clock.now < self.load_ends:
                return False
            self.gate.unlink()
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", self.config.vllm.port)) != 0:
                return True
        self.listening = c  # until it exits
        return False

    def jobs(self) -> dict[str, str]:
        return {}

    def move_to_scope(self, name: str, pid: int, description: str) -> None:
        self.scopes.append((name, pid))

    def close(self) -> None:
        self.stop(UNIT)


class FakeGpu:
    def __init__(self, count: int = 2, baseline_mib: int = 500) -> None:
        self.count = count
        self.baseline_mib = baseline_mib
        self.extra = dict.fromkeys(range(count), 0)
        self.fault: Exception | None = None  # raised by sample (a port's unexpected error)
        self.answers = threading.Event()  # cleared: every call waits, as in a hung driver
        self.answers.set()
        self.unhealthy: dict[int, dict[str, object]] = {}  # a failing GPU's signals, by index
        self.health_reads = 0
        self.health_fault: Exception | None = None  # raised by health (no reading)

    def device_count(self) -> int:
        self.answers.wait()
        return self.count

    def health(self, indices: Sequence[int]) -> list[GpuHealth]:
        """A healthy H200's answer (the simulated host's, sandbox/simreader.py), with
        `unhealthy`'s signals for a failing GPU."""
        self.answers.wait()
        self.health_reads += 1
        if self.health_fault is not None:
            raise self.health_fault
        base: dict[str, object] = {"remap_pending": False, "remap_failed": False,
                                   "ecc_uncorrected": 0, "xids": ()}  # fmt: skip
        return [GpuHealth(i, **{**base, **self.unhealthy.get(i, {})}) for i in indices]  # type: ignore[arg-type]

    def sample(self, indices: Sequence[int]) -> list[DeviceSample]:
        self.answers.wait()
        if self.fault is not None:
            raise self.fault
        return [DeviceSample(i, self.baseline_mib + self.extra[i], 143_771) for i in indices]

    def activity(self, indices: Sequence[int]) -> list[GpuActivity]:
        """An idle H100's counters (sandbox/simreader.COUNTERS)."""
        self.answers.wait()
        return [GpuActivity(i, 0.0, 0.0, 124.2, 1980.0, 1.1) for i in indices]

    def device_path(self, index: int) -> str:
        return f"/nonexistent/nvidia{index}"

    def uuid(self, index: int) -> str:
        return f"GPU-fake-{index}"

    def driver_version(self) -> str:
        self.answers.wait()
        return "580.0"

    def node_key(self, path: str, st: os.stat_result) -> tuple[object, ...] | None:
        return None

    def close(self) -> None:
        pass


class SleepWatch(FakeClock):
    """The fake clock, which also notes every sleep taken on the loop's thread."""

    def __init__(self) -> None:
        super().__init__()
        self.loop_thread = threading.get_ident()
        self.loop_sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        if threading.get_ident() == self.loop_thread:
            self.loop_sleeps.append(seconds)
        super().sleep(seconds)


class LoopHost:
    def __init__(
        self,
        root: Path,
        model: Path | None = None,
        extra: str = "",
        armed: bool = False,
        *,
        liveness: str = "",
        **daemon: float,
    ) -> None:
        self.root = root
        self.config = config_for(root, model, extra, armed, liveness=liveness, **daemon)
        self.clock = SleepWatch()
        self.systemd = FakeSystemd(self.config, root / "vllm.log", self.clock)
        self.gpu = FakeGpu()
        self.lines: list[dict[str, Any]] = []
        self.threads = set(threading.enumerate())  # the others are the daemon's
        self.longest_turn = 0.0  # the longest pass of the loop, in real seconds
        self.daemon = self.new_daemon()

    def new_daemon(self) -> Daemon:
        """A daemon over this host's state directory (a second one: a restart, a re-exec)."""

        def log(event: str, level: str = "info", **kw: Any) -> None:
            self.lines.append({"event": event, "level": level, **kw})

        d = Daemon(
            self.config,
            self.systemd,
            BoundedGpu(self.gpu, self.config.gpus.timeout_s),  # as cli/compose.py composes it
            output=FileOutput(self.root / "vllm.log"),
            notifier=Notifier(enabled=False),
            log=log,
            clock=self.clock,
        )
        d.boot()
        self.daemon = d
        return d

    @property
    def state(self) -> State:
        return self.daemon.s.state

    def status(self) -> dict[str, Any]:
        return self.daemon.snapshot()

    def ask(self, msg: Any) -> Any:
        """Put a request in the inbox; its reply once a turn has answered it."""
        self.daemon.ask(msg)
        self.until(msg.reply.done, "the request to be answered")
        return msg.reply.result()

    def until(self, cond: Callable[[], bool], what: str, real_s: float = 300.0) -> None:
        """Turns until `cond` holds; `real_s` bounds the real time (90 s ran out once at load 25
        on 2 cores, with a fake vLLM still not serving; a loaded 2-core host starts
        the child's interpreter in seconds, not milliseconds: only a defect runs into it)."""
        d, deadline = self.daemon, time.monotonic() + real_s
        while True:
            began = time.monotonic()
            turned = d.turn()
            self.longest_turn = max(self.longest_turn, time.monotonic() - began)
            if not turned:
                if cond():
                    return
                raise AssertionError(f"the loop ended before {what}{self.tail()}")
            if cond():
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what}; state {d.s.state}{self.tail()}"
                )
            if not len(d.inbox):
                # The fake clock moves only while nothing real is under way (a teardown on its
                # thread, the child starting); then the loop's wait is what passes. With that,
                # or a thread of the daemon's running (a liveness probe, a capture), the wait
                # is a few real milliseconds; with neither, nothing but this thread can move
                # until the next deadline, and the clock goes straight to it.
                real = d.s.busy or self.systemd.starting()
                threads = any(
                    t not in self.threads and t.name not in IO_THREADS
                    for t in threading.enumerate()
                )
                if not real:
                    self.clock.now += min(d.timeout(), STEP_S) if threads else d.timeout()
                d.wait(max_s=0.005 if real or threads else 0.0)

    def tail(self, n: int = 15) -> str:
        """The daemon's last log lines, for a failure's message."""
        return "".join(f"\n  {e}" for e in self.lines[-n:])

    def serving(self, mode: Mode) -> None:
        s = self.daemon.s
        self.until(
            lambda: s.state is State.SERVING and s.serving is not None and s.serving.mode is mode,
            f"{mode.value} to be served",
        )

    def history(self, kind: str | None = None) -> list[dict[str, Any]]:
        from kimi_supervisor.store import history

        records = history.read(self.config.state.dir)
        return [e for e in records if kind is None or e.get("kind") == kind]

    def close(self) -> None:
        self.systemd.close()
