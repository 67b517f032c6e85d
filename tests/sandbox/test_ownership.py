"""Who really holds a managed GPU, in the sandbox: the simulated driver owns memory by
open file as the real one does, and the teardown kills on rung 1 or 2 evidence only. Every test
plants bystanders beside the culprit, and `teardown` fails if any of them was killed.

GPUs 0-2 are managed here; GPU 3 belongs to "another team"."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from kimi_supervisor.config import Config
from kimi_supervisor.model import Evidence, Outcome, Role, Step
from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.teardown.ownership import DeviceUse, GpuFiles, judge
from kimi_supervisor.teardown.scan import Protection, bind_conflicts

from ..conftest import SandboxHelper, wait_until
from .test_teardown import Run, assert_clean, teardown

MANAGED = [0, 1, 2]


# -- pure decisions: the ladder and the port rule, as tables --

F = GpuFiles({0: "/dev/nvidia0", 1: "/dev/nvidia1"}, {2: "/dev/nvidia2"})
ALL = frozenset({"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidiactl"})


@pytest.mark.parametrize(
    ("case", "use", "listed_on", "protected", "role", "evidence"),
    [
        (
            "listed alive on a managed GPU",
            DeviceUse(1, ALL, ALL),
            {0},
            None,
            Role.SUSPECT,
            Evidence.NVML_LISTED,
        ),
        (
            "listed, but protected: suspect, never killed",
            DeviceUse(1, ALL, ALL),
            {0},
            "protected process name 'nv-hostengine'",
            Role.SUSPECT,
            Evidence.NVML_LISTED,
        ),
        (
            "forked helper: open and mapped, listed nowhere",
            DeviceUse(1, ALL, ALL),
            set(),
            None,
            Role.SUSPECT,
            Evidence.OPEN_AND_MAPPED,
        ),
        (
            "NVML client: everything open, nothing mapped",
            DeviceUse(1, ALL),
            set(),
            None,
            Role.BYSTANDER,
            None,
        ),
        (
            "job on the unmanaged GPU, listed there",
            DeviceUse(1, ALL, ALL),
            {2},
            None,
            Role.CANDIDATE,
            None,
        ),
        (
            "job on the unmanaged GPU with only it visible",
            DeviceUse(1, ALL, frozenset({"/dev/nvidia2", "/dev/nvidiactl"})),
            set(),
            None,
            Role.BYSTANDER,
            None,
        ),
        (
            "helper that closed its descriptors: mapped only (holds nothing, measured)",
            DeviceUse(1, frozenset(), ALL),
            set(),
            None,
            Role.BYSTANDER,
            None,
        ),
        (
            "maps could not be read: unknown, never a monitor",
            DeviceUse(1, ALL, maps_unreadable=True),
            set(),
            None,
            Role.UNKNOWN,
            None,
        ),
        (
            "persistenced: protected, open only",
            DeviceUse(1, ALL),
            set(),
            "protected process name 'nvidia-persistenced'",
            Role.BYSTANDER,
            None,
        ),
        (
            "CUDA started, no context yet: control file mapped only",
            DeviceUse(1, ALL, frozenset({"/dev/nvidiactl"})),
            set(),
            None,
            Role.CANDIDATE,
            None,
        ),
    ],
)
def test_the_evidence_ladder_judges_each_kind_of_process(
    case: str,
    use: DeviceUse,
    listed_on: set[int],
    protected: str | None,
    role: Role,
    evidence: Evidence | None,
) -> None:
    v = judge(use, F, listed_on, unexplained={0}, protected=protected)
    assert (v.role, v.evidence) == (role, evidence), case
    assert v.kill == (evidence is not None and protected is None), case


def test_an_open_and_mapped_process_is_no_suspect_where_a_live_listed_process_explains_it() -> None:
    v = judge(DeviceUse(1, ALL, ALL), F, set(), unexplained=set())
    assert v.role is Role.CANDIDATE and not v.kill


@pytest.mark.parametrize(
    ("vllm_host", "listener", "conflicts"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("127.0.0.1", "0.0.0.0", True),
        ("127.0.0.1", "::", True),
        ("127.0.0.1", "127.0.0.2", False),
        ("0.0.0.0", "127.0.0.2", True),
        ("::", "10.1.2.3", True),
        ("localhost", "127.0.0.1", True),
        ("localhost", "10.1.2.3", False),
        ("10.1.2.3", "10.1.2.4", False),
    ],
)
def test_a_listener_counts_only_where_vllm_binds(
    vllm_host: str, listener: str, conflicts: bool
) -> None:
    import ipaddress

    assert bind_conflicts(vllm_host, ipaddress.ip_address(listener)) is conflicts


def test_listening_sockets_read_through_netlink_match_proc_net_tcp() -> None:
    """The same listeners, addresses and owners either way (sock_diag, else /proc/net/tcp*),
    judged on the sockets this test made: another process may listen on the same port at
    another address meanwhile (a port is free per address)."""
    import socket as so

    from kimi_supervisor.ports import sockets

    with so.socket() as v4, so.socket(so.AF_INET6) as v6:
        v4.bind(("127.0.0.2", 0))
        port = v4.getsockname()[1]
        v4.listen()
        ours = {os.fstat(v4.fileno()).st_ino: "127.0.0.2"}
        try:  # where the host has IPv6 loopback
            v6.setsockopt(so.IPPROTO_IPV6, so.IPV6_V6ONLY, 1)
            v6.bind(("::1", port))
            v6.listen()
            ours[os.fstat(v6.fileno()).st_ino] = "::1"
        except OSError:
            pass
        netlink = {i: s for i, s in sockets.listening(port).items() if i in ours}
        proc = {i: s for i, s in sockets._from_proc(port).items() if i in ours}
        assert {i: str(s.address) for i, s in netlink.items()} == ours
        assert {s.uid for s in netlink.values()} == {os.getuid()}
        assert netlink == proc


# -- the sandbox: real processes on the simulated driver --


def plant_bystanders(sandbox: SandboxHelper) -> dict[str, ProcessRef]:
    """What a shared host runs beside vLLM: monitors, the driver's daemons, another team's jobs
    on GPU 3 (one with only GPU 3 visible, one seeing every GPU as CUDA does by default)."""
    return {
        "nvtop": sandbox.ghost(gpu="all", mib=0, title="nvtop"),
        "exporter": sandbox.ghost(gpu="all", mib=0, title="gpu-exporter"),
        "nvidia-smi -l 1": sandbox.ghost(gpu="all", mib=0, title="nvidia-smi"),
        "persistenced": sandbox.ghost(gpu="all", mib=0, title="nvidia-persistenced"),
        "job on GPU 3": sandbox.ghost(
            gpu="3", mib=6_000, title="python train.py", extra_env={"CUDA_VISIBLE_DEVICES": "3"}
        ),
        "job on GPU 3, all visible": sandbox.ghost(gpu="3", mib=3_000, title="python eval.py"),
    }


def with_release_timeout(sandbox: SandboxHelper, seconds: float) -> Config:
    """The sandbox's config with a short wait for memory that will not come back."""
    t = sandbox.config.teardown.model_copy(update={"release_timeout_s": seconds})
    return sandbox.config.model_copy(update={"teardown": t})


def spared_events(run: Run) -> list[int]:
    return [data["pid"] for kind, data in run.events if kind == "spared"]


def test_a_forked_helper_holding_a_dead_processs_memory_is_found_and_only_it_is_killed(
    sandbox: SandboxHelper,
) -> None:
    """Case 1, the seed's ghost: NVML lists the dead creator; the helper is listed nowhere."""
    bystanders = plant_bystanders(sandbox)
    ghost, helper = sandbox.ghost_tree(gpu="0", mib=40_000, title="python", fork_helper="helper")
    processes.send_signal(ghost, signal.SIGKILL)
    wait_until(lambda: not processes.is_alive(ghost), 5, "the ghost to die")
    (gpu0,) = sandbox.gpu.sample([0])
    assert gpu0.used_mib == 40_615 and [p.pid for p in gpu0.processes] == [ghost.pid]

    run = teardown(sandbox, MANAGED, also_gone={ghost.pid})
    assert_clean(sandbox, run)
    assert run.killed() == {helper.pid}
    kill = next(k for k in run.report.kills if k.signal == "SIGKILL")
    assert kill.evidence is Evidence.OPEN_AND_MAPPED and "nvidia0" in kill.reason
    assert all(processes.is_alive(r) for r in bystanders.values())
    assert sandbox.used()[3] == 615 + 9_000, "GPU 3's jobs still hold their memory"


def test_a_helper_that_closed_its_descriptors_holds_nothing_and_is_left_alone(
    sandbox: SandboxHelper,
) -> None:
    ghost, helper = sandbox.ghost_tree(
        gpu="1", mib=20_000, fork_helper="helper", helper_closes_fds=True
    )
    processes.send_signal(ghost, signal.SIGKILL)
    wait_until(lambda: sandbox.used()[1] == 615, 5, "memory to follow the closed file back")
    assert openfiles.maps_any(helper.pid, str(sandbox.sb.gpu_dir / "dev" / "nvidia1"))
    run = teardown(sandbox, MANAGED, also_gone={ghost.pid})
    assert_clean(sandbox, run)
    assert run.killed() == set()


def test_a_driver_leak_among_monitors_ends_stuck_in_time_naming_candidates_and_killing_nobody(
    sandbox: SandboxHelper,
) -> None:
    bystanders = plant_bystanders(sandbox)
    # A bystander: it maps GPU 0's device file but holds no descriptor of it (holds nothing).
    ghost, mapper = sandbox.ghost_tree(
        gpu="0", mib=1_000, fork_helper="mapper", helper_closes_fds=True
    )
    processes.send_signal(ghost, signal.SIGKILL)
    wait_until(lambda: sandbox.used()[0] == 615, 5, "the ghost's memory to return")
    sandbox.sb.leak(0, 5_000)
    config = with_release_timeout(sandbox, 1.0)
    # The leak never goes: the teardown's return, STUCK, is its deadlines holding.
    run = teardown(sandbox, MANAGED, config, also_gone={ghost.pid})
    assert run.report.outcome is Outcome.STUCK
    assert run.killed() == set()
    roles = {h.process.pid: h.role for h in run.report.remaining}
    assert roles[mapper.pid] is Role.BYSTANDER
    for name in ("nvtop", "exporter", "nvidia-smi -l 1", "persistenced"):
        assert roles[bystanders[name].pid] is Role.BYSTANDER, name
    assert "no process behind it" in run.report.next_action
    holder = next(h for h in run.report.remaining if h.process.pid == mapper.pid)
    assert "no descriptor" in holder.seen and "holds no memory" in holder.seen
    assert processes.is_alive(mapper) and all(processes.is_alive(r) for r in bystanders.values())


def test_only_protected_holders_end_stuck_with_one_spared_record_each_and_no_busy_wait(
    sandbox: SandboxHelper,
) -> None:
    fm = sandbox.ghost(gpu="0", mib=2_000, title="nvidia-fabricmanager")  # comm: nvidia-fabricma
    dcgm = sandbox.ghost(gpu="1", mib=2_000, title="nv-hostengine")
    config = with_release_timeout(sandbox, 0.5)
    t0 = time.process_time()
    run = teardown(sandbox, MANAGED, config)
    cpu_s = time.process_time() - t0
    assert run.report.outcome is Outcome.STUCK and run.killed() == set()
    assert sorted(spared_events(run)) == sorted([fm.pid, dcgm.pid])
    assert cpu_s < 1.0, f"the holder step busy-waited ({cpu_s:.2f} s of CPU)"
    suspects = {h.process.pid: h for h in run.report.remaining if h.role is Role.SUSPECT}
    assert set(suspects) == {fm.pid, dcgm.pid}
    assert "not signalled" in suspects[fm.pid].why
    assert "by hand" in run.report.next_action
    # In an operator's words: the step does not say "no holder" for two it spared;
    # a built-in name is called built-in, and no advice points at a config that does not hold
    # it; why it was spared is said once, not again as the check.
    holders = [s for s in run.report.steps if s.step is Step.KILL_GPU_HOLDERS][-1]
    assert holders.note.startswith("holder PID ") and "protected, not signalled" in holders.note
    assert "built-in protected name 'nv-hostengine'" in suspects[dcgm.pid].why
    assert "protected_names" not in run.report.next_action
    assert all(h.check == "" for h in suspects.values())


def test_memory_only_a_spared_live_holder_keeps_ends_stuck_at_once_instead_of_waiting_for_it(
    sandbox: SandboxHelper,
) -> None:
    # The release can never come: the only holder is alive and protected. Waiting the whole
    # release_timeout_s (60 s shipped) would only delay the STUCK report.
    fm = sandbox.ghost(gpu="1", mib=20_000, title="nvidia-fabricmanager")
    config = with_release_timeout(sandbox, 300.0)
    run = teardown(sandbox, MANAGED, config)
    assert run.report.outcome is Outcome.STUCK and run.killed() == set()
    assert spared_events(run) == [fm.pid]
    # The wait for the release ended on what it saw, not at its timeout (300 s, far off).
    wait = next(s for s in run.report.steps if s.step is Step.WAIT_RELEASE)
    assert str(fm.pid) in wait.note and "no release can come" in wait.note
    assert wait.duration_s < 300, f"the release was waited out ({wait.duration_s:.0f} s)"
    assert processes.is_alive(fm)


def test_a_process_exec_d_under_the_fabric_managers_real_name_is_never_killed(
    sandbox: SandboxHelper,
) -> None:
    # `exec -a` gives argv[0] without a title; comm stays the interpreter's.
    code = (
        "from kimi_supervisor.sandbox import ghost; "
        "ghost.main(['--gpu', '2', '--mib', '500', '--title', ''])"
    )
    ref = sandbox.spawn(
        ["bash", "-c", f'exec -a nv-fabricmanager {sys.executable} -c "{code}"'],
        # argv[0] no longer leads Python to the virtualenv: name its path outright.
        env={"PYTHONPATH": os.pathsep.join(sys.path)},
        wait_ready=True,
    )
    assert processes.cmdline_of(ref.pid)[0] == "nv-fabricmanager"
    protection = Protection.from_config([], [])
    assert "nv-fabricmanager" in (protection.why_protected(ref.pid) or "")
    config = with_release_timeout(sandbox, 0.5)
    run = teardown(sandbox, MANAGED, config)
    assert run.killed() == set() and spared_events(run) == [ref.pid]


def _listener(host: str, port: int) -> str:
    return textwrap.dedent(f"""
        import socket, time
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(({host!r}, {port})); s.listen(); print("ready", flush=True); time.sleep(600)
    """)


def _spawn_listener(sandbox: SandboxHelper, host: str) -> ProcessRef:
    code = _listener(host, sandbox.config.vllm.port)
    return sandbox.spawn([sys.executable, "-c", code], wait_ready=True)


def test_a_listener_on_vllms_port_at_another_address_is_not_killed(
    sandbox: SandboxHelper,
) -> None:
    assert sandbox.config.vllm.host == "127.0.0.1"
    other = _spawn_listener(sandbox, "127.0.0.2")
    sandbox.start_vllm()
    run = teardown(sandbox, MANAGED)
    assert_clean(sandbox, run)
    assert other.pid not in run.killed()


def test_a_listener_where_vllm_binds_that_is_not_vllm_and_uses_no_gpu_is_named_not_killed(
    sandbox: SandboxHelper,
) -> None:
    squatter = _spawn_listener(sandbox, "127.0.0.1")
    run = teardown(sandbox, MANAGED)
    assert run.report.outcome is Outcome.STUCK and run.killed() == set()
    assert f"PID {squatter.pid}" in run.report.diagnosis
    assert "vllm.port" in run.report.next_action


def test_a_respawner_whose_child_needs_seconds_to_take_the_gpu_is_caught_with_its_child(
    sandbox: SandboxHelper,
) -> None:
    """Case 3: the new child takes the GPU well after the old one died, as a CUDA start does."""
    respawner = textwrap.dedent("""
        import subprocess, sys, time
        from setproctitle import setproctitle
        setproctitle("python")
        while True:
            subprocess.run([sys.executable, "-c",
                            "import time; time.sleep(1.0);"
                            " from kimi_supervisor.sandbox import ghost;"
                            " ghost.main(['--gpu', '0', '--mib', '10000', '--title', 'python'])"],
                           stdout=subprocess.DEVNULL)
    """)
    parent = sandbox.spawn([sys.executable, "-c", respawner])
    bystanders = plant_bystanders(sandbox)
    wait_until(lambda: sandbox.used()[0] > 10_000, 15, "the first child on GPU 0")
    run = teardown(sandbox, MANAGED)
    assert_clean(sandbox, run)
    assert parent.pid in run.killed()
    by_evidence = {k.evidence for k in run.report.kills if k.signal == "SIGKILL"}
    assert {Evidence.NVML_LISTED, Evidence.RESPAWNS} <= by_evidence
    assert len(run.killed()) == 3, "the first child, its replacement and the parent"
    assert any(kind == "respawn_watch" for kind, _ in run.events)
    time.sleep(2.0)  # longer than a child needs to come back, had anything survived
    assert sandbox.used()[0] == 615
    assert all(processes.is_alive(r) for r in bystanders.values())


def test_the_holder_step_says_what_it_killed_on_which_rung(sandbox: SandboxHelper) -> None:
    listed = sandbox.ghost(gpu="0", mib=1_000, title="python")
    _ghost, helper = sandbox.ghost_tree(gpu="1", mib=1_000, fork_helper="helper")
    processes.send_signal(_ghost, signal.SIGKILL)
    wait_until(lambda: not processes.is_alive(_ghost), 5, "the ghost to die")
    run = teardown(sandbox, MANAGED, also_gone={_ghost.pid})
    assert_clean(sandbox, run)
    assert run.killed() == {listed.pid, helper.pid}
    note = next(s.note for s in run.report.steps if s.step is Step.KILL_GPU_HOLDERS)
    assert "1 NVML-listed" in note and "1 open-and-mapped" in note


def test_a_reader_that_looks_long_after_the_holder_died_sees_the_memory_already_back(
    sandbox: SandboxHelper,
) -> None:
    from kimi_supervisor.sandbox import simgpu

    ghost = sandbox.ghost(gpu="2", mib=3_000)
    assert sandbox.used()[2] == 3_615
    processes.send_signal(ghost, signal.SIGKILL)
    wait_until(lambda: not processes.is_alive(ghost), 5, "the ghost to die")
    time.sleep(simgpu.DRIVER_RELEASE_S * 2)  # nobody looks meanwhile
    assert sandbox.used()[2] == 615


def test_the_incident_vllm_stopped_and_a_helper_left_is_cleared_without_waiting_out_a_grace(
    sandbox: SandboxHelper,
) -> None:
    """vLLM's workers die in stop_unit and their memory drains; the helper's memory, charged to a
    PID that was dead before the teardown began, drains nothing and is acted on at once."""
    from kimi_supervisor.teardown.gpuview import DRIVER_RELEASE_GRACE_S

    sandbox.start_vllm()
    ghost, helper = sandbox.ghost_tree(gpu="0,1", mib=30_000, title="python3 train.py",
                                       fork_helper="pt_data_worker")  # fmt: skip
    processes.send_signal(ghost, signal.SIGKILL)
    wait_until(lambda: not processes.is_alive(ghost), 5, "the ghost to die")
    run = teardown(sandbox, also_gone={ghost.pid})
    assert_clean(sandbox, run)
    assert run.killed() == {helper.pid}
    holders = next(s for s in run.report.steps if s.step is Step.KILL_GPU_HOLDERS)
    assert holders.duration_s < DRIVER_RELEASE_GRACE_S
