"""Shared fixtures: one real sandbox (isolated systemd user manager, simulated GPUs, fake vLLM)
per test session, reset to a clean state before each test that uses it."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.ports import processes
from kimi_supervisor.ports.http import request
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.ports.systemd import PystemdSystemd
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.fake_vllm import FakeOptions
from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT, UNIT, Sandbox
from kimi_supervisor.sandbox.usermanager import unavailable_reason

SANDBOX_GPUS = 4


def _session_members(leader: ProcessRef) -> list[ProcessRef]:
    """Live processes in the session `leader` created, started no earlier than it (a session
    ID outlives its leader, so this also finds a dead leader's orphans)."""
    out = []
    for pid in processes.all_pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        ref = processes.ref_of(pid)
        if int(fields[3]) == leader.pid and ref and ref.start_ticks >= leader.start_ticks:
            out.append(ref)
    return out


# A test's deadline is what a quiet machine needs; a wait allows LOADED times that (at most
# LOADED_EXTRA_S more). At load 10 on 2 cores a process gets a fifth of a core, and the suite
# must pass there too (CI's machine is shared). A deadline bounds how long a failure takes to
# be told, never what a test asserts.
LOADED = 5
LOADED_EXTRA_S = 240.0


def loaded(timeout_s: float) -> float:
    """`timeout_s` as a wait allows it on a loaded machine."""
    return timeout_s + min(timeout_s * (LOADED - 1), LOADED_EXTRA_S)


def wait_until(
    cond: Callable[[], object], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Until `cond()` holds, for at most loaded(timeout_s); AssertionError then. Looks every
    20 ms, or four times as long as a look took (at most half a second): a condition that asks
    the daemon for its history loads the machine it waits on no more than a fifth."""
    allowed = loaded(timeout_s)
    deadline = time.monotonic() + allowed
    while True:
        began = time.monotonic()
        if cond():
            return
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(max(0.02, 4 * (now - began)), 0.5, max(deadline - now, 0.001)))
    raise AssertionError(f"timed out after {allowed:g} s waiting for {what}")


def flat(text: str) -> str:
    """`text` with every run of white space one space: what kimi-mode said, whatever width it
    wrapped its lines to (80 columns when piped)."""
    return " ".join(text.split())


def too_wide(text: str, width: int = 80) -> list[str]:
    """The rows of `text` wider than `width`, but a path alone on its row: render.wrap keeps a
    path wider than the row whole there, since a path broken in two cannot be copied."""
    return [
        row for row in text.splitlines()
        if len(row) > width and not (" " not in row.strip() and "/" in row)
    ]  # fmt: skip


def assert_clients_get_403_on_the_profiler_routes(base: str, timeout_s: float) -> None:
    """What a client of an armed vLLM's port gets from the profile guard, the fake's and real
    vLLM 0.16's alike: 403 naming `kimi-mode capture` for each spelling of the routes."""
    from kimi_supervisor.ports.http import request
    from kimi_supervisor.vllm_guard import kimi_profile_guard

    header = kimi_profile_guard.HEADER
    for path, headers in [
        ("/start_profile", {}),
        ("/start_profile", {header: "not-the-secret"}),
        ("//start_profile", {}),
        ("/start_profile/", {}),
        ("/stop_profile", {}),
        # uvicorn decodes it to a final newline, which Starlette's route still takes: it
        # started a capture past the first guard (an outside review)
        ("/start_profile%0A", {}),
        ("/stop_profile%0a", {}),
    ]:
        r = request(f"{base}{path}", "POST", timeout_s, headers=headers)
        assert r.status == 403 and "kimi-mode capture" in r.body, (path, headers, r)
    assert request(f"{base}/start_profile", "GET", timeout_s).status == 403


def health(url: str) -> int:
    """GET /health: the status code, 0 for no answer."""
    return request(url, timeout_s=1).status


@pytest.fixture(scope="session")
def session_sandbox() -> Iterator[Sandbox]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no isolated systemd user manager here: {reason}")
    root = Path(tempfile.mkdtemp(prefix="kimi-sbx-"))
    # The daemon is started by the tests that need it (the `daemon` fixture); the teardown
    # tests drive the unit themselves.
    sb = Sandbox.up(root, gpus=SANDBOX_GPUS, daemon=False)
    try:
        yield sb
    finally:
        try:
            sb.down()
        except Exception:
            # After the last test of the run: said in full at the end (the failure digest)
            # and as a warning, never a failed run of tests that all passed. One CI run
            # ended on one line, "ERROR <the last test> - FileNotFoundError: [Errno 2] No
            # such file or directory", which only a session fixture's teardown could give.
            said = traceback.format_exc()
            SESSION_TEARDOWN_PROBLEMS.append(f"the session's sandbox coming down:\n{said}")
            warnings.warn(f"the session's sandbox did not come down cleanly: {said}", stacklevel=1)
        shutil.rmtree(root, ignore_errors=True)


# What went wrong in a session fixture's teardown (the failure digest prints it).
SESSION_TEARDOWN_PROBLEMS: list[str] = []


class SandboxHelper:
    """What a test needs from the sandbox; everything it starts is ended after the test."""

    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb
        self.config = sb.config()
        self.systemd = PystemdSystemd("user", self.config.systemd.bus_address)
        self.gpu = simgpu.SimGpu(sb.gpu_dir)
        self.started: list[ProcessRef] = []
        self.sessions: list[ProcessRef] = []  # spawned session leaders
        self.indices = list(range(SANDBOX_GPUS))

    def fake(self, **options: object) -> None:
        self.sb.set_fake_options(FakeOptions(**options))  # type: ignore[arg-type]

    def start_vllm(self, mode: str = "production", wait_ready: bool = True) -> int:
        from kimi_supervisor.model import Mode
        from kimi_supervisor.ports.launcher import write_argv_file

        write_argv_file(self.config, Mode(mode))
        self.systemd.start(UNIT)
        if wait_ready:
            wait_until(lambda: health(self.config.vllm.health_url) == 200, 30, "vLLM ready")
        return self.systemd.status(UNIT).main_pid

    def used(self) -> list[int]:
        return [d.used_mib for d in self.gpu.sample(self.indices)]

    def baseline(self) -> list[int]:
        return [self.gpu.baseline_of(i) for i in self.indices]

    def ghost(self, **kw: object) -> ProcessRef:
        ref = self.sb.start_ghost(**kw)  # type: ignore[arg-type]
        self.started.append(ref)
        return ref

    def ghost_tree(self, **kw: object) -> list[ProcessRef]:
        """A ghost that forked a helper sharing its memory: [ghost, helper]."""
        refs = self.sb.start_ghost_tree(**kw)  # type: ignore[arg-type]
        self.started.extend(refs)
        return refs

    def assert_alive_except(self, killed: set[int]) -> None:
        """Every process this test started and the teardown did not kill is still alive."""
        dead = [
            f"{r.pid} ({processes.comm_of(r.pid) or 'gone'})"
            for r in self.started
            if r.pid not in killed and not processes.is_alive(r)
        ]
        assert not dead, f"bystanders killed: {dead}"

    def spawn(
        self, args: list[str], env: dict[str, str] | None = None, wait_ready: bool = False
    ) -> ProcessRef:
        """A plain child process of the test, outside every unit, ended after the test. With
        `wait_ready`, returns once it printed a line starting with "ready"."""
        proc = subprocess.Popen(
            args,
            env={**os.environ, **self.sb.env, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if wait_ready else None,
            start_new_session=True,
        )
        ref = processes.ref_of(proc.pid)
        assert ref is not None
        self.started.append(ref)
        self.sessions.append(ref)
        if wait_ready:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            proc.stdout.close()
            assert line.startswith(b"ready"), f"{args[:3]} did not start: {line!r}"
        return ref

    def reset(self) -> None:
        status = self.systemd.status(UNIT)
        if not status.inactive:
            self.systemd.kill(UNIT, "all", signal.SIGKILL)
        wait_until(lambda: self.systemd.status(UNIT).inactive, 15, "the unit to stop")
        if self.systemd.status(UNIT).active_state == "failed":
            self.systemd.reset_failed(UNIT)
        # What a test's own processes started (a respawner's child) went with them: the
        # members of the sessions it spawned, started after their leader.
        leftovers = [r for leader in self.sessions for r in _session_members(leader)]
        for ref in [*self.started, *leftovers]:
            processes.send_signal(ref, signal.SIGCONT)
            processes.send_signal(ref, signal.SIGKILL)
        for ref in [*self.started, *leftovers]:
            wait_until(lambda r=ref: not processes.is_alive(r), 10, f"PID {ref.pid} to end")
            with contextlib.suppress(ChildProcessError):
                os.waitpid(ref.pid, 0)
        self.started.clear()
        self.sessions.clear()
        for leak in (self.sb.gpu_dir / "leak").iterdir():
            leak.unlink()
        simgpu.set_release_delay(self.sb.gpu_dir, simgpu.DRIVER_RELEASE_S)
        self.fake()
        # The driver frees what the killed processes held within its release delay.
        wait_until(
            lambda: all(
                d.used_mib == self.gpu.baseline_of(d.index) and not d.processes
                for d in self.gpu.sample(self.indices)
            ),
            10,
            "the simulated GPUs to return to baseline",
        )
        self.gpu.close()


@pytest.fixture
def sandbox(session_sandbox: Sandbox) -> Iterator[SandboxHelper]:
    helper = SandboxHelper(session_sandbox)
    helper.fake()
    try:
        yield helper
    finally:
        helper.reset()
        # Anything left on the simulated GPUs means a test leaked a process: fail loudly.
        gpu = simgpu.SimGpu(session_sandbox.gpu_dir)
        try:
            wait_until(
                lambda: all(
                    d.used_mib == gpu.baseline_of(d.index) for d in gpu.sample(helper.indices)
                ),
                10,
                "the simulated GPUs to return to baseline after the test",
            )
        finally:
            gpu.close()


@pytest.fixture
def python() -> str:
    return sys.executable


class HealthWatch:
    """GET /health every 50 ms in a thread, from now until `stop()`: the answers seen, each
    change once (0: the connection refused). The same check runs against the fake and real vLLM:
    they must agree."""

    def __init__(self, url: str) -> None:
        import threading

        self.url = url
        self.seen: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _look(self) -> None:
        status = health(self.url)
        if not self.seen or self.seen[-1] != status:
            self.seen.append(status)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._look()

    def stop(self) -> list[int]:
        """What was seen, up to a last look now."""
        self._stop.set()
        self._thread.join(5)
        self._look()
        return self.seen


def assert_starts_like_vllm_0_16(seen: list[int]) -> None:
    """While vLLM loads nothing listens (refused), then /health answers 200: no 503 phase, as
    measured with vLLM 0.16's CPU build."""
    assert 0 in seen and seen[-1] == 200, seen
    assert 503 not in seen[seen.index(0) :], seen


KIMI_MODE = str(Path(sys.executable).with_name("kimi-mode"))
CHECKOUT = Path(__file__).resolve().parent.parent

# In a mount namespace of its own: the checkout bound onto a directory any user can reach, then
# setpriv. A checkout under a 0700 /root is then readable by another user through the view, and
# nothing is mounted outside that one process tree.
_VIEW = 'mount --bind "$1" "$2" && export PYTHONPATH="$2" && shift 2 && exec setpriv "$@"'


@functools.cache
def _view_dir() -> str:
    d = tempfile.mkdtemp(prefix="kimi-view-")
    os.chmod(d, 0o755)
    atexit.register(os.rmdir, d)
    return d


def like_a_terminal() -> None:
    """preexec_fn for a client that a test interrupts as Ctrl-C would: SIGINT at its default,
    as in a terminal, even when the suite itself runs with SIGINT ignored (a background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def as_user(*setpriv: str) -> list[str]:
    """The argv prefix that runs this checkout's Python as another user (`setpriv` options,
    for example "--reuid=65534"), wherever the checkout is. Follow it with Python's
    arguments: `[*as_user(...), "-m", "kimi_supervisor.cli.kimi_mode", "status"]`."""
    view = _view_dir()
    exe = Path(sys.executable)  # the venv's own path: its pyvenv.cfg is found from it
    python = Path(view, exe.relative_to(CHECKOUT)) if exe.is_relative_to(CHECKOUT) else exe
    return [
        "unshare", "--mount", "--propagation", "private", "sh", "-c", _VIEW, "sh",
        str(CHECKOUT), view, *setpriv, str(python),
    ]  # fmt: skip


class DaemonHelper:
    """The daemon as `kimi-supervisor.service` of the sandbox's manager, and kimi-mode."""

    def __init__(self, sandbox: SandboxHelper) -> None:
        self.h = sandbox
        self.sb = sandbox.sb
        self.config = sandbox.config
        self.socket = self.config.control.socket
        self.dropin = self.sb.manager.unit_dir / f"{DAEMON_UNIT}.d" / "zz-test.conf"

    # -- the service --
    def reset_state(self, desired: str = "production") -> None:
        from kimi_supervisor.model import Mode
        from kimi_supervisor.store.state import StateStore, with_desired, with_transition

        store = StateStore(self.config.state.dir)
        store.update(lambda st: with_transition(with_desired(st, Mode(desired), "test"), None))
        (self.config.state.dir / "history.jsonl").unlink(missing_ok=True)
        for aside in self.config.state.dir.glob("state.json.[co][ou]*-*"):  # corrupt, outside
            aside.unlink()

    def override(self, text: str) -> None:
        """A drop-in for the daemon's unit (removed after the test)."""
        self.dropin.write_text("[Service]\n" + text)
        self.sb.manager.systemctl("daemon-reload")

    def start(self, wait: bool = True) -> None:
        self.sb.start_daemon(wait)

    def stop(self) -> None:
        self.sb.stop_daemon()

    def stopped_by_itself(self) -> bool:
        """`systemctl stop`, and whether the daemon's process ended by itself: not by systemd
        giving up on it at TimeoutStopSec (Result=timeout), however long the host took."""
        self.sb.manager.systemctl("stop", DAEMON_UNIT, check=False)
        show = ["show", DAEMON_UNIT, "-p", "Result", "--value"]
        result = self.sb.manager.systemctl(*show, check=False).stdout.strip()
        self.stop()  # and its reset-failed
        return result == "success"

    def pid(self) -> int:
        return self.h.systemd.status(DAEMON_UNIT).main_pid

    def unit(self) -> str:
        return self.h.systemd.status(DAEMON_UNIT).active_state

    def vllm_pid(self) -> int:
        return self.h.systemd.status(UNIT).main_pid

    def log(self) -> str:
        """The daemon's log file; "" before the daemon's first start in this sandbox."""
        try:
            return self.sb.daemon_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- talking to it --
    def request(self, req: dict[str, object], timeout_s: float = 30) -> list[dict[str, object]]:
        from kimi_supervisor.control.client import Unreachable, exchange

        try:
            return [msg for _raw, msg in exchange(self.socket, req, timeout_s=timeout_s)]
        except Unreachable as e:
            # Say whether the daemon went away (a crash, the watchdog, the OOM killer) and what
            # it logged last: a lost connection in CI must explain itself.
            unit = self.sb.manager.systemctl(
                "show", DAEMON_UNIT, "-p", "ActiveState,SubState,NRestarts,Result,"
                "ExecMainPID,ExecMainStatus,ExecMainCode", check=False,
            ).stdout  # fmt: skip
            # The unit's state last: a report that keeps a failure's head and tail shows it.
            tail = "\n".join(line[:200] for line in self.log().splitlines()[-10:])
            raise Unreachable(f"{e}\nits log's end:\n{tail}\nthe daemon's unit: {unit}") from e

    def status(self) -> dict[str, Any]:
        (reply,) = self.request({"cmd": "status"}, 10)
        assert reply["ok"], reply
        return reply["data"]  # type: ignore[return-value]

    def history(self) -> list[dict[str, Any]]:
        (reply,) = self.request({"cmd": "history", "n": 1000}, 10)
        assert reply.get("ok"), reply  # a refusal (busy, too many clients) says which
        return reply["data"]["entries"]  # type: ignore[index,return-value]

    def teardown_count(self) -> int:
        return len([e for e in self.history() if e["kind"] == "teardown"])

    def transitions(self) -> list[dict[str, Any]]:
        return [e for e in self.history() if e["kind"] == "transition"]

    def kimi_mode(
        self, *args: str, user: list[str] | None = None, timeout: float = 90
    ) -> subprocess.CompletedProcess[str]:
        """kimi-mode with `args`; as another user with `user` (setpriv's options)."""
        cmd = (
            [KIMI_MODE]
            if user is None
            else [*as_user(*user), "-m", "kimi_supervisor.cli.kimi_mode"]
        )
        return subprocess.run(
            [*cmd, *args],
            env={**os.environ, **self.sb.env},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def wait_status(
        self, done: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
    ) -> dict[str, Any]:
        """Poll status until `done` holds; the daemon's log tail is in the failure message."""
        last: dict[str, Any] = {}

        def reached() -> bool:
            nonlocal last
            try:
                last = self.status()
            except Exception:
                return False
            return done(last)

        try:
            wait_until(reached, timeout_s, what)
        except AssertionError:
            raise AssertionError(
                f"{what}: last {last.get('status_line')}\n{self.log()[-3000:]}"
            ) from None
        return last

    def wait_serving(self, mode: str, timeout_s: float = 30) -> dict[str, Any]:
        return self.wait_status(
            lambda s: s["state"] == "serving" and s["mode"] == mode,
            timeout_s,
            f"the daemon to serve {mode}",
        )

    def wait_state(self, state: str, timeout_s: float = 30) -> dict[str, Any]:
        return self.wait_status(lambda s: s["state"] == state, timeout_s, f"state {state}")

    @contextlib.contextmanager
    def configured(self, **sections: dict[str, Any]) -> Iterator[None]:
        """The sandbox's config with `sections`' fields changed (`daemon={"tick_s": 0.5}`),
        for the daemon started inside the block; the original file afterwards."""
        from kimi_supervisor.configfile import load_config
        from kimi_supervisor.tomlwrite import to_toml

        path = self.sb.config_path
        original = path.read_text()
        c = load_config(path)
        c = c.model_copy(
            update={k: getattr(c, k).model_copy(update=v) for k, v in sections.items()}
        )
        path.write_text(to_toml(c))
        try:
            yield
        finally:
            path.write_text(original)

    def wait_serving_anew(self, mode: str, old_pid: int, timeout_s: float = 60) -> dict[str, Any]:
        """Until a vLLM other than `old_pid` serves `mode`. An incident is in the history a moment
        before status leaves SERVING, so `wait_serving` right after one may see the old vLLM.
        Fails at once with the daemon's reason if it gave up (FAILED)."""

        def anew(s: dict[str, Any]) -> bool:
            assert s["state"] != "failed", f"the daemon gave up, not restarted: {s['status_line']}"
            return (
                s["state"] == "serving" and s["mode"] == mode
                and s["unit"]["main_pid"] not in (0, old_pid)
            )  # fmt: skip

        return self.wait_status(anew, timeout_s, f"a new vLLM to serve {mode}")


@pytest.fixture
def daemon(sandbox: SandboxHelper) -> Iterator[DaemonHelper]:
    helper = DaemonHelper(sandbox)
    helper.reset_state()
    try:
        yield helper
        # Whatever the test planted and the daemon's teardowns did not kill still lives.
        from kimi_supervisor.store import history as audit

        history = audit.read(helper.config.state.dir)
        killed = {
            k["process"]["pid"]
            for e in history
            if e["kind"] == "teardown"
            for k in e["kills"]
            if k["signal"] == "SIGKILL"
        }
        sandbox.assert_alive_except(killed)
    finally:
        helper.stop()
        if helper.dropin.exists():
            helper.dropin.unlink()
            helper.sb.manager.systemctl("daemon-reload")


@pytest.fixture
def profiling(sandbox: SandboxHelper, daemon: DaemonHelper) -> DaemonHelper:
    """The daemon serving profile mode (no expiry), with an empty captures folder."""
    for folder in sandbox.config.profiling.captures_dir.glob("*"):
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    daemon.reset_state(desired="profile")
    daemon.start()
    daemon.wait_serving("profile")
    return daemon


@pytest.fixture(scope="session")
def debian_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Debian package of this checkout, built once per session (about a minute) and shared by
    the package's own tests, the booted hosts and the fleet."""
    from tests import debs

    why = debs.unavailable()
    if why:
        pytest.skip(f"no Debian package: {why}")
    return debs.build(tmp_path_factory.mktemp("deb"))


@pytest.fixture(scope="session")
def debian_package_2(debian_package: Path) -> Path:
    """A second build, a newer version: its README ends with "A newer release." and its shipped
    configuration has one more comment (a new default beside an admin's edit)."""
    from tests import debs

    def edit(tree: Path) -> None:
        with open(tree / "usr/share/doc/kimi-supervisor/README.md", "a") as f:
            f.write("\nA newer release.\n")
        with open(tree / "etc/kimi-supervisor/kimi-supervisor.toml", "a") as f:
            f.write("\n# A newer default.\n")

    return debs.repack(debian_package, "0.1.0-2", debian_package.parent, edit)


# -- the tiers side by side: what shares a costly start runs on one worker --------------------

# `make test TIER_WORKERS=2` runs the tiers past the unit tier on two pytest-xdist workers
# (`--dist loadgroup`; CI runs them one at a time: the Makefile says why). The heavy tiers (a
# real vLLM, the Debian package and the hosts booted from it: each a core or more while it
# starts) run as one group, whole and in order, on one worker: never two of them at once. A
# module with a module-scoped start of its own is a group too. Every other test goes to
# whichever worker is free, each worker with a sandbox of its own: the sandbox tier keeps a core
# 0.67 busy on average (it waits on timers and on the daemon), so it runs beside the heavy group.
# A sandbox module that starts a whole test session of its own (a systemd user manager, a
# daemon, a fake vLLM: test_how_started) is as heavy, and joins the heavy group: beside a real
# vLLM under load, its `systemctl stop` of the daemon once ran past 60 s.
HEAVY = ("realvllm", "booted", "package")
HEAVY_MODULES = ("tests/sandbox/test_how_started.py",)
OWN_WORKER = ("tests/sandbox/test_install.py", "tests/sandbox/test_fleet.py")


def shared_start(nodeid: str) -> str | None:
    """The group of the test `nodeid` ("tests/TIER/MODULE.py::NAME"), None for a test alone."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if len(parts) < 3 or parts[0] != "tests":
        return None
    if parts[1] in HEAVY or path in HEAVY_MODULES:
        return "the heavy tiers: a real vLLM, the Debian package, the booted hosts"
    return path if path in OWN_WORKER else None


def pytest_sessionstart(session: Any) -> None:
    """Before any test (in the controller only, as root): booted hosts that an earlier, killed
    session left running are ended (tests/booted/host.reap_leftover_hosts), and said."""
    if hasattr(session.config, "workerinput") or os.geteuid() != 0:
        return
    from tests.booted.host import reap_leftover_hosts

    for what in reap_leftover_hosts():
        print(f"\nended a booted host that an earlier test session left running: {what}")


def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """`--dist loadgroup` with the groups above, read from each test's path. (xdist's own
    loadgroup reads `xdist_group` marks through a node ID that pytest 9 no longer lets it
    change: every test was scheduled alone, and two booted tests shared one host from two
    workers.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedStarts(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return shared_start(nodeid) or nodeid

    return SharedStarts(config, log)


# -- tiers that did not run: said loudly at the end, never only as skips among the others -----


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Each tier (a folder under tests/) whose tests were all skipped is named, with why, in a
    block of its own at the end of the run; and in the file KIMI_TIER_REPORT names, which
    .ci/run prints last. A skipped tier is not a tested one."""
    ran: dict[str, int] = {}
    skipped: dict[str, list[str]] = {}
    for kind in ("passed", "failed", "error", "skipped"):
        for rep in terminalreporter.stats.get(kind, []):
            parts = str(getattr(rep, "nodeid", "")).split("/")
            if len(parts) < 3 or parts[0] != "tests" or getattr(rep, "when", "") == "teardown":
                continue
            tier = parts[1]
            if kind == "skipped":
                reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
                skipped.setdefault(tier, []).append(reason.removeprefix("Skipped: "))
            else:
                ran[tier] = ran.get(tier, 0) + 1
    lines = [
        f"THE {tier.upper()} TIER DID NOT RUN: all {len(why)} of its tests were skipped "
        f"({sorted(set(why))[0]})"
        for tier, why in sorted(skipped.items())
        if not ran.get(tier)
    ]
    if lines:
        terminalreporter.write_sep("!", "tiers that did not run")
        for line in lines:
            terminalreporter.write_line(line, red=True, bold=True)
    # Appended to: `make test` runs the unit tier and the others as two sessions.
    if hasattr(terminalreporter.config, "workerinput"):
        return  # an xdist worker: said once, by the session that gathers the workers' reports
    out = os.environ.get("KIMI_TIER_REPORT")
    if out:
        with open(out, "a") as f:
            f.write("".join(f"{line}\n" for line in lines))
    digest = os.environ.get("KIMI_FAILURE_DIGEST")
    if digest:
        with open(digest, "a") as f:
            f.write(failure_digest(terminalreporter))


def failure_digest(terminalreporter: Any, shown: int = 4, tail: int = 30) -> str:
    """Each failure and error of the run, with the end of its traceback and of what it printed:
    .ci/run prints it last, where a reader of only the log's tail still sees why (a teardown's
    error is otherwise one line: "ERROR ... - FileNotFoundError")."""
    reports = [rep for kind in ("failed", "error") for rep in terminalreporter.stats.get(kind, [])]
    out: list[str] = []
    for i, rep in enumerate(reports):
        out.append(f"== {rep.nodeid} (at {rep.when}) ==")
        if i >= shown:
            continue
        out += str(rep.longreprtext).splitlines()[-tail:]
        for title, text in rep.sections:
            out.append(f"-- {title}, its last lines --")
            out += text.splitlines()[-tail // 3 :]
    if len(reports) > shown:
        out.append(f"(the traceback of the first {shown} of {len(reports)} only: see above)")
    for problem in SESSION_TEARDOWN_PROBLEMS:
        out.append("== a session fixture's teardown ==")
        out += problem.splitlines()[-tail:]
    return "".join(f"{line}\n" for line in out)
