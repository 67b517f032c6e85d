"""The teardown, scenario by scenario, in the sandbox: a real systemd user manager, real
processes, simulated GPUs. Each ends CLEAN with the GPUs at baseline unless said otherwise."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.config import Config
from kimi_supervisor.model import Evidence, Outcome, Step, TeardownReport
from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.clock import SystemClock
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.sandbox import UNIT
from kimi_supervisor.store import baseline
from kimi_supervisor.teardown.escalation import Teardown

from ..conftest import SandboxHelper, wait_until

pytestmark = pytest.mark.systemd


class Run:
    def __init__(self, report: TeardownReport, events: list[tuple[str, dict[str, Any]]]) -> None:
        self.report = report
        self.events = events

    def step(self, step: Step) -> Any:
        return next(s for s in self.report.steps if s.step is step)

    def killed(self, step: Step | None = None) -> set[int]:
        return {
            k.process.pid
            for k in self.report.kills
            if k.signal == "SIGKILL" and (step is None or k.step is step)
        }

    def ran(self) -> list[Step]:
        return [s.step for s in self.report.steps if not s.skipped]


def teardown(
    sandbox: SandboxHelper,
    managed: list[int] | None = None,
    config: Config | None = None,
    also_gone: set[int] = frozenset(),  # type: ignore[assignment]
    listed_since: dict[tuple[int, int], int] | None = None,
) -> Run:
    """One teardown over `managed` GPUs (default: all); then every process the test started
    that the teardown did not kill (and that is not in `also_gone`) must still be alive.
    `listed_since`: what the daemon's own samples saw listed before (teardown/listing.py)."""
    events: list[tuple[str, dict[str, Any]]] = []
    base = baseline.load(sandbox.config.state.dir)
    assert base is not None, "sandbox up calibrates the baseline"
    baselines = {i: b for i, b in base.devices.items() if managed is None or i in managed}
    gpu = simgpu.SimGpu(sandbox.sb.gpu_dir)
    try:
        report = Teardown(
            config or sandbox.config,
            sandbox.systemd,
            gpu,
            SystemClock(),
            baselines,
            on_event=lambda e: events.append((e.kind, e.data())),
            listed_since=listed_since or {},
        ).run()
    finally:
        gpu.close()
    run = Run(report, events)
    sandbox.assert_alive_except(run.killed() | set(also_gone))
    return run


def assert_clean(sandbox: SandboxHelper, run: Run) -> None:
    assert run.report.outcome is Outcome.CLEAN, run.report.diagnosis
    managed = [d.index for d in run.report.devices]
    used, base = sandbox.used(), sandbox.baseline()
    assert [used[i] for i in managed] == [base[i] for i in managed]
    assert sandbox.systemd.status(UNIT).inactive
    assert os.getpid() not in run.killed(), "the supervisor never targets itself"


def test_a_well_behaved_vllm_ends_after_stopping_the_unit(sandbox: SandboxHelper) -> None:
    sandbox.start_vllm()
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    assert Step.STOP_UNIT in run.ran()
    # Ended within its grace period on SIGTERM: no kill step had to follow.
    assert not {Step.KILL_CGROUP, Step.KILL_STRAYS, Step.KILL_GPU_HOLDERS} & set(run.ran())
    assert run.killed() == set()


def test_a_vllm_that_ignores_sigterm_is_cleared_by_the_cgroup_kill_after_the_grace(
    sandbox: SandboxHelper,
) -> None:
    sandbox.fake(ignore_sigterm=True)
    sandbox.start_vllm()
    in_unit = set(sandbox.systemd.cgroup_pids(UNIT))
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    grace = sandbox.config.teardown.term_grace_s
    assert run.step(Step.STOP_UNIT).duration_s >= grace
    assert run.killed(Step.KILL_CGROUP) == in_unit  # and clean: the cgroup kill cleared it


def test_a_ghost_with_an_innocuous_title_on_every_gpu_is_killed_as_a_gpu_holder(
    sandbox: SandboxHelper,
) -> None:
    sandbox.start_vllm()
    ghost = sandbox.ghost(gpu="all", mib=8_000, title="python")
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    assert run.killed() == {ghost.pid}
    kill = next(k for k in run.report.kills if k.signal == "SIGKILL")
    assert kill.step is Step.KILL_GPU_HOLDERS and kill.evidence is Evidence.NVML_LISTED
    assert kill.process.comm == "python" and kill.process.start_time > 0
    assert [k.signal for k in run.report.kills] == ["SIGSTOP", "SIGKILL"]


def test_a_stray_vllm_worker_outside_the_unit_is_killed_as_a_stray(sandbox: SandboxHelper) -> None:
    sandbox.start_vllm()
    stray = sandbox.ghost(gpu="3", mib=4_000, title="VLLM::Worker_TP3")
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    assert run.killed(Step.KILL_STRAYS) == {stray.pid}
    assert run.report.kills[-1].evidence is Evidence.VLLM_SIGNATURE


def test_a_process_that_escaped_the_units_tree_is_killed_as_a_stray(
    sandbox: SandboxHelper,
) -> None:
    sandbox.fake(
        ghost_title="python3",
        ghost_mib=2_000,
        devices=[0, 1, 2, 3],
        ghost_cgroup_procs=sandbox.sb.ghost_cgroup_procs(),
    )
    sandbox.start_vllm()
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    assert len(run.killed(Step.KILL_STRAYS)) == 1
    assert run.report.kills[-1].process.comm == "python3"


RESPAWNER = textwrap.dedent("""
    import subprocess, sys
    from setproctitle import setproctitle
    setproctitle("python")
    while True:
        child = subprocess.Popen([sys.executable, "-m", "kimi_supervisor.sandbox.ghost",
                                  "--gpu", "1", "--mib", "3000", "--title", "python"],
                                 stdout=subprocess.DEVNULL)
        child.wait()
""")


def test_a_respawning_parent_outside_the_unit_leaves_no_child_alive(
    sandbox: SandboxHelper,
) -> None:
    parent = sandbox.spawn([sys.executable, "-c", RESPAWNER])
    wait_until(lambda: any(d.processes for d in sandbox.gpu.sample([1])), 10, "the first child")
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    assert not processes.is_alive(parent)
    evidences = {k.evidence for k in run.report.kills if k.signal == "SIGKILL"}
    assert Evidence.RESPAWNS in evidences
    time.sleep(0.3)  # a survivor would have started a new child by now
    assert sandbox.used() == sandbox.baseline()


def test_a_child_respawned_while_the_memory_drains_is_killed_with_its_parent(
    sandbox: SandboxHelper,
) -> None:
    """A loaded host starts the next child later than `respawn_watch_s`: it shows up while the
    teardown waits for the driver to release the first child's memory, and the teardown goes
    back to killing instead of waiting out `release_timeout_s`."""
    late_respawner = RESPAWNER.replace("child.wait()", "child.wait(); time.sleep(1.5)")
    parent = sandbox.spawn([sys.executable, "-c", "import time\n" + late_respawner])
    wait_until(lambda: any(d.processes for d in sandbox.gpu.sample([1])), 10, "the first child")
    simgpu.set_release_delay(sandbox.sb.gpu_dir, 3.0)  # the first child's memory drains slowly
    t = sandbox.config.teardown.model_copy(update={"respawn_watch_s": 0.3})
    run = teardown(sandbox, config=sandbox.config.model_copy(update={"teardown": t}))
    assert_clean(sandbox, run)
    assert not processes.is_alive(parent)
    assert run.ran().count(Step.KILL_GPU_HOLDERS) == 2, run.ran()
    assert Evidence.RESPAWNS in {k.evidence for k in run.report.kills if k.signal == "SIGKILL"}
    time.sleep(2)  # a surviving parent would have started a new child by now
    assert sandbox.used() == sandbox.baseline()


def test_a_stopped_holder_is_killed(sandbox: SandboxHelper) -> None:
    ghost = sandbox.ghost(gpu="0", mib=5_000, title="python")
    os.kill(ghost.pid, signal.SIGSTOP)
    wait_until(lambda: processes.state_of(ghost.pid) == "T", 5, "the ghost to stop")
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    assert run.killed() == {ghost.pid}


def test_a_holder_that_reached_the_device_by_another_path_is_found_by_identity(
    sandbox: SandboxHelper,
) -> None:
    """As from a chroot, a container or a bind mount: the same device files under another path
    (hard links in another directory, the same names). The holder is known by the files'
    identity, as the kernel knows them, not by the path its descriptors show."""
    gpu_dir = sandbox.sb.gpu_dir
    view = gpu_dir.parent / "gpu-view"
    (view / "dev").mkdir(parents=True)
    try:
        for f in (gpu_dir / "dev").iterdir():
            os.link(f, view / "dev" / f.name)
        for entry in gpu_dir.iterdir():
            if entry.name != "dev":
                (view / entry.name).symlink_to(entry)
        hidden = sandbox.ghost(
            gpu="1", mib=6_000, title="python", hidden=True,
            extra_env={"KIMI_SIM_GPU_DIR": str(view)},
        )  # fmt: skip
        assert str(view / "dev" / "nvidia1") in dict(openfiles.open_paths(hidden.pid)).values()
        run = teardown(sandbox)
        assert_clean(sandbox, run)
        assert run.killed() == {hidden.pid}
        assert run.report.kills[-1].evidence is Evidence.OPEN_AND_MAPPED
    finally:
        shutil.rmtree(view)


def test_a_holder_nvml_does_not_list_is_found_open_and_mapped_and_protected_ones_survive(
    sandbox: SandboxHelper,
) -> None:
    hidden = sandbox.ghost(gpu="2", mib=7_000, title="python", hidden=True)
    persistenced = sandbox.ghost(gpu="all", mib=0, title="nvidia-persistenced")
    dcgm = sandbox.ghost(gpu="all", mib=0, title="dcgm-exporter")
    ctl = sandbox.sb.gpu_dir / "dev" / "nvidiactl"
    control_only = sandbox.spawn(
        [sys.executable, "-c", f"import time; f = open({str(ctl)!r}); time.sleep(600)"]
    )
    wait_until(lambda: openfiles.holds_any(control_only.pid, [str(ctl)]), 5, "ctl opened")
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    assert run.killed() == {hidden.pid}
    assert run.report.kills[-1].evidence is Evidence.OPEN_AND_MAPPED
    assert "nvidia2" in run.report.kills[-1].reason
    for survivor in (persistenced, dcgm, control_only):
        assert processes.is_alive(survivor)


def test_memory_the_driver_releases_slowly_is_waited_for_with_progress(
    sandbox: SandboxHelper,
) -> None:
    simgpu.set_release_delay(sandbox.sb.gpu_dir, 1.5)
    sandbox.start_vllm()
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    readings = [
        [d["used_mib"] for d in data["devices"]] for kind, data in run.events if kind == "gpus"
    ]
    assert readings[0] == [90_615] * 4 and readings[-1] == [615] * 4
    assert run.killed() == set(), "draining memory is waited for, never blamed on a process"
    assert len(readings) >= 2


def test_memory_held_with_no_process_ends_stuck_within_the_deadlines_with_a_diagnosis(
    sandbox: SandboxHelper,
) -> None:
    sandbox.sb.leak(0, 5_000)
    # The leak never goes: the teardown's return, STUCK, is its deadlines holding.
    run = teardown(sandbox)
    assert run.report.outcome is Outcome.STUCK
    assert "GPU 0: 5615 MiB used, baseline 615" in run.report.diagnosis
    assert "no process behind it" in run.report.next_action
    assert run.killed() == set()


# vLLM's own user (the package's kimi-vllm), as a uid: a drop-in gives the sandbox's vLLM unit
# `User=` this uid (vLLM itself is not started as it); its files are planted with this owner.
VLLM_UID = 64_321


@contextlib.contextmanager
def vllm_runs_as(sandbox: SandboxHelper, uid: int) -> Iterator[None]:
    """vLLM's unit with `User=uid`, as the package's has `User=kimi-vllm`, until the end."""
    dropin = sandbox.sb.manager.unit_dir / f"{UNIT}.d" / "zz-test-user.conf"
    dropin.write_text(f"[Service]\nUser={uid}\n")
    sandbox.sb.manager.systemctl("daemon-reload")
    try:
        yield
    finally:
        dropin.unlink(missing_ok=True)
        sandbox.sb.manager.systemctl("daemon-reload")


def plant(path: Path, uid: int, data: bytes = b"x") -> Path:
    path.write_bytes(data)
    os.chown(path, uid, uid)
    return path


def test_leftover_shared_memory_of_vllms_user_nobody_uses_is_removed_and_nothing_else(
    sandbox: SandboxHelper,
) -> None:
    shm = sandbox.config.teardown.shm_dir
    leaked = plant(shm / "nccl-leaked", VLLM_UID)
    in_use = plant(shm / "nccl-in-use", VLLM_UID)
    unnamed = plant(shm / "not-ours", VLLM_UID)  # no pattern names it
    roots = plant(shm / "nccl-root", 0)  # a root program's look-alike, made since too
    user = sandbox.spawn(
        [sys.executable, "-c", f"import time; f = open({str(in_use)!r}); time.sleep(600)"]
    )
    wait_until(lambda: openfiles.holds_any(user.pid, [str(in_use)]), 5, "open")
    try:
        with vllm_runs_as(sandbox, VLLM_UID):
            run = teardown(sandbox)
        assert_clean(sandbox, run)
        assert run.report.shm_removed == [str(leaked)]
        assert in_use.exists() and unnamed.exists() and roots.exists()
        assert processes.is_alive(user)
    finally:
        for p in (leaked, in_use, unnamed, roots):
            p.unlink(missing_ok=True)


BIND = "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "


def test_vllms_dead_zmq_sockets_and_dist_files_in_its_tmpdir_are_removed_and_nothing_else(
    sandbox: SandboxHelper,
) -> None:
    tmp = sandbox.config.teardown.tmp_dir
    assert tmp is not None
    dead = tmp / "0d49a536-9d4c-4f01-ad55-3291091f7f92"  # a ZMQ socket whose process is gone
    subprocess.run([sys.executable, "-c", BIND, str(dead)], check=True)
    roots_dead = tmp / "1f2e3d4c-9d4c-4f01-ad55-3291091f7f92"  # a root program's, gone too
    subprocess.run([sys.executable, "-c", BIND, str(roots_dead)], check=True)
    live = tmp / "34903d81-8cd4-4f43-9f89-6453bccef842"  # bound by a live bystander
    binder = sandbox.spawn([sys.executable, "-c", BIND + "time.sleep(600)", str(live)])
    plain = tmp / "6896fa19-2606-4610-a4a2-a58a85db57ce"  # a UUID-named file, not a socket
    plain.write_text("someone's")
    (tmp / "vllm_dist_abc").write_bytes(b"x")
    (tmp / "vllm_dist_held").write_bytes(b"x")
    plant(tmp / "vllm_dist_root", 0)
    holder = sandbox.spawn(
        [sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(600)",
         str(tmp / "vllm_dist_held")]
    )  # fmt: skip
    (tmp / "vllm_dist_link").symlink_to(plain)
    wait_until(lambda: live.exists(), 5, "the live socket")
    wait_until(lambda: openfiles.holds_any(holder.pid, [str(tmp / "vllm_dist_held")]), 5, "open")
    for p in (dead, live, plain, tmp / "vllm_dist_abc", tmp / "vllm_dist_held"):
        os.chown(p, VLLM_UID, VLLM_UID)  # vLLM's user made them
    before = {p.name for p in tmp.iterdir()}
    kept = {live.name, plain.name, "vllm_dist_held", "vllm_dist_link", "vllm_dist_root"}
    try:
        with vllm_runs_as(sandbox, VLLM_UID):
            run = teardown(sandbox)  # vLLM is not running: its sockets from earlier runs go too
        assert_clean(sandbox, run)
        removed = {Path(p).name for p in run.report.shm_removed}
        assert {dead.name, "vllm_dist_abc"} <= removed
        assert not removed & (kept | {roots_dead.name})
        left = {p.name for p in tmp.iterdir()}
        assert left == before - removed and plain.read_text() == "someone's"
        assert processes.is_alive(binder) and processes.is_alive(holder)
        why = {
            Path(d["path"]).name: d["error"] for k, d in run.events if k == "leftover_not_removed"
        }
        assert "owned by uid 0, not vLLM's user" in why[roots_dead.name], why
    finally:
        for name in [*kept, dead.name, roots_dead.name, "vllm_dist_abc"]:
            (tmp / name).unlink(missing_ok=True)


def test_every_signal_is_in_the_history_file_after_the_teardown(sandbox: SandboxHelper) -> None:
    from kimi_supervisor.store import history

    ghost = sandbox.ghost(gpu="1", mib=1_000, title="python")
    run = teardown(sandbox)
    history.append(sandbox.config.state.dir, "teardown", run.report)
    last = history.read(sandbox.config.state.dir, last=1)[0]
    assert last["outcome"] == "clean"
    assert [(k["process"]["pid"], k["signal"]) for k in last["kills"]] == [
        (ghost.pid, "SIGSTOP"),
        (ghost.pid, "SIGKILL"),
    ]


needs_root_to_chown = pytest.mark.skipif(
    os.geteuid() != 0, reason="planting another user's files needs root"
)


@needs_root_to_chown
def test_the_leftovers_step_never_removes_another_users_files_or_a_directory_in_use(
    sandbox: SandboxHelper,
) -> None:
    """Planted as uid 65534 under vLLM's own names, all were deleted once; a root program's
    too, when vLLM ran as root."""
    shm, tmp = sandbox.config.teardown.shm_dir, sandbox.config.teardown.tmp_dir
    assert tmp is not None
    theirs = [shm / "psm_team2cache", shm / "sem.mp-team2", tmp / "vllm_dist_team2"]
    for p in theirs:
        p.write_bytes(b"team2")
    their_dir = shm / "vllm-team2"
    their_dir.mkdir()
    (their_dir / "kv.bin").write_bytes(b"k" * 4096)
    for p in [*theirs, their_dir, their_dir / "kv.bin"]:
        os.chown(p, 65534, 65534)
    roots = [plant(shm / "psm_7c1d00", 0), plant(shm / "sem.mp-cd34", 0)]
    in_use = shm / "vllm-cache"  # vLLM's user's, but a file inside is open and mapped
    in_use.mkdir()
    plant(in_use / "kv.bin", VLLM_UID, b"k" * 4096)
    os.chown(in_use, VLLM_UID, VLLM_UID)
    user = sandbox.spawn(
        [sys.executable, "-c",
         "import mmap, sys, time; f = open(sys.argv[1], 'rb'); "
         "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); print('ready', flush=True); "
         "time.sleep(600)", str(in_use / "kv.bin")],
        wait_ready=True,
    )  # fmt: skip
    ours = [plant(shm / "psm_3f2a9c", VLLM_UID), shm / "vllm-dead"]
    ours[1].mkdir()
    plant(ours[1] / "part", VLLM_UID)
    os.chown(ours[1], VLLM_UID, VLLM_UID)
    mixed = shm / "vllm-mixed"  # vLLM's user's folder with a root file inside
    mixed.mkdir()
    os.chown(mixed, VLLM_UID, VLLM_UID)
    plant(mixed / "root.bin", 0)
    try:
        with vllm_runs_as(sandbox, VLLM_UID):
            run = teardown(sandbox)
        assert_clean(sandbox, run)
        assert sorted(run.report.shm_removed) == sorted(map(str, ours))
        for p in [*theirs, their_dir / "kv.bin", in_use / "kv.bin", *roots, mixed / "root.bin"]:
            assert p.exists(), f"{p} was removed"
        kept = {d["path"]: d["error"] for kind, d in run.events if kind == "leftover_not_removed"}
        assert "uid 65534" in kept[str(shm / "psm_team2cache")]
        assert "owned by uid 0, not vLLM's user" in kept[str(roots[0])]
        assert "root.bin inside it is owned by uid 0" in kept[str(mixed)]
        assert processes.is_alive(user)
    finally:
        for p in [*theirs, *ours, *roots]:
            if p.is_dir():
                shutil.rmtree(p)
            p.unlink(missing_ok=True)
        for d in (their_dir, in_use, mixed):
            shutil.rmtree(d, ignore_errors=True)


def test_with_vllm_run_as_root_the_teardown_keeps_root_programs_files_made_since_its_start(
    sandbox: SandboxHelper,
) -> None:
    """The sandbox's vLLM runs as root (its manager's user): root's files are then every root
    program's, and only what names a PID of vLLM's tree (or what it held) is taken."""
    shm, tmp = sandbox.config.teardown.shm_dir, sandbox.config.teardown.tmp_dir
    assert tmp is not None
    before = set(tmp.iterdir())
    main = sandbox.start_vllm()
    bound = set(tmp.iterdir()) - before  # the ZMQ-like sockets the fake's processes bound
    assert bound and all(p.is_socket() for p in bound), bound
    roots = [plant(shm / "psm_7c1d00", 0), plant(shm / "sem.mp-cd34", 0)]
    roots.append(plant(shm / f"psm_{main}", 0))  # its PID inside a name proves nothing
    cpushm = plant(shm / f"{main}-tp:0-0-cpushm_0", 0)  # the CPU build's, named by its PID
    bystander = sandbox.spawn([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        run = teardown(sandbox)
        assert_clean(sandbox, run)
        # What its tree bound (by /proc/net/unix) or names its PID; nothing else of root's.
        assert sorted(run.report.shm_removed) == sorted(map(str, [cpushm, *bound]))
        kept = {d["path"]: d["error"] for kind, d in run.events if kind == "leftover_not_removed"}
        for p in roots:
            assert p.exists() and "vLLM runs as root" in kept[str(p)], (p, kept)
        assert processes.is_alive(bystander)
    finally:
        for p in [*roots, cpushm]:
            p.unlink(missing_ok=True)


def test_a_leftover_older_than_the_running_vllm_that_names_none_of_its_pids_is_kept(
    sandbox: SandboxHelper,
) -> None:
    shm = sandbox.config.teardown.shm_dir
    before = shm / "psm_older"
    before.write_bytes(b"x")
    time.sleep(0.05)
    sandbox.start_vllm()
    try:
        run = teardown(sandbox)
        assert_clean(sandbox, run)
        assert before.exists() and str(before) not in run.report.shm_removed
    finally:
        before.unlink(missing_ok=True)
