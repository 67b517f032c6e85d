"""The liveness rule's table (decide/liveness.py), walked reading by reading at the shipped
values (a reading every 15 s, stall_s 120, hang_bound_s 600, a canary every 300 s with 60 s to
answer, 5 % of a core): each row a case an operator meets, its verdict and the signals that
decide it. The GPUs' counters are the simulated host's (sandbox/simreader.COUNTERS), which copy
the measurement on the GPU host."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest

from kimi_supervisor.decide.liveness import Cpu, Hang, Judge, Work, foreign_on
from kimi_supervisor.loop.liveness import engine_cpu
from kimi_supervisor.model import GpuActivity, ProcessTimes
from kimi_supervisor.ports import processes
from kimi_supervisor.sandbox.simreader import COUNTERS

INTERVAL, STALL, BOUND, CANARY, CANARY_TIMEOUT = 15, 120.0, 600.0, 300, 60.0
FROZEN = "PID 9 (VLLM::Worker_TP0, state T)"


def gpu(state: str, **changed: object) -> tuple[GpuActivity, ...]:
    """Two GPUs reading as the simulated host reads `state` ("idle", "spin", "work")."""
    return tuple(GpuActivity(i, **{**COUNTERS[state], **changed}) for i in range(2))  # type: ignore[arg-type]


def gpus(*states: str, **changed: object) -> tuple[GpuActivity, ...]:
    """A GPU per state, in order; "unread": its memory utilization could not be read."""
    unread = {**COUNTERS["spin"], "util_memory": None, "unread": ("utilization: timed out",)}
    return tuple(
        GpuActivity(i, **(unread if s == "unread" else {**COUNTERS[s], **changed}))  # type: ignore[arg-type]
        for i, s in enumerate(states)
    )


def shared(reading: tuple[GpuActivity, ...], index: int, pid: int) -> tuple[GpuActivity, ...]:
    """`reading` with GPU `index` shared with `pid`, a process not vLLM's (NVML lists it, as the
    probe finds: loop/liveness.Liveness._gpus)."""
    return tuple(
        dataclasses.replace(g, pids=(102, pid), foreign=(pid,)) if g.index == index else g
        for g in reading
    )


def sampled(reading: tuple[GpuActivity, ...], sm: float, mem: float) -> tuple[GpuActivity, ...]:
    """`reading` with NVML's per-process samples of vLLM's processes reading `sm` % busy and
    `mem` % memory (as the probe finds them: decide/liveness.foreign_on)."""
    return tuple(dataclasses.replace(g, samples=((102, sm, mem),), own=(sm, mem)) for g in reading)


# vLLM's processes as /proc shows them at a time: PID -> (parent, comm, CPU seconds with the
# reaped children's, the reaped children's alone). MainPID is MAIN; its comm is not read. Every
# process of it is in the unit's cgroup, whoever its parent is.
Tree = dict[int, tuple[int, str, float, float]]
MAIN = 100
UNIT = "vllm-kimi-k25.service"


def read_tree(tree: Tree, at: float) -> Cpu:
    """The engine's CPU as the probe reads it (loop/liveness.engine_cpu) from `tree`."""

    def times_of(pid: int) -> ProcessTimes | None:
        if pid not in tree:
            return None
        ppid, _comm, cpu_s, reaped_s = tree[pid]
        return ProcessTimes(pid, pid * 7, ppid, "R", cpu_s, reaped_s)

    def descendants(root: int) -> list[int]:
        out, todo = [], [root]
        while todo:
            kids = sorted(p for p, row in tree.items() if row[0] == todo[0])
            out, todo = out + kids, todo[1:] + kids
        return out

    with (
        mock.patch.object(processes, "times_of", times_of),
        mock.patch.object(processes, "comm_of", lambda pid: tree[pid][1] if pid in tree else ""),
        mock.patch.object(processes, "descendants", descendants),
        mock.patch.object(processes, "unit_pids", lambda pid, unit, limit: (sorted(tree), False)),
    ):
        cpu = engine_cpu(MAIN, engine_only=True, unit=UNIT)
    assert cpu is not None
    return dataclasses.replace(cpu, at=at)


@dataclass(frozen=True)
class Case:
    """What vLLM does, as functions of the time (seconds): the pending requests (None: no
    vllm:* series), the tokens made so far, the engine's CPU seconds so far, a stopped process
    (from `stopped_at`), its helpers' CPU seconds so far, the GPUs' counters (a reading, or
    why none, or None: not read), whether a canary sent then is answered (None: none sent,
    work ran), whether a capture is under way."""

    pending: Callable[[float], float | None]
    tokens: Callable[[float], float]
    cpu_s: Callable[[float], float]
    gpus: Callable[[float], tuple[GpuActivity, ...] | str | None]
    helpers_s: Callable[[float], float] = lambda t: 0.0
    stopped_at: float | None = None
    answered: Callable[[float], bool | None] = lambda t: None
    capturing: Callable[[float], bool] = lambda t: False
    bystander: bool = False  # a helper of the tree, stopped, its CPU flat
    until: float = 1500.0
    # vLLM's processes as /proc shows them (then `cpu_s` and `helpers_s` are not used)
    tree: Callable[[float], Tree] | None = None


def walk(case: Case) -> tuple[float | None, Hang | None, str]:
    """The readings of `case` every INTERVAL, with a canary every CANARY s while nothing is
    pending (its reading comes apart, as the probe's canary thread sends it): when the first
    verdict came, the verdict, and the doubt standing at the end (or at the verdict)."""
    judge = Judge(STALL, 0.05, BOUND)
    next_canary: float = CANARY
    t = 0.0
    while t <= case.until:
        stopped = case.stopped_at is not None and t >= case.stopped_at
        helpers: tuple[tuple[int, str, float], ...] = ((77, "cc1plus", case.helpers_s(t)),)
        if case.bystander:
            helpers += ((78, "resource_tracke", 0.5),)

        def cpu(at: float, stopped: bool = stopped, helpers: tuple = helpers) -> Cpu:  # type: ignore[type-arg]
            if case.tree is not None:
                return read_tree(case.tree(at), at)
            frozen_cpu = case.cpu_s(case.stopped_at or 0.0)
            return Cpu(at, case.cpu_s(at), 3, (FROZEN,) if stopped else (),
                       (frozen_cpu,) if stopped else (), helpers)  # fmt: skip

        pending = case.pending(t)
        work = None if pending is None else Work(pending, case.tokens(t), steps=case.tokens(t))
        metrics = "ok" if work is not None else "absent"
        if case.capturing(t):
            hang = judge.capturing(t, cpu(t), case.gpus(t), work=work)
        else:
            hang = judge.seen(t, work, metrics, cpu=cpu(t), gpu=case.gpus(t))
            idle = pending is None or pending <= 0
            if hang is None and idle and t >= next_canary:
                answered = case.answered(t)
                if answered is not None:  # sent CANARY_TIMEOUT ago, or answered at once
                    took = 0.2 if answered else CANARY_TIMEOUT
                    sent = cpu(t - took)
                    hang = judge.seen(t, None, metrics, cpu=cpu(t), canary=(answered, took, sent))
                    next_canary = t + CANARY
        if hang is not None:
            return t, hang, judge.doubt
        t += INTERVAL
    return None, None, judge.doubt


def load_then(stop_at: float) -> Callable[[float], float]:
    """Tokens made every reading until `stop_at`, none after."""
    return lambda t: 10 * min(t, stop_at)


SPIN = 1.0  # a core spinning: a CPU second a second


def engine(t: float, worker: tuple[float, float], **more: tuple[int, str, float, float]) -> Tree:
    """MainPID, an engine core spinning and a worker of (CPU, reaped children's CPU) at `t`,
    and `more` processes (named p<PID>)."""
    tree: Tree = {MAIN: (1, "", 0.05 * t, 0.0), 101: (MAIN, "VLLM::EngineCor", SPIN * t, 0.0),
                  102: (101, "VLLM::Worker_TP", *worker)}  # fmt: skip
    return tree | {int(k[1:]): v for k, v in more.items()}


def waiting(t: float, **more: tuple[int, str, float, float]) -> Tree:
    """MainPID, an engine core and a worker that wait (on a compile: ninja's, nvcc's, sccache's
    client), and `more` processes."""
    tree: Tree = {MAIN: (1, "", 0.01 * t, 0.0), 101: (MAIN, "VLLM::EngineCor", 0.01 * t, 0.0),
                  102: (101, "VLLM::Worker_TP", 0.01 * t, 0.0)}  # fmt: skip
    return tree | {int(k[1:]): v for k, v in more.items()}


def ray_in_unit(
    t: float, worker: tuple[float, float], **more: tuple[int, str, float, float]
) -> Tree:
    """vLLM run with `--distributed-executor-backend ray` from a wrapper that first ran `ray start
    --head` in the unit (its raylet double forked: parent PID 1, cgroup the unit's): MainPID (the
    API server) and its engine core, waiting on the Ray workers (raylet's children, out of the
    tree) that hold the GPUs; a worker's (CPU, reaped children's CPU) at `t`, and `more`."""
    tree: Tree = {MAIN: (1, "", 0.05 * t, 0.0), 101: (MAIN, "VLLM::EngineCor", 0.01 * t, 0.0),
                  300: (1, "raylet", 0.02 * t, 0.0), 301: (300, "ray::RayWorkerW", *worker),
                  302: (300, "ray::RayWorkerW", *worker)}  # fmt: skip
    return tree | {int(k[1:]): v for k, v in more.items()}


def listing(tree: Tree, at: float, state: str, own: tuple[float, float]) -> tuple[GpuActivity, ...]:
    """Two GPUs reading `state`, each listing one Ray worker (301, 302) whose NVML samples read
    `own` (kernel %, memory %), judged with the PIDs the probe reads as vLLM's (loop/liveness.
    Liveness._probe: MainPID, the Cpu's tree and the unit's processes apart from it)."""
    cpu = read_tree(tree, at)
    ours = {MAIN, *(t.pid for t in cpu.tree)}
    return tuple(
        foreign_on(
            GpuActivity(i, **COUNTERS[state], pids=(pid,), samples=((pid, *own),)),  # type: ignore[arg-type]
            ours,
            set(cpu.apart),
        )
        for i, pid in enumerate((301, 302))
    )


def on_gpus(
    tree: Tree, at: float, state: str, rows: dict[int, tuple[float, float]]
) -> tuple[GpuActivity, ...]:
    """Two GPUs reading `state`, each listing the processes of `rows` and NVML's samples of
    them (PID -> kernel %, memory %), judged with the PIDs the probe reads as vLLM's
    (loop/liveness.Liveness._probe: MainPID, the Cpu's tree and its `apart`)."""
    cpu = read_tree(tree, at)
    ours = {MAIN, *(t.pid for t in cpu.tree)}
    samples = tuple((pid, sm, mem) for pid, (sm, mem) in rows.items())
    return tuple(
        foreign_on(
            GpuActivity(i, **COUNTERS[state], pids=tuple(rows), samples=samples),
            ours,  # type: ignore[arg-type]
            set(cpu.apart),
        )
        for i in range(2)
    )


def ray_spinning(t: float, **more: tuple[int, str, float, float]) -> Tree:
    """vLLM on Ray in the unit, a collective stuck: the engine core and both Ray workers spin."""
    return ray_in_unit(t, (SPIN * t, 0.0), **more) | {101: (MAIN, "VLLM::EngineCor", SPIN * t, 0.0)}


def ray_crowded(t: float, worker: tuple[float, float]) -> Tree:
    """vLLM on Ray in the unit with 260 idle Ray workers (`ray::IDLE`, PIDs 310-569) listed
    before vLLM's Ray workers (600, 601) in the unit's cgroup.procs."""
    tree: Tree = {MAIN: (1, "", 0.05 * t, 0.0), 101: (MAIN, "VLLM::EngineCor", 0.01 * t, 0.0),
                  300: (1, "raylet", 0.02 * t, 0.0), 600: (300, "ray::RayWorkerW", *worker),
                  601: (300, "ray::RayWorkerW", *worker)}  # fmt: skip
    return tree | {310 + i: (300, "ray::IDLE", 0.0, 0.0) for i in range(260)}


IDLE_RAY = {f"p{2000 + i}": (300, "ray::IDLE", 0.0, 0.0) for i in range(260)}


# fmt: off
CASES = {
    # case: (its readings, when the verdict comes (None: never), what it or the doubt says)
    "a collective stuck on the GPU under load, its host thread spinning, is hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin" if t > 60 else "work")),
        # from the reading before the last step (45 s): within the bound and a reading of it
        (645, 660), "with no sign of real work: vLLM's helpers and ended children used 0.00 s of "
        "CPU in 120 s; GPU 0: busy 100 %, memory 0 %, 118.5 W, PCIe 59.4 MB/s"),
    "the same stuck collective while idle is hung at the bound from its first unanswered canary": (
        Case(pending=lambda t: 0, tokens=lambda t: 5, cpu_s=lambda t: SPIN * max(t - 100, 0),
             gpus=lambda t: gpu("spin" if t > 100 else "idle"), answered=lambda t: t < 100),
        (840, 855), "a one-token request sent 600 s ago got no answer; the engine busy for 600 s"),
    "a jit compile child using a core for 12 minutes is a doubt, never a hang": (
        Case(pending=lambda t: 1, tokens=lambda t: 5 + 10 * max(t - 720, 0),
             cpu_s=lambda t: SPIN * t, helpers_s=lambda t: SPIN * min(t, 720),
             gpus=lambda t: gpu("idle" if t < 720 else "work"), until=700),
        None, "past liveness.hang_bound_s, but vLLM's helpers and ended children used 120.0 s of "
        "CPU in 120 s (PID 77 (cc1plus))"),
    "a compile that ended, the engine then spinning with no step, is hung at the bound": (
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: SPIN * t,
             helpers_s=lambda t: SPIN * min(t, 300), gpus=lambda t: gpu("spin")),
        (600, 615), "no sign of real work"),
    "a prefill longer than the bound, moving memory on the GPU, is a doubt, never a hang": (
        Case(pending=lambda t: 1, tokens=lambda t: 5 + 10 * max(t - 700, 0),
             cpu_s=lambda t: 0.9 * t, gpus=lambda t: gpu("work"), until=690),
        None, "past liveness.hang_bound_s, but the GPU works (GPU 0: busy 88 %, memory 80 %"),
    "a capture's flush longer than the bound, the engine busy and the GPUs idle, is no verdict": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("idle" if t > 60 else "work"), capturing=lambda t: t > 60),
        None, ""),
    "stats off and saturated, the canary waiting behind the load, is a doubt, never a hang": (
        Case(pending=lambda t: None, tokens=lambda t: 0, cpu_s=lambda t: 1.5 * t,
             gpus=lambda t: gpu("work"), answered=lambda t: False),
        None, "past liveness.hang_bound_s, but the GPU works"),
    "a frozen engine under load is hung a stall time after it stopped": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.9 * min(t, 60),
             gpus=lambda t: gpu("idle" if t > 60 else "work"), stopped_at=60),
        (180, 195), f"and no engine step, prompt or generated token for 120 s; the engine: "
        f"stopped: {FROZEN}"),
    "a stopped bystander beside a long prefill is no verdict": (
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.9 * t,
             gpus=lambda t: gpu("work"), bystander=True, until=900),
        None, "but the GPU works"),
    "a spinning hang whose GPU counters cannot be read is a doubt: no reading is never idle": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: "NVML: the call timed out after 10 s"),
        None, "but the GPUs' counters could not be read (NVML: the call timed out after 10 s)"),
    "a spinning hang on a GPU that cannot say its memory utilization is a doubt": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin", util_memory=None, unread=("utilization: not supported",))),
        None, "could not be read (GPU 0: busy 100 %, memory unread"),
    "a spinning hang with no GPU port at all is a doubt": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: None),
        None, "but the GPUs' counters were not read with this reading"),
    "a busy gpu with no memory traffic but NVLink traffic (an all-reduce at work) is a doubt": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin", nvlink_kib=1e6 * t)),
        None, "but the GPU works (GPU 0: busy 100 %, memory 0 %, 118.5 W, PCIe 59.4 MB/s, "
        "NVLink 1.024e+06 MB/s)"),
    "nvlink bursts of another user's job that ended before each reading, vLLM's own samples "
    "spinning, are hung at the bound": (
        # NVML lists a process, and samples it, only while it lives: the job's traffic is in the
        # GPU's counters and nowhere else; vLLM's own samples show its kernel moving no memory
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: sampled(gpu("spin", nvlink_kib=1e6 * t, util_memory=35.0), 100, 0)
             if t > 60 else sampled(gpu("work"), 88, 80)),
        (645, 660), "NVLink 1.024e+06 MB/s; vLLM's: busy 100 %, memory 0 %"),
    "a long step whose own samples move memory is a doubt, whatever the gpu's counters": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: sampled(gpu("spin"), 99, 34), until=900),
        None, "but the GPU works (GPU 0: busy 100 %, memory 0 %, 118.5 W, PCIe 59.4 MB/s; "
        "vLLM's: busy 99 %, memory 34 %)"),
    "a pcie-bound copy at near the idle power past the bound is a doubt: its pcie is work": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin", util_memory=2.0, power_w=134.5, pcie_mb_s=63_900.0)),
        None, "but the GPU works (GPU 0: busy 100 %, memory 2 %, 134.5 W, PCIe 63900 MB/s)"),
    "an engine busy on its CPU alone past the bound, the GPUs idle, is hung": (
        Case(pending=lambda t: 2, tokens=lambda t: 5, cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("idle")),
        (600, 615), "GPU 0: busy 0 %, memory 0 %, 124.2 W"),
    "a spinning thread in an engine that steps is never hung": (
        Case(pending=lambda t: 4, tokens=lambda t: 10 * t, cpu_s=lambda t: 1.9 * t,
             gpus=lambda t: gpu("work")),
        None, ""),
    "a collective stuck on the GPU during a capture is hung at the bound, not the flush's": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin" if t >= 75 else "work"), capturing=lambda t: t > 60),
        (675, 690), "a capture is under way, and the GPUs read have shown a kernel that spins"),
    "a worker frozen during a capture's flush is hung a stall time after it stopped": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * min(t, 90),
             gpus=lambda t: gpu("idle"), capturing=lambda t: t > 60, stopped_at=90),
        (210, 225), f"a capture is under way, and the engine: stopped: {FROZEN}"),
    "a jit compile as compiler runs that end between readings, spawned by a worker, is a doubt": (
        # Triton's ptxas per kernel: each run reaped into the worker's cutime and cstime
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (t, 0.8 * t)), gpus=lambda t: gpu("idle"), until=700),
        None, "past liveness.hang_bound_s, but vLLM's helpers and ended children used 96.0 s of "
        "CPU in 120 s (children that ended, reaped by PID 102: 96.0 s)"),
    "a jit compile in a fork of a worker that keeps its title is a doubt, never a hang": (
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (0.01 * t, 0.0), p104=(102, "VLLM::Worker_TP", SPIN * t, 0)),
             gpus=lambda t: gpu("idle"), until=700),
        None, "used 120.0 s of CPU in 120 s (PID 104 (VLLM::Worker_TP))"),
    "a worker spinning in its synchronize reaps no child's time: hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (SPIN * t, 0.0)), gpus=lambda t: gpu("spin")),
        (645, 660), "with no sign of real work: vLLM's helpers and ended children used 0.00 s"),
    "a long-lived helper ending during a spinning hang, its old time reaped, is no sign of work": (
        # the resource tracker's 300 s of a day's life land in MainPID's reaped time at once
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (SPIN * t, 0.0), p105=(MAIN, "python3", 300.0, 0.0))
             if t < 600 else engine(t, (SPIN * t, 0.0)) | {MAIN: (1, "", 300.0, 300.0)},
             gpus=lambda t: gpu("spin")),
        (645, 660), "with no sign of real work: vLLM's helpers and ended children used 0.00 s"),
    "an engine busy on its CPU alone right after a long capture is bounded from the capture": (
        # a doubt before the capture (a prefill at work) does not shorten the bound after it
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("work") if t < 1000 else gpu("idle"),
             capturing=lambda t: 200 <= t < 1000, until=2000),
        (1590, 1605), "the engine busy for 600 s"),
    "one NVML reading in eight failing on a spinning hang is hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: "NVML: timed out" if int(t // 15) % 8 == 0 else gpu("spin")),
        (645, 675), "GPU 0: busy 100 %, memory 0 %, 118.5 W, PCIe 59.4 MB/s"),
    "a spinning hang whose GPUs were read in fewer than half the readings is a doubt": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin") if int(t // 15) % 3 == 0 else "NVML: timed out",
             until=1485),
        None, "but GPU 0's counters were read in 3 of the 9 readings of the last 120 s"),
    "a spinning hang whose NVML stopped answering before the bound is a doubt, never idle": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin") if t <= 600 else "NVML: timed out", until=900),
        None, "but the GPUs' counters could not be read (NVML: timed out)"),
    "a spinning hang whose NVLink counter was reset is hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin", nvlink_kib=5e5 if t < 600 else 0.0)),
        (645, 660), "NVLink 0 MB/s"),
    "a collective stuck during a capture, a rank that never arrived idle, is hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpus("spin", "idle") if t >= 75 else gpu("work"),
             capturing=lambda t: t > 60),
        (675, 690), "a capture is under way, and the GPUs read have shown a kernel that spins"),
    "a collective stuck during a capture, some GPU readings failing, is hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("work") if t < 75 else "NVML: timed out" if int(t // 15) % 8 == 0
             else gpus("unread", "idle") if int(t // 15) % 4 == 1 else gpus("spin", "idle"),
             capturing=lambda t: t > 60),
        (675, 705), "read in 26 of 41 readings"),
    "a capture's flush whose GPUs spin in fewer than half the readings is no verdict": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin") if int(t // 15) % 3 == 0 else "NVML: timed out",
             capturing=lambda t: t > 60, until=1800),
        None, ""),
    "a compile beside a rank spinning in its collective, then a capture, is no verdict": (
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: SPIN * t,
             helpers_s=lambda t: SPIN * t, gpus=lambda t: gpus("spin", "idle"),
             capturing=lambda t: t >= 705, until=1500),
        None, ""),
    "a tree of more processes than are read is a doubt: a helper may be among those left out": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             gpus=lambda t: gpu("spin"), until=1200,
             tree=lambda t: engine(t, (SPIN * t, 0.0), **{f"p{1000 + i}": (102, "pt_main_threa",
                                                                           0.0, 0.0)
                                                          for i in range(300)})),
        None, "vLLM has more processes than a reading takes"),
    "another user's kernel beside an idle GPU during a capture's flush is no verdict": (
        # any user may open the device nodes (0666): its spin is not vLLM's rank in a collective
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: shared(gpus("spin", "idle"), 0, 4242) if t > 60 else gpu("work"),
             capturing=lambda t: t > 60, until=1800),
        None, ""),
    "another user's copies on a GPU of a spinning hang hold no doubt: hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: shared(gpus("work", "spin"), 0, 4242) if t > 60 else gpu("work")),
        (645, 660), "GPU 0: busy 88 %, memory 80 %, 421.4 W, PCIe 198.7 MB/s, shared with PID "
        "4242 (not vLLM's: not judged); GPU 1: busy 100 %, memory 0 %"),
    "a spinning hang on GPUs all shared with another namespace's process is hung on its cpu": (
        # a process in another PID namespace reads PID 0: not vLLM's either
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: shared(shared(gpu("work"), 0, 0), 1, 0)),
        (645, 660), "no sign of real work: vLLM's helpers and ended children used 0.00 s of CPU "
        "in 120 s; GPU 0: busy 88 %, memory 80 %, 421.4 W, PCIe 198.7 MB/s, shared with PID 0"),
    "a jit compile on GPUs all shared with another user's process is a doubt, never a hang": (
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: SPIN * t,
             helpers_s=lambda t: SPIN * t, gpus=lambda t: shared(shared(gpu("idle"), 0, 1), 1, 1),
             until=900),
        None, "but vLLM's helpers and ended children used 120.0 s of CPU in 120 s"),
    "a compile in a server out of vLLM's tree but in its unit's cgroup is a doubt, never a hang": (
        # sccache's server, double forked: its parent is PID 1, its cgroup the unit's; the
        # worker and its compile's client (sccache's, under ninja) wait on it, their CPU flat
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: waiting(t, p103=(102, "sccache", 0.5, 0.0),
                                    p300=(1, "sccache", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle"), until=900),
        None, "used 120.0 s of CPU in 120 s (PID 300 (sccache))"),
    "compiles that end under a server in the unit's cgroup, out of the tree, are a doubt": (
        # its compiler runs reaped into the server's own children's time
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: waiting(t, p103=(102, "ninja", 0.5, 0.0),
                                    p300=(1, "sccache", t, 0.9 * t)),
             gpus=lambda t: gpu("idle"), until=900),
        None, "children that ended, reaped by PID 300: 108.0 s"),
    "a deadlock beside a busy process of the unit's cgroup out of the tree is hung at stall_s": (
        # a sidecar, or a double fork of vLLM's user: with no compile's client under the
        # engine, what it does is not the engine's work
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: waiting(t, p300=(1, "python3", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle"), until=900),
        (180, 195), "and no engine step, prompt or generated token for 120 s"),
    "a spinning hang beside a busy sidecar out of the tree is hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (SPIN * t, 0.0), p300=(1, "python3", SPIN * t, 0.5 * t)),
             gpus=lambda t: gpu("spin")),
        (645, 660), "with no sign of real work: vLLM's helpers and ended children used 0.00 s"),
    "an engine orphaned out of the tree, spinning in the unit's cgroup, is no helper: hung": (
        # its parent gone, reparented to PID 1: vLLM's role, not a compiler's
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (SPIN * t, 0.0), p300=(1, "VLLM::EngineCor", SPIN * t, 0)),
             gpus=lambda t: gpu("spin")),
        (645, 660), "with no sign of real work: vLLM's helpers and ended children used 0.00 s"),
    "GPUs busy with no traffic during a capture while the engine steps is no verdict": (
        Case(pending=lambda t: 4, tokens=lambda t: 10 * t, cpu_s=lambda t: SPIN * t,
             gpus=lambda t: gpu("spin"), capturing=lambda t: t > 60, until=1800),
        None, ""),
    "a deadlock beside a busy sidecar and an idle child of a worker is hung at stall_s": (
        # the idle child (a plugin's watchdog, a resource tracker of the engine's) makes the
        # sidecar no compiler
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: waiting(t, p103=(102, "python3", 0.3, 0.0),
                                    p300=(1, "python3", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle")),
        (180, 195), "and no engine step, prompt or generated token for 120 s"),
    "a spinning hang beside a busy sidecar and an idle child of a worker is hung at the bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (SPIN * t, 0.0), p103=(102, "python3", 0.3, 0.0),
                                   p300=(1, "python3", SPIN * t, 0.5 * t)),
             gpus=lambda t: gpu("spin")),
        (645, 660), "with no sign of real work"),
    "a process of the unit titled as a compiler out of the tree is a doubt: vllm's user's own": (
        # as a spinning child it starts under a worker: the rule cannot tell it from sccache's
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: waiting(t, p300=(1, "ninja", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle"), until=900),
        None, "(PID 300 (ninja))"),
    "a jit compile in a ray worker of the unit, out of the tree, is a doubt, never a hang": (
        # `ray start --head` in the unit, then `vllm serve --distributed-executor-backend ray`:
        # ninja and cc1plus under a Ray worker, the engine core waiting, flat
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: ray_in_unit(t, (0.01 * t, 0.0), p303=(301, "ninja", 0.5, 0.0),
                                        p304=(303, "cc1plus", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle"), until=700),
        None, "(PID 304 (cc1plus)"),
    "a prefill past the bound in ray workers of the unit, their samples at work, is a doubt": (
        # the Ray workers are vLLM's: the GPUs they hold are not another's
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: ray_in_unit(t, (SPIN * t, 0.0)) | {101: (MAIN, "VLLM::EngineCor",
                                                                      SPIN * t, 0.0)},
             gpus=lambda t: listing(ray_in_unit(t, (SPIN * t, 0.0)), t, "work", (88.0, 80.0)),
             until=900),
        None, "but the GPU works"),
    "a deadlock of ray workers in the unit, idle, is hung at stall_s": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: ray_in_unit(t, (0.9 * min(t, 60), 0.0)),
             gpus=lambda t: gpu("idle")),
        (180, 195), "and no engine step"),
    "a prefill past the bound whose own samples move memory, beside another's idle context, is "
    "a doubt": (
        # any local user can open a context on each GPU (the nodes are 0666): vLLM's own
        # samples still tell its work
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.9 * t,
             gpus=lambda t: shared(shared(sampled(gpu("work"), 88, 80), 0, 4242), 1, 4242),
             until=900),
        None, "shared with PID 4242 (judged on vLLM's own samples)"),
    "a spinning hang beside another's idle context, its own samples spinning, is hung at the "
    "bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: shared(shared(sampled(gpu("spin", util_memory=40.0), 100, 0), 0,
                                          4242), 1, 4242)),
        (645, 660), "vLLM's: busy 100 %, memory 0 %, shared with PID 4242"),
    "a pcie-bound copy whose own samples read memory 2 %, as measured, is a doubt": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: sampled(gpu("spin", util_memory=2.0, power_w=134.5,
                                        pcie_mb_s=63_900.0), 99, 2), until=900),
        None, "but the GPU works"),
    "nvlink bursts of an ended job while no process of vLLM is sampled are a doubt": (
        # NVML took no sample (NOT_FOUND): the GPU's counters judge, as where it cannot sample
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: tuple(dataclasses.replace(g, samples=()) for g in
                                  gpu("spin", nvlink_kib=1e6 * t)), until=900),
        None, "but the GPU works"),
    "a spinning hang beside a pid 0 sample moving memory is hung at the bound": (
        # another namespace's process reads PID 0: never vLLM's
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: SPIN * t,
             gpus=lambda t: tuple(foreign_on(dataclasses.replace(g, samples=((0, 50.0, 90.0),
                                  (102, 100.0, 0.0))), {MAIN, 101, 102})
                                  for g in gpu("spin", util_memory=40.0))),
        (645, 660), "vLLM's: busy 100 %, memory 0 %"),
    # vLLM on Ray inside its unit, and sidecars of it
    "a ray worker's compile pool spawned as python (pt_main_thread) out of the tree is a doubt": (
        # torch inductor's compile workers, a multiprocessing spawn pool: a fresh interpreter,
        # comm `pt_main_thread` once torch is imported (or `python3`); the Ray worker and the
        # engine core wait on it, flat: the Ray worker's descendant is the engine's, as in the
        # tree (next row)
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: ray_in_unit(t, (0.01 * t, 0.0),
                                        p305=(301, "pt_main_thread", SPIN * t, 0.0),
                                        p306=(305, "pt_main_thread", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle"), until=700),
        None, "(PID 30"),
    "the same compile pool under a worker in the tree is a doubt": (
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: waiting(t, p105=(102, "pt_main_thread", SPIN * t, 0.0),
                                    p106=(105, "pt_main_thread", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle"), until=700),
        None, "but the engine's processes are busy"),
    "a ray worker's compile pool titled python3, the worker polling it, is a doubt past the "
    "bound": (
        # the Ray worker polls the pool, busy: a doubt; the pool (its descendant) is a helper
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: ray_in_unit(t, (SPIN * t, 0.0), p305=(301, "python3", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle"), until=900),
        None, "(PID 305 (python3))"),
    "a ray worker titled as vllm's worker (out of the tree) in a long prefill is a doubt": (
        # a worker under raylet titled `VLLM::Worker_TP0` (vLLM's own set_process_title, or an
        # engine reparented): an engine's process, its CPU in the engine's sum
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: {MAIN: (1, "", 0.05 * t, 0.0),
                             101: (MAIN, "VLLM::EngineCor", 0.01 * t, 0.0),
                             300: (1, "raylet", 0.02 * t, 0.0),
                             301: (300, "VLLM::Worker_TP", SPIN * t, 0.0),
                             302: (300, "VLLM::Worker_TP", SPIN * t, 0.0)},
             gpus=lambda t: on_gpus({MAIN: (1, "", 0, 0), 101: (MAIN, "VLLM::EngineCor", 0, 0),
                                     301: (1, "VLLM::Worker_TP", 0, 0)}, t, "work",
                                    {301: (88.0, 80.0)}),
             until=900),
        None, "but the GPU works"),
    "a compile under a ray worker through a compiler not in COMPILERS is a doubt": (
        # gcc's LTO back end (lto1), lld/gold/mold linking, nvcc's cudafe++: a helper under a
        # worker in the tree, and under a Ray worker (its descendant) alike
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: ray_in_unit(t, (0.01 * t, 0.0), p303=(301, "ninja", 0.5, 0.0),
                                        p304=(303, "ld.lld", SPIN * t, 0.0)),
             gpus=lambda t: gpu("idle"), until=700),
        None, "(PID 304 (ld.lld))"),
    "a long prefill of ray workers read after 260 idle ray workers of the unit is a doubt": (
        # Ray's idle workers (`ray::IDLE`) are not read, nor count towards MAX_PROCESSES
        Case(pending=lambda t: 1, tokens=lambda t: 5, cpu_s=lambda t: 0.0,
             tree=lambda t: ray_crowded(t, (SPIN * t, 0.0)),
             gpus=lambda t: gpu("work"), until=900),
        None, "but the GPU works"),
    # a real hang beside the unit's other processes
    "a spinning hang beside a sidecar of the unit moving memory on vllm's gpus is hung at the "
    "bound": (
        # a sidecar (Cpu.apart) is vLLM's, not another's, but neither its CPU nor its NVML
        # samples are the engine's work (another model, a Ray actor of the unit)
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (SPIN * t, 0.0), p300=(1, "python3", 0.2 * t, 0.0)),
             gpus=lambda t: on_gpus(engine(t, (SPIN * t, 0.0), p300=(1, "python3", 0.2 * t, 0.0)),
                                    t, "spin", {102: (100.0, 0.0), 300: (30.0, 60.0)})
             if t > 60 else gpu("work"), until=1200),
        (645, 660), "with no sign of real work"),
    "a spinning hang with ray in the unit on a big host (260 idle ray workers) is hung at the "
    "bound": (
        # Ray keeps up to num_cpus idle workers (`ray::IDLE`) under raylet, in the unit's
        # cgroup: not read, they cut no reading
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: ray_spinning(t, **IDLE_RAY),
             gpus=lambda t: gpu("spin") if t > 60 else gpu("work"), until=1200),
        (645, 660), "with no sign of real work"),
    "a spinning hang beside a local user's ray task moving memory on vllm's gpus is hung at the "
    "bound": (
        # the same task, untitled (`ray::IDLE`'s leased worker, `ray::f`), with a CUDA context
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: ray_spinning(t, p310=(300, "ray::f", 0.2 * t, 0.0)),
             gpus=lambda t: on_gpus(ray_spinning(t, p310=(300, "ray::f", 0.2 * t, 0.0)), t,
                                    "spin", {301: (100.0, 0.0), 310: (40.0, 70.0)})
             if t > 60 else gpu("work"), until=1200),
        (645, 660), "with no sign of real work"),
    "comms with odd bytes in the unit's cgroup beside a spinning hang are read: hung at the "
    "bound": (
        Case(pending=lambda t: 4, tokens=load_then(60), cpu_s=lambda t: 0.0,
             tree=lambda t: engine(t, (SPIN * t, 0.0), p300=(1, "ray::\ufffd\ufffd)\\x1b", 0, 0),
                                   p301=(1, "::", 0.0, 0.0), p302=(1, "", 0.0, 0.0),
                                   p303=(1, "ray::RayWorker\ufffd", 0.0, 0.0)),
             gpus=lambda t: gpu("spin") if t > 60 else gpu("work")),
        (645, 660), "with no sign of real work"),
}
# fmt: on


@pytest.mark.parametrize(("case", "verdict_at", "said"), CASES.values(), ids=list(CASES))
def test_liveness_gives_each_case_its_verdict_for_the_signals_that_decide_it(
    case: Case, verdict_at: tuple[float, float] | None, said: str
) -> None:
    at, hang, doubt = walk(case)
    if verdict_at is None:
        assert hang is None, (at, hang)
        assert said in doubt, doubt
        return
    assert hang is not None, f"no verdict; the doubt: {doubt}"
    assert at is not None and verdict_at[0] <= at <= verdict_at[1], (at, hang.reason)
    assert said in hang.reason, hang.reason


def test_a_helper_pid_reused_by_the_next_compile_counts_whole_not_less_the_old_ones_cpu() -> None:
    """An outside review: helpers were known by their PID alone, so a compile in a recycled
    PID had the old one's CPU taken from its own (115 s of real compile hidden)."""
    from kimi_supervisor.decide.liveness import helpers_used

    old = ProcessTimes(77, 1000, 102, "R", 118.0, 0.0)
    new = ProcessTimes(77, 5000, 102, "R", 119.0, 0.0)
    base = Cpu(0.0, 10.0, 3, helpers=((77, "cc1plus", 118.0),), tree=(old,))
    now = Cpu(120.0, 20.0, 3, helpers=((77, "cc1plus", 119.0),), tree=(new,))
    assert helpers_used(base, now) == (119.0, "PID 77 (cc1plus)")
    same = Cpu(120.0, 20.0, 3, helpers=((77, "cc1plus", 119.0),), tree=(old,))
    assert helpers_used(base, same) == (1.0, "PID 77 (cc1plus)")


def test_a_frozen_ray_worker_of_the_unit_is_named_stopped_as_a_worker_in_the_tree_is() -> None:
    """A worker in the tree in state T is "stopped" (a hang at stall_s whatever the engine core
    does); so is a Ray worker of the unit (raylet's child): with the engine core polling it,
    the hang would otherwise wait for the bound (600 s, not 120 s)."""
    tree = ray_in_unit(100.0, (50.0, 0.0))

    def times_of(pid: int) -> ProcessTimes | None:
        if pid not in tree:
            return None
        ppid, _comm, cpu_s, reaped_s = tree[pid]
        return ProcessTimes(pid, pid * 7, ppid, "T" if pid in (301, 302) else "R", cpu_s, reaped_s)

    def descendants(root: int) -> list[int]:
        return [p for p, row in tree.items() if row[0] == root]

    with (
        mock.patch.object(processes, "times_of", times_of),
        mock.patch.object(processes, "comm_of", lambda pid: tree[pid][1] if pid in tree else ""),
        mock.patch.object(processes, "descendants", descendants),
        mock.patch.object(processes, "unit_pids", lambda pid, unit, limit: (sorted(tree), False)),
    ):
        cpu = engine_cpu(MAIN, engine_only=True, unit="vllm-kimi-k25.service")
    assert cpu is not None
    assert any("301" in s for s in cpu.stopped), cpu.stopped
