"""`kimi-supervisor run` (the daemon, put together from its ports and wings) and `kimi-supervisor
reload` (its ExecReload)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from kimi_supervisor.cli.compose import config_path, open_gpu, systemd_port
from kimi_supervisor.cli.exits import Exit
from kimi_supervisor.configfile import load_config

if TYPE_CHECKING:
    from kimi_supervisor.ports.bounded import ProcessWorker
    from kimi_supervisor.ports.systemd import SystemdPort


def cmd_run(args: argparse.Namespace) -> int:
    """The daemon: `kimi-supervisor run`, started by kimi-supervisor.service (Type=notify)."""
    from kimi_supervisor import log
    from kimi_supervisor.control.handlers import Handlers
    from kimi_supervisor.control.server import ControlError, ControlServer
    from kimi_supervisor.loop.boot import STOPPED, on_the_state_folder
    from kimi_supervisor.loop.bundles import BUNDLE_TIMEOUT_S
    from kimi_supervisor.loop.daemon import (
        Daemon,
        block_signals,
        install_signal_handlers,
        reexec,
    )
    from kimi_supervisor.ports.metrics import Metrics
    from kimi_supervisor.ports.notify import Notifier
    from kimi_supervisor.ports.output import FileOutput, JournalOutput, OutputPort
    from kimi_supervisor.store.state import StateError, StateStore

    block_signals()  # before any thread starts (see loop/daemon.py, HANDLED)
    config = load_config(config_path(args.config))
    reap_leftovers()
    log.configure()
    logger = log.get()

    def emit(event: str, level: str = "info", **kw: object) -> None:
        # The switch under way names the entry (KIMI_TRANSITION in the journal).
        tr = daemon.s.transition if daemon is not None else None
        if tr is not None and "transition" not in kw:
            kw["transition"] = tr.id
        getattr(logger, level)(event, **kw)

    daemon: Daemon | None = None

    # NVML's calls, the state folder's and the history's reads for clients each run in a
    # process of their own, in a scope of its own (ports/bounded.py): one stuck in the kernel
    # holds neither the loop nor this unit's stop.
    systemd = systemd_port(config)
    nvml = io_worker(systemd, "nvml", config.gpus.timeout_s, log=emit, devices=True)
    disk = io_worker(systemd, "state", config.state.timeout_s, log=emit)
    # The clients' reads start their process again from a control thread: on a D-Bus
    # connection of their own (one port is used from one thread), under the worker's lock.
    reads = io_worker(systemd_port(config), "history", config.state.timeout_s, log=emit)
    # The incident bundles' reads (/proc, the journal) and writes, from their own thread.
    bundles = io_worker(systemd_port(config), "bundle", BUNDLE_TIMEOUT_S, log=emit)
    workers = (nvml, disk, reads, bundles)
    for w in workers:
        w.start()
    notifier = Notifier()
    try:
        # Trust only what the daemon's user owns; asked of the state folder's process, and
        # waited for, said, while the folder does not answer (loop/boot.py).
        on_the_state_folder(
            disk,
            functools.partial(StateStore.check, StateStore(config.state.dir)),
            f"checking {config.state.dir}",
            say=notifier.status,
            log=emit,
        )
    except StateError as e:
        print(f"kimi-supervisor run: {e}", file=sys.stderr)
        for w in workers:
            w.close()
        return Exit.OK if str(e).startswith(STOPPED) else Exit.USAGE
    gpu = open_gpu(config, nvml)
    keep = config.daemon.output_tail_lines
    output: OutputPort = (
        FileOutput(config.vllm.log_file, keep)
        if config.vllm.log_file
        else JournalOutput(config.service.unit, config.systemd.scope, keep)
    )
    metrics = Metrics() if config.metrics.enabled else None
    daemon = Daemon(
        config, systemd, gpu, output=output, notifier=notifier, log=emit, metrics=metrics,
        disk=disk, reads=reads, bundles=bundles,
    )  # fmt: skip
    c = config.control
    server = ControlServer(
        c.socket,
        c.group,
        Handlers(daemon),
        log=emit,
        max_clients=c.max_clients,
        max_line_bytes=c.max_line_bytes,
        idle_timeout_s=c.idle_timeout_s,
    )
    try:
        server.listen()  # the lock first: a second daemon touches no state
    except ControlError as e:
        print(f"kimi-supervisor run: {e}", file=sys.stderr)
        return Exit.FAILED
    emit(
        "daemon_starting",
        pid=os.getpid(),
        config=str(config_path(args.config)),
        socket=str(c.socket),
    )
    try:
        # The state is read before anything is answered: a status asked for meanwhile waits in
        # the socket's queue, and the metrics are not served yet, rather than show the defaults.
        daemon.boot()
    except StateError as e:  # stopped while the state folder did not answer; not trusted
        print(f"kimi-supervisor run: {e}", file=sys.stderr)
        server.close()
        for w in workers:
            w.close()
        return Exit.OK if str(e).startswith(STOPPED) else Exit.FAILED
    except BaseException:
        server.close()
        raise
    server.serve()
    if metrics is not None:
        try:
            m = config.metrics
            metrics.serve(m.address, m.port, m.timeout_s, max_connections=m.max_connections)
        except OSError as e:
            emit(
                "metrics_unavailable",
                level="warning",
                message=f"cannot listen on {config.metrics.address}:{config.metrics.port}: {e}",
            )
    install_signal_handlers(daemon)

    def close() -> None:
        """Everything the daemon opened. Its I/O processes end with their input (a stuck one
        is left in its scope): a re-executed image starts its own and reaps what the old one
        left (reap_leftovers). Closing twice is harmless."""
        server.close()
        if metrics is not None:
            metrics.close()
        output.close()
        gpu.close()
        disk.close()
        reads.close()
        bundles.close()

    try:
        daemon.loop()
        if daemon.s.reexec_requested and not daemon.s.stop_requested:
            emit("reexec", message="re-executing; vLLM keeps running and is adopted")
            close()
            reexec(notifier)
    finally:
        close()
    return Exit.OK if daemon.s.stopped_clean else Exit.FAILED


def reap_leftovers() -> None:
    """Reap the children an earlier image of this process left when it re-executed (its I/O
    processes, ended with their input): before this image starts any, so no child of its own
    is taken. One still running (stuck in the kernel) is a zombie once it ends: the next
    re-exec reaps it."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def io_worker(
    systemd: SystemdPort,
    name: str,
    timeout_s: float,
    *,
    log: Callable[..., None],
    devices: bool = False,
) -> ProcessWorker:
    """A process of its own for one kind of the daemon's blocking I/O, moved into a scope of its
    own (`kimi-supervisor-io-NAME-PID.scope`) before its first call; where no scope can be
    made, it stays in the daemon's unit, and the log says so."""
    from kimi_supervisor.ports.bounded import SCOPE_PREFIX, ProcessWorker
    from kimi_supervisor.ports.systemd import SystemdError

    def adopt(pid: int) -> str:
        scope = f"{SCOPE_PREFIX}{name}-{pid}.scope"
        try:
            systemd.move_to_scope(scope, pid, f"kimi-supervisor: its {name} I/O", devices=devices)
        except SystemdError as e:
            log("io_scope_failed", level="warning", worker=name, pid=pid, error=str(e))
            return ""
        return scope

    return ProcessWorker(name, timeout_s, adopt, log=log)


# How long `kimi-supervisor reload` waits for the new image (a teardown in progress finishes
# before the daemon re-executes).
RELOAD_WAIT_S = 900.0


def preflight() -> str | None:
    """What stops this version from running as the daemon, or None. `reload` runs the newly
    installed code (an upgrade switched the commands to it): it imports every module the daemon
    can use, and the configuration was parsed by it, before the old daemon re-executes into it.
    A broken build (a module missing, one that fails to import) fails here, while the old image
    still runs, instead of after the exec, with vLLM unwatched. The sandbox is not the daemon's."""
    import importlib
    import pkgutil

    import kimi_supervisor

    for info in pkgutil.walk_packages(kimi_supervisor.__path__, "kimi_supervisor."):
        if info.name.startswith("kimi_supervisor.sandbox"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as e:  # any failure to import is a build that cannot run
            return f"{info.name} does not import: {type(e).__name__}: {e}"
    return None


def cmd_reload(args: argparse.Namespace) -> int:
    """ExecReload: SIGHUP to the daemon, then wait until the re-executed image answers, so that
    `systemctl reload` returns with the new daemon up (systemd 252 does not wait for READY=1)."""
    import signal
    import time

    from kimi_supervisor.control.client import Unreachable, exchange
    from kimi_supervisor.ports import processes

    config = load_config(config_path(args.config))
    path = config.control.socket
    broken = preflight()
    if broken:
        print(
            f"kimi-supervisor reload: this version cannot run ({broken}); the daemon was not "
            "signalled and runs on as it was, vLLM untouched",
            file=sys.stderr,
        )
        return Exit.FAILED

    def started_at() -> str | None:
        try:
            for _raw, msg in exchange(path, {"cmd": "status"}, timeout_s=5):
                return str(msg.get("data", {}).get("daemon", {}).get("started_at"))
        except (Unreachable, OSError, TimeoutError):
            return None
        return None

    before = started_at()
    ref = processes.ref_of(args.pid)
    if ref is None:
        print(f"kimi-supervisor reload: no process {args.pid}", file=sys.stderr)
        return Exit.FAILED
    processes.send_signal(ref, signal.SIGHUP)
    deadline = time.monotonic() + RELOAD_WAIT_S
    while time.monotonic() < deadline:
        now = started_at()
        if now is not None and now != before:
            return Exit.OK
        time.sleep(0.05)
    print(
        f"kimi-supervisor reload: the daemon did not come back within {RELOAD_WAIT_S:g} s "
        "(`journalctl -u kimi-supervisor`)",
        file=sys.stderr,
    )
    return Exit.FAILED
