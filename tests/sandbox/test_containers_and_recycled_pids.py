"""Ownership in the sandbox: holders behind a /dev of their own, PIDs that
NVML lists after their process died and that the kernel gives to someone else, and listeners on
vLLM's port that use only another team's GPU.

GPUs 0-2 are managed here; GPU 3 belongs to "another team". Every test plants bystanders, and
`teardown` fails if any process the test started was killed without being the expected one.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kimi_supervisor.model import Evidence, Outcome, Role
from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.clock import SystemClock
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.store import baseline
from kimi_supervisor.teardown.listing import FirstListed
from kimi_supervisor.teardown.strays import port_blockers

from ..conftest import DaemonHelper, SandboxHelper, health, wait_until
from .test_ownership import MANAGED, plant_bystanders, with_release_timeout
from .test_teardown import assert_clean, teardown

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="pinning a PID (ns_last_pid) needs root")


def container_bystanders(sandbox: SandboxHelper) -> dict[str, ProcessRef]:
    """Monitors inside containers: every device file of their own /dev open, nothing mapped."""
    return {
        "nvtop in a container": sandbox.ghost(gpu="all", mib=0, title="nvtop", own_dev=True),
        "exporter in a container": sandbox.ghost(
            gpu="all", mib=0, title="dcgm-proxy", own_dev=True
        ),
    }


def all_alive(refs: dict[str, ProcessRef]) -> list[str]:
    return [name for name, r in refs.items() if not processes.is_alive(r)]


def kill_and_reap(sandbox: SandboxHelper, ref: ProcessRef) -> None:
    """SIGKILL the ghost and wait until its PID is free again (reaped, not a zombie)."""
    processes.send_signal(ref, signal.SIGKILL)
    wait_until(lambda: not os.path.exists(f"/proc/{ref.pid}"), 10, f"PID {ref.pid} to be free")


# -- class 1: a holder behind its own /dev --


def test_a_container_nodes_are_the_hosts_gpus_by_device_number_not_by_inode(
    sandbox: SandboxHelper,
) -> None:
    holder = sandbox.ghost(gpu="0", mib=1_000, title="python", own_dev=True)
    gpu0 = sandbox.gpu.device_path(0)
    # Its /dev is its own: other inodes, so the host's (device, inode) finds nothing ...
    assert openfiles.maps_of(holder.pid, [gpu0]) == set()
    assert openfiles.holds_any(holder.pid, [gpu0]) == set()
    # ... and the driver's view (the node's number) finds GPU 0 in both.
    assert openfiles.maps_of(holder.pid, [gpu0], sandbox.gpu.node_key) == {gpu0}
    assert openfiles.holds_any(holder.pid, [gpu0], sandbox.gpu.node_key) == {gpu0}
    assert sandbox.used()[0] == 1_615


def test_a_holder_behind_its_own_dev_is_killed_on_rung_1_and_every_bystander_lives(
    sandbox: SandboxHelper,
) -> None:
    bystanders = plant_bystanders(sandbox) | container_bystanders(sandbox)
    holder = sandbox.ghost(gpu="0,1", mib=40_000, title="python serve.py", own_dev=True)
    run = teardown(sandbox, MANAGED)
    assert_clean(sandbox, run)
    assert run.killed() == {holder.pid}
    kill = next(k for k in run.report.kills if k.signal == "SIGKILL")
    assert kill.evidence is Evidence.NVML_LISTED
    assert all_alive(bystanders) == []
    assert sandbox.used()[3] == 615 + 9_000, "GPU 3's jobs still hold their memory"


def test_a_forked_helper_behind_its_own_dev_whose_parent_died_is_found_and_only_it_is_killed(
    sandbox: SandboxHelper,
) -> None:
    """The seed's class inside a container: measured on an H200, this ended STUCK with nothing
    killed and the holder called "a monitor"."""
    bystanders = plant_bystanders(sandbox) | container_bystanders(sandbox)
    ghost, helper = sandbox.ghost_tree(
        gpu="0", mib=40_000, title="python", fork_helper="pt_worker", own_dev=True
    )
    processes.send_signal(ghost, signal.SIGKILL)
    wait_until(lambda: not processes.is_alive(ghost), 5, "the ghost to die")
    run = teardown(sandbox, MANAGED, also_gone={ghost.pid})
    assert_clean(sandbox, run)
    assert run.killed() == {helper.pid}
    kill = next(k for k in run.report.kills if k.signal == "SIGKILL")
    assert kill.evidence is Evidence.OPEN_AND_MAPPED and "nvidia0" in kill.reason
    assert all_alive(bystanders) == []


def test_a_monitor_in_a_container_is_named_a_bystander_never_a_holder_in_a_stuck_report(
    sandbox: SandboxHelper,
) -> None:
    monitors = container_bystanders(sandbox)
    sandbox.sb.leak(0, 5_000)  # memory with nobody behind it: STUCK, and who is who
    run = teardown(sandbox, MANAGED, with_release_timeout(sandbox, 0.5))
    assert run.report.outcome is Outcome.STUCK and run.killed() == set()
    roles = {h.process.pid: (h.role, h.seen) for h in run.report.remaining}
    for name, ref in monitors.items():
        role, seen = roles[ref.pid]
        assert role is Role.BYSTANDER and "maps no device file" in seen, name
    assert all_alive(monitors) == []


# -- class 2: a listed PID that now belongs to another process --


@needs_root
@pytest.mark.parametrize(
    ("who", "kw"),
    [
        ("an nvtop-like monitor", {"gpu": "all", "mib": 0, "title": "nvtop"}),
        (
            "another team's job restricted to GPU 3",
            {
                "gpu": "3",
                "mib": 2_000,
                "title": "python train.py",
                "extra_env": {"CUDA_VISIBLE_DEVICES": "3"},
            },
        ),
    ],
)
def test_a_process_that_took_the_dead_creators_listed_pid_is_never_signalled(
    sandbox: SandboxHelper, who: str, kw: dict[str, object]
) -> None:
    bystanders = plant_bystanders(sandbox)
    ghost, helper = sandbox.ghost_tree(gpu="0", mib=30_000, title="python", fork_helper="helper")
    kill_and_reap(sandbox, ghost)
    taker = sandbox.ghost(at_pid=ghost.pid, **kw)
    assert taker.pid == ghost.pid and taker != ghost
    (gpu0,) = sandbox.gpu.sample([0])
    assert [p.pid for p in gpu0.processes] == [ghost.pid], "NVML still lists the dead creator"
    run = teardown(sandbox, MANAGED, also_gone={ghost.pid})
    assert_clean(sandbox, run)
    assert run.killed() == {helper.pid}, who
    assert processes.is_alive(taker), who
    assert all_alive(bystanders) == []


@needs_root
def test_a_cuda_job_that_took_a_listed_pid_after_the_daemon_saw_it_listed_is_never_signalled(
    sandbox: SandboxHelper,
) -> None:
    """A job seeing every GPU maps the managed GPUs' files too: only the start time tells it
    from the creator, against when the daemon first saw the PID listed."""
    ghost, helper = sandbox.ghost_tree(gpu="0", mib=30_000, title="python", fork_helper="helper")
    seen = FirstListed()
    seen.saw((s.index, p.pid) for s in sandbox.gpu.sample(MANAGED) for p in s.processes)
    kill_and_reap(sandbox, ghost)
    job = sandbox.ghost(at_pid=ghost.pid, gpu="3", mib=2_000, title="python eval.py")
    assert openfiles.maps_of(job.pid, [sandbox.gpu.device_path(0)]), "it maps GPU 0's file"
    run = teardown(sandbox, MANAGED, also_gone={ghost.pid}, listed_since=seen.snapshot())
    assert_clean(sandbox, run)
    assert run.killed() == {helper.pid}
    assert processes.is_alive(job)


@needs_root
def test_while_vllm_loads_a_recycled_listed_pid_is_no_intruder_and_a_real_one_is(
    sandbox: SandboxHelper,
) -> None:
    from kimi_supervisor.loop.observer import foreign

    paths = {i: sandbox.gpu.device_path(i) for i in MANAGED}
    ghost, _helper = sandbox.ghost_tree(gpu="1", mib=8_000, title="python", fork_helper="h")
    seen = FirstListed()

    def listed() -> dict[int, list[int]]:
        samples = sandbox.gpu.sample(MANAGED)
        seen.saw((s.index, p.pid) for s in samples for p in s.processes)
        return {s.index: [p.pid for p in s.processes] for s in samples}

    assert [i.pid for i in foreign(listed(), set(), paths, first_listed=seen)] == [ghost.pid]
    kill_and_reap(sandbox, ghost)
    monitor = sandbox.ghost(at_pid=ghost.pid, gpu="all", mib=0, title="nvtop")
    assert foreign(listed(), set(), paths, first_listed=seen) == []
    intruder = sandbox.ghost(gpu="2", mib=1_000, title="python")
    found = foreign(listed(), set(), paths, first_listed=seen)
    assert [(i.pid, i.gpu) for i in found] == [(intruder.pid, 2)]
    assert processes.is_alive(monitor)


# -- class 3: listeners on vLLM's port that use only another team's GPU --

LISTENER = textwrap.dedent("""
    import socket, sys, threading
    from setproctitle import setproctitle
    from kimi_supervisor.sandbox import holder
    setproctitle(sys.argv[1])
    held = holder.hold([3], 3000)
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[2]))); s.listen()
    print("ready", flush=True); threading.Event().wait()
""")


@pytest.mark.parametrize(
    "title",
    ["python serve_team2.py", "VLLM::APIServer vllm serve team2/model --port 8000"],
    ids=["a CUDA job", "another team's vLLM"],
)
def test_a_listener_on_the_wildcard_using_only_an_unmanaged_gpu_is_never_killed(
    sandbox: SandboxHelper, title: str
) -> None:
    bystanders = plant_bystanders(sandbox)
    port = sandbox.config.vllm.port
    listener = sandbox.spawn([sys.executable, "-c", LISTENER, title, str(port)], wait_ready=True)
    assert sandbox.used()[3] == 615 + 9_000 + 3_000
    run = teardown(sandbox, MANAGED, with_release_timeout(sandbox, 0.5))
    assert run.report.outcome is Outcome.STUCK and run.killed() == set()
    assert f"PID {listener.pid}" in run.report.diagnosis and "vllm.port" in run.report.next_action
    assert processes.is_alive(listener) and all_alive(bystanders) == []

    # Before a switch, the same process is named as what blocks it, and nothing is stopped.
    base = baseline.load(sandbox.config.state.dir)
    assert base is not None
    found = port_blockers(
        sandbox.config, sandbox.systemd, simgpu.SimGpu(sandbox.sb.gpu_dir),
        baselines={i: base.devices[i] for i in MANAGED}, clock=SystemClock(),
    )  # fmt: skip
    assert [b.pid for b in found] == [listener.pid]
    assert "uses no managed GPU" in found[0].what and "GPU(s) 3" in found[0].what


def test_a_plain_listener_blocks_a_switch_and_a_listener_holding_a_managed_gpu_does_not(
    sandbox: SandboxHelper,
) -> None:
    base = baseline.load(sandbox.config.state.dir)
    assert base is not None
    baselines = {i: base.devices[i] for i in MANAGED}
    port = sandbox.config.vllm.port
    code = LISTENER.replace("holder.hold([3], 3000)", "holder.hold([0], 3000)")
    holder = sandbox.spawn([sys.executable, "-c", code, "python", str(port)], wait_ready=True)
    gpu = simgpu.SimGpu(sandbox.sb.gpu_dir)
    try:
        blockers = functools.partial(
            port_blockers, sandbox.config, sandbox.systemd, gpu, baselines=baselines,
            clock=SystemClock(),
        )  # fmt: skip
        assert blockers() == [], "a holder of GPU 0 is the teardown's to kill"
        processes.send_signal(holder, signal.SIGKILL)
        wait_until(lambda: not processes.is_alive(holder), 5, "the holder to die")
        plain = sandbox.spawn(
            [
                sys.executable,
                "-c",
                LISTENER.replace("holder.hold([3], 3000)", "None"),
                "srv",
                str(port),
            ],
            wait_ready=True,
        )
        found = blockers()
        assert [(b.pid, b.what) for b in found] == [(plain.pid, "uses no GPU")]
        assert f"PID {plain.pid} (srv)" in found[0].describe(port)
    finally:
        gpu.close()


def test_a_switch_is_refused_before_anything_stops_while_a_stranger_holds_vllms_port(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """The daemon's teardowns never stop it (it uses no managed GPU), so a switch could only end
    with no vLLM at all: kimi-mode says who holds the port and what to do, and exits 1."""
    port = sandbox.config.vllm.port
    plain = LISTENER.replace("holder.hold([3], 3000)", "None")
    squatter = sandbox.spawn([sys.executable, "-c", plain, "team2-api", str(port)], wait_ready=True)
    daemon.start()  # READY after boot; its own teardown spares the squatter (STUCK)

    def refused() -> subprocess.CompletedProcess[str]:
        # Between its retries of the teardown (stuck_retry_s, doubling), the daemon is STUCK.
        daemon.wait_state("stuck")
        return daemon.kimi_mode("profile")

    r = refused()
    for _ in range(3):  # a retry began in between: the switch was "busy", not judged
        if "in progress" not in r.stderr:
            break
        r = refused()
    assert r.returncode == 5, r.stderr  # refused: nothing was asked of the host
    assert f"PID {squatter.pid} (team2-api)" in r.stderr and "uses no GPU" in r.stderr
    assert "vllm.port" in r.stderr and "nothing was stopped" in r.stderr
    assert daemon.status()["desired_mode"] == "production"
    assert processes.is_alive(squatter)


def test_a_vllm_started_by_hand_outside_the_unit_is_killed_api_server_and_workers(
    sandbox: SandboxHelper,
) -> None:
    """The seed's own way of running vLLM: its API server holds the port and no GPU, its
    workers hold the GPUs. The server is the workers' ancestor: vLLM's tree, so a stray."""
    v = sandbox.config.vllm
    api = sandbox.spawn([*v.command, "--port", str(v.port)])
    wait_until(lambda: health(v.health_url) == 200, 30, "the hand-started vLLM to serve")
    # Every GPU is managed here: monitors are the bystanders.
    bystanders = {
        "nvtop": sandbox.ghost(gpu="all", mib=0, title="nvtop"),
        "persistenced": sandbox.ghost(gpu="all", mib=0, title="nvidia-persistenced"),
    } | container_bystanders(sandbox)
    run = teardown(sandbox)
    assert_clean(sandbox, run)
    assert api.pid in run.killed()
    kill = next(k for k in run.report.kills if k.process.pid == api.pid and k.signal == "SIGKILL")
    assert kill.evidence is Evidence.LISTENS_ON_PORT and "ancestor" in kill.reason
    assert all_alive(bystanders) == []
