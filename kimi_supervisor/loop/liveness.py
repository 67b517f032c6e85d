"""Liveness while vLLM serves (decide/liveness.py judges): on a thread of its own, every
`liveness.metrics_interval_s`, vLLM's /metrics, the CPU time and state of its processes (MainPID
and its descendants, from /proc, and the rest of its unit's cgroup) and the managed GPUs' own
counters and processes (NVML, through the GPU port); and, when the metrics say nothing runs
or waits (or there are no metrics), a one-token canary every `canary_interval_s`, on a thread
of its own, the readings going on beside it. A hung vLLM may take `canary_timeout_s` not to
answer: the probe never holds the loop; each reading comes back through the inbox
(LivenessSeen) and the loop judges it. No canary while a
capture is under way (it would be in the traces), and then only what no flush does is a
verdict (a process stopped on the serving path, a spinning kernel): the capture has its own
deadline for a flush that works.

A canary that gets an answer, even an error (the model's name refused, HTTP 400), is not a hang:
it is shown as a warning. Only no answer within the timeout counts, and only with the engine's
processes showing no progress too.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

from kimi_supervisor.config import Config
from kimi_supervisor.decide.liveness import (
    MAX_METRICS_BYTES,
    Cpu,
    Hang,
    Judge,
    Work,
    foreign_on,
    gpu_said,
    parse,
)
from kimi_supervisor.model import GpuActivity, ProcessTimes, title
from kimi_supervisor.ports import processes, stacks
from kimi_supervisor.ports.gpu import GpuPort, reading_error
from kimi_supervisor.ports.http import request

# vLLM's tree is an API server, an engine core and a worker per GPU: more is not read.
MAX_PROCESSES = 256
# The unit's cgroup is listed and its processes' names read up to this many: Ray keeps an idle
# worker per CPU (`ray::IDLE`) under raylet, which are not read (they do nothing), nor count
# towards MAX_PROCESSES (on a host of 256 CPUs and more they would cut every reading).
MAX_LISTED = 4096
RAY_IDLE = "ray::IDLE"
# A hang's evidence (`Liveness.kept`): the stacks of this many of vLLM's processes (parents
# first: MainPID, its engine, the workers), read for at most EVIDENCE_S in all; the newest
# /metrics answer, at most KEPT_METRICS_BYTES (vLLM's is 60-100 KB).
STACK_PROCESSES = 32
EVIDENCE_S = 15.0
KEPT_METRICS_BYTES = 256 << 10


@dataclass(frozen=True)
class Canary:
    answered: bool  # the server said something (an HTTP error is an answer)
    ok: bool  # and it was a completion
    took_s: float
    detail: str
    tokens: int = 0  # prompt and completion, as vLLM counted them (its answer's `usage`)
    cpu: Cpu | None = None  # the engine's processes when it was sent
    # The CPU seconds vLLM's other processes (its API servers) used while it waited: a canary
    # waits behind an API server busy tokenizing a long prompt as much as behind a busy engine
    # (decide/liveness.API_BUSY_FRACTION). None where it could not be read.
    others_s: float | None = None


@dataclass(frozen=True)
class Reading:
    pid: int
    work: Work | None
    canary: Canary | None
    metrics: str = "ok"  # "ok", "absent" (answered, no vllm:* series), "unreachable"
    cpu: Cpu | None = None
    # When /metrics answered (time.monotonic()), before any canary: the time of `work`.
    metrics_at: float = 0.0
    # The managed GPUs' own counters with this reading, or why there are none (None: not read,
    # as in a canary's reading).
    gpu: tuple[GpuActivity, ...] | str | None = None
    # What explains a hang, read once the verdict was given and before it is handed on (the
    # incident bundle's: vLLM's stacks, the GPUs, the last /metrics); None in other readings.
    kept: dict[str, str] | None = None
    kind: str = "probe"  # "probe", "canary" (its own thread's), "evidence" (`kept`)


# vLLM's processes by role, as it titles them (`set_process_title`: "PREFIX::Role[_suffix]",
# PREFIX from VLLM_PROCESS_NAME_PREFIX, "VLLM" by default; vLLM 0.16's vllm/utils/
# system_utils.py). setproctitle sets the comm as well, which the kernel cuts to 15 characters
# ("VLLM::EngineCor") and which /proc gives without the process's mmap lock, unlike its
# cmdline: a role is read from the comm alone.
# The engine's work: the engine core and one worker per tensor-parallel rank (the API servers
# only take requests in).
ENGINE_ROLES = ("EngineCore", "Worker")
# vLLM's workers under Ray (`--distributed-executor-backend ray`): Ray's actors, titled
# `ray::RayWorkerWrapper`, children of Ray's raylet, out of MainPID's tree (in the unit's
# cgroup where the unit started Ray).
RAY_WORKER = "RayWorkerWrapper"
# A process of vLLM's unit's cgroup out of its tree named so is a compile's: a compiler's
# server (sccache's, double forked), a compile under a Ray worker (ninja, nvcc, cc1plus).
COMPILERS = frozenset({
    "sccache", "ccache", "distcc", "icecc", "ninja", "make", "cmake", "nvcc", "cicc", "ptxas",
    "fatbinary", "nvlink", "cc1", "cc1plus", "cc", "c++", "gcc", "g++", "clang", "clang++",
    "collect2", "ld", "as",
})  # fmt: skip
# The processes that serve: a stopped one stops the serving (MainPID counts as well).
SERVING_ROLES = (*ENGINE_ROLES, "APIServer", "DPCoordinator")
COMM_CHARS = 15  # TASK_COMM_LEN less its NUL


def role_of(comm: str, roles: tuple[str, ...]) -> bool:
    """True if `comm` (a process's, maybe cut to COMM_CHARS) is one of vLLM's `roles`, whatever
    its prefix."""
    _, sep, role = comm.partition("::")
    if not sep or not role:
        return False
    cut = len(comm) >= COMM_CHARS  # the role may be cut short: "EngineCor"
    return any(role.startswith(r) or (cut and r.startswith(role)) for r in roles)


def engine_cpu(pid: int, engine_only: bool = False, *, unit: str = "") -> Cpu | None:
    """vLLM's processes (MainPID and its descendants): their CPU time summed (with each one's
    reaped children's: processes.times_of), and those stopped. None when MainPID is gone. With
    `engine_only` (the stall rule's second signal), the sum counts only the engine's processes
    (ENGINE_ROLES, and their descendants), where there are any: an API server busy taking
    requests in, tokenizing them, answering /health polls, uses the CPU while the engine it
    feeds is deadlocked (the real tier's deadlock went unseen under a /health poll every
    50 ms).

    A stopped process (state T, t or D) counts only on the serving path: MainPID, the
    processes of SERVING_ROLES and the engine's descendants. Any other of the tree (the
    multiprocessing resource tracker, a helper stuck on a hung mount, one a debugger holds)
    stops no request: a stopped resource tracker beside a busy engine was called a hang, 3 of 3
    (an outside review). Its CPU still counts in the whole tree's sum. Where no process of the
    tree has an engine's role (vLLM without setproctitle, or a prefix too long for the comm to
    keep the role), every stopped process counts, as the tree cannot be told apart.

    Its helpers (`Cpu.helpers`) are the descendants of none of vLLM's roles (SERVING_ROLES), with
    their own CPU time: a JIT compiler (ninja, nvcc, cc) is real work that no engine step shows.
    So is a fork of an engine's process that keeps its title (a compile pool in fork mode, a
    multiprocessing child): its comm is its parent's, and no role of vLLM's is its parent's own
    (vLLM titles each role's process apart: a worker's parent is an engine core). Where no
    process has a role, every descendant is one: the bound on a doubt then waits for the whole
    tree's CPU to fall, never calling a busy unnamed tree hung. Each process's times
    (`Cpu.tree`) show what its children that ended used (a compiler run per kernel, spawned
    straight from a worker, ends between two readings).

    With `unit` (the unit's name), the processes of its cgroup (v2: MainPID's, from the unit's
    folder down) that the parent links do not reach are read too, all of them vLLM's for the
    GPUs: a Ray worker of vLLM's (RAY_WORKER, raylet's child where the unit started Ray) is an
    engine's process, its CPU in the engine's sum; one named as a compiler (COMPILERS: an
    sccache server, double forked; ninja and nvcc under a Ray worker) is a helper, its CPU in
    the engine's sum as a compiler's under a worker (without it, a compile through sccache was a
    stall with the CPU flat); any other (a sidecar, Ray's raylet) is `Cpu.apart`: no sign of
    the engine's work (a spinning sidecar held a deadlock as a doubt for ever), unless no
    process has a role, when the whole tree's sum takes it. vLLM's user can title a process as
    a compiler, as it can start one under a worker: at worst a doubt. They are never "stopped":
    they serve nothing. Without cgroup v2, or MainPID outside the unit's folder, the tree alone
    is read.

    Roles are read from each process's comm; the cmdline (which takes the process's mmap lock,
    held for as long as a fault on a hung mount lasts) is never read."""
    main = processes.times_of(pid)
    if main is None:
        return None
    # Parents before their children (descendants' order): an engine's own children (a JIT
    # compiler it waits on: FlashInfer's first call compiles for minutes) are the engine's work.
    everyone = processes.descendants(pid)
    pids = [pid, *everyone[: MAX_PROCESSES - 1]]
    engine: set[int] = set()
    seconds, engine_s, engine_n = 0.0, 0.0, 0
    tree: list[ProcessTimes] = []
    comms: dict[int, str] = {}
    stuck: list[tuple[int, str, float, bool]] = []  # pid, state, CPU, on the serving path
    helpers: list[tuple[int, str, float]] = []  # of none of vLLM's roles: a JIT compiler
    for p in pids:
        got = main if p == pid else processes.times_of(p)
        if got is None:
            continue
        tree.append(got)
        seconds += got.cpu_s
        comm = comms[p] = processes.comm_of(p) if p != pid else ""
        if role_of(comm, ENGINE_ROLES) or (engine and got.ppid in engine):
            engine.add(p)
            engine_n += 1
            engine_s += got.cpu_s
        forked = comms.get(got.ppid) == comm and role_of(comm, ENGINE_ROLES)
        if p != pid and (forked or not role_of(comm, SERVING_ROLES)):
            helpers.append((p, comm, got.cpu_s))
        if got.state in ("T", "t", "D"):  # judged at both ends of a window (decide/liveness)
            serving = p == pid or p in engine or role_of(comm, SERVING_ROLES)
            stuck.append((p, got.state, got.cpu_s, serving))
    # An engine's ancestors (an API server under a wrapper that is MainPID) feed it: no helper.
    parents = {t.pid: t.ppid for t in tree}
    feeding: set[int] = set()
    for p in engine:
        up = parents.get(p, 0)
        while up > 1 and up != pid and up not in feeding and up not in engine:
            feeding.add(up)
            up = parents.get(up) or processes.ppid_of(up)
    helpers = [h for h in helpers if h[0] not in feeding]
    n, cut = len(tree), len(everyone) > MAX_PROCESSES - 1
    try:  # a cgroup that cannot be read leaves the tree's reading as it is
        members = processes.unit_pids(pid, unit, limit=MAX_LISTED) if unit else None
    except (OSError, ValueError):
        members = None
    sidecars: list[int] = []
    if members is not None:
        known = {pid, *everyone}
        read: dict[int, tuple[ProcessTimes, str]] = {}
        cut = cut or members[1]
        for p in members[0]:
            if p in known:
                continue
            comm = processes.comm_of(p)
            if comm == RAY_IDLE:
                continue
            if len(pids) + len(read) >= MAX_PROCESSES:
                cut = True
                break
            got = processes.times_of(p)
            if got is not None:
                read[p] = (got, comm)

        def engines(p: int) -> bool:
            """An engine's process out of the tree: a Ray worker of vLLM's, one with an
            engine's role (under raylet), and, as in the tree, their descendants (a Ray
            worker's compile pool, its ninja and linker)."""
            for _ in range(len(read) + 1):
                if p not in read:
                    return False
                comm = read[p][1]
                if role_of(comm, (RAY_WORKER, *ENGINE_ROLES)):
                    return True
                p = read[p][0].ppid
            return False

        for p, (got, comm) in read.items():
            comms[p] = comm
            own = role_of(comm, (RAY_WORKER, *ENGINE_ROLES))
            if own and got.state in ("T", "t", "D"):  # a frozen Ray worker stops the serving
                stuck.append((p, got.state, got.cpu_s, True))
            if role_of(comm, SERVING_ROLES) and not own:
                tree.append(got)  # an API server out of the tree: vLLM's, no helper
                continue
            under = not own and engines(got.ppid)
            if not (own or under or comm in COMPILERS) and engine:
                # A sidecar, a double fork of vLLM's user, Ray's raylet: vLLM's process (a
                # GPU it holds is not another's), but no sign of the engine's work (counted,
                # a spinning sidecar held a deadlock as a doubt for ever). Where no process
                # has a role none can be told apart: counted below, as the whole tree is.
                sidecars.append(p)
                continue
            tree.append(got)
            if not own:
                helpers.append((p, comm, got.cpu_s))
            # The engine's work: an engine's process, a compiler's as under a worker (where no
            # process has an engine's role, the whole tree's sum takes it alike).
            seconds, engine_s, n = seconds + got.cpu_s, engine_s + got.cpu_s, n + 1
            engine_n += 1 if engine_n or own else 0
    stopped = [
        # Named by its comm alone: a stopped process's cmdline read waits on its memory-map
        # lock, which it may hold for ever (the probe would never come back).
        (f"PID {p} ({title([], comms[p] if p != pid else processes.comm_of(p))}, state {state})",
         cpu)
        for p, state, cpu, serving in stuck
        if serving or not engine
    ]  # fmt: skip
    if engine_only and engine_n:
        seconds, n = engine_s, engine_n
    return Cpu(
        time.monotonic(),
        round(seconds, 3),
        n,
        tuple(what for what, _ in stopped),
        tuple(cpu for _, cpu in stopped),
        tuple(helpers),
        tuple(tree),
        cut=cut,
        apart=tuple(sidecars),
    )


class NotVllm(Exception):
    """Another user's socket answered on vLLM's address."""


def canary(url: str, prompt: str, timeout_s: float, *, peer_uid: int | None = None) -> Canary:
    """One token of the served model (its name from /v1/models), asked of vLLM's user's socket
    only (`peer_uid`, ports/http.request)."""
    t0 = time.monotonic()
    models = request(f"{url}/v1/models", "GET", timeout_s, max_bytes=1 << 16, peer_uid=peer_uid)
    if models.intruder:  # an intruder's place taken: neither an answer nor a silence of vLLM's
        raise NotVllm(models.error)
    if not models.ok:
        took = time.monotonic() - t0
        return Canary(not models.timed_out, False, took, f"/v1/models: {models.error}")
    try:
        model = json.loads(models.body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Canary(True, False, time.monotonic() - t0, "/v1/models named no model")
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = request(f"{url}/v1/completions", "POST", timeout_s, json_body=body, peer_uid=peer_uid)
    if r.intruder:
        raise NotVllm(r.error)
    took = time.monotonic() - t0
    if r.ok:
        try:
            tokens = int(json.loads(r.body)["usage"]["total_tokens"])
        except (ValueError, KeyError, TypeError):
            tokens = 0
        return Canary(True, True, took, "", tokens)
    return Canary(not r.timed_out, False, took, f"/v1/completions: {r.error} {r.body[:200]}")


class Liveness:
    """Owned by the loop thread: when to probe, and what each reading means. A reading of
    /metrics, the processes and the GPUs every `metrics_interval_s`; a canary on a thread of
    its own, so that the readings go on while it waits (with vLLM's stats off, the canary's
    wait was one without any reading). A verdict is handed on only once what explains it is
    kept (`kept`: the stacks, the GPUs, the last /metrics), read on a thread too, before the
    teardown that loses it."""

    def __init__(
        self,
        config: Config,
        put: Callable[[Reading], None],
        *,
        gpu: GpuPort | None = None,
        indices: Callable[[], Sequence[int]] = tuple,
    ) -> None:
        self.config = config
        self._put = put
        self._gpu = gpu
        self._indices = indices
        self._pid = 0
        self._probing = False
        self._canary_out = False
        self._idle = True  # the last probe's counters said nothing runs or waits (or had none)
        self._next_probe = 0.0
        self._next_canary = 0.0
        self._last_metrics = ""  # the newest /metrics answer (at most KEPT_METRICS_BYTES)
        self._verdict: tuple[Hang, Reading] | None = None  # given, its evidence being read
        self._verdict_at = 0.0
        self.kept: dict[str, str] | None = None  # what explains the last verdict handed on
        self.judge = self._judge()
        # The unit's User= (the loop sets it from the observer): only that uid's socket is
        # vLLM's; another's answer is no reading at all (ports/http.request's peer_uid).
        self.peer_uid: int | None = None

    def _judge(self) -> Judge:
        c = self.config.liveness
        return Judge(c.stall_s, c.cpu_idle_fraction, c.hang_bound_s)

    def take_kept(self) -> dict[str, str] | None:
        """What explains the last verdict handed on, once (the next incident bundle's)."""
        kept, self.kept = self.kept, None
        return kept

    @property
    def gathering(self) -> bool:
        """A verdict is given, its evidence being read: it comes with the next reading."""
        return self._verdict is not None

    @property
    def next_probe(self) -> float:
        """When the next probe falls due (the loop's clock): a pass is due then, too."""
        return self._next_probe

    def serving(self, pid: int, now: float, capturing: bool) -> None:
        """A pass while `pid` serves: a probe, if one is due and none runs; a canary, if one
        is due, none is out, and no capture is under way (it would be in the traces)."""
        c = self.config.liveness
        if not c.enabled:
            return
        if pid != self._pid:  # a new vLLM: judged from its own first reading
            self._pid, self.judge, self._verdict = pid, self._judge(), None
            self._next_probe, self._next_canary = now, now + c.canary_interval_s
        if self._verdict is not None:
            return  # its evidence is being read: the verdict comes with it
        v = self.config.vllm
        url = v.url
        if not self._probing and now >= self._next_probe:
            self._probing = True
            # On the interval's grid, not a pass's lateness after it: late passes add no drift
            # (a bound of 40 readings came 0.1-0.2 s late in the sandbox); a probe missed by
            # more than an interval is not made up.
            self._next_probe = max(self._next_probe + c.metrics_interval_s, now)
            threading.Thread(
                target=self._probe,
                args=(pid, url, False),
                kwargs={"peer_uid": self.peer_uid},
                name="liveness",
                daemon=True,
            ).start()
        if not capturing and self._idle and not self._canary_out and now >= self._next_canary:
            self._canary_out = True
            threading.Thread(
                target=self._probe,
                args=(pid, url, True),
                kwargs={"peer_uid": self.peer_uid},
                name="liveness-canary",
                daemon=True,
            ).start()

    def _gpus(
        self, ours: Set[int] | None = None, apart: Set[int] = frozenset()
    ) -> tuple[GpuActivity, ...] | str | None:
        """The managed GPUs' own counters (errors as data), None where there is no GPU port;
        with `ours` (vLLM's PIDs), each GPU's processes that are not among them named
        (decide/liveness.foreign_on): another user's process on a GPU makes its counters no
        evidence of vLLM's."""
        if self._gpu is None:
            return None
        try:
            got = tuple(self._gpu.activity(list(self._indices())))
        except Exception as e:  # GpuUnavailable, or the port's own bug: no reading
            return reading_error(e)
        return got if ours is None else tuple(foreign_on(g, ours, apart) for g in got)

    def _probe(self, pid: int, url: str, with_canary: bool, *, peer_uid: int | None) -> None:
        """One reading (`with_canary`: the canary's, whose own /metrics read decides whether it
        is sent: only when nothing runs or waits, or there are no counters)."""
        c = self.config.liveness
        work, metrics, cpu, probe, metrics_at, gpu = None, "unreachable", None, None, 0.0, None
        try:
            r = request(
                f"{url}/metrics", "GET", c.canary_timeout_s, max_bytes=MAX_METRICS_BYTES,
                peer_uid=peer_uid,
            )  # fmt: skip
            if r.intruder:  # nobody's reading: the stall neither grows nor resets, no canary
                raise NotVllm(r.error)
            metrics_at = time.monotonic()
            work = parse(r.body) if r.ok else None
            metrics = "ok" if work is not None else "absent" if r.ok else "unreachable"
            if r.ok:
                self._last_metrics = r.body[:KEPT_METRICS_BYTES]
            unit = self.config.service.unit
            cpu = engine_cpu(pid, engine_only=True, unit=unit)
            # Only when the counters say the engine is idle (or there are none): under load a
            # one-token request waits behind the others, and its slowness says nothing.
            if with_canary and metrics != "unreachable" and (work is None or work.pending <= 0):
                tree = engine_cpu(pid)
                probe = canary(url, c.canary_prompt, c.canary_timeout_s, peer_uid=peer_uid)
                tree_end, sent = engine_cpu(pid), cpu
                cpu = engine_cpu(pid, engine_only=True, unit=unit)
                others = None  # what the rest of the tree (the API servers) used meanwhile
                if (
                    sent is not None
                    and cpu is not None
                    and tree is not None
                    and tree_end is not None
                ):
                    others = (tree_end.seconds - tree.seconds) - (cpu.seconds - sent.seconds)
                probe = dataclasses.replace(probe, cpu=sent, others_s=others)
            if with_canary:
                # The readings between judged the counters since: the canary's own read of
                # them is older than theirs by its wait.
                work, metrics_at = None, 0.0
            else:
                # vLLM's processes: its tree and its unit's cgroup (none if MainPID is gone:
                # every process listed on a GPU is then another's).
                ours = {pid, *(t.pid for t in cpu.tree)} if cpu is not None else set()
                gpu = self._gpus(ours, set(cpu.apart) if cpu is not None else set())
        except Exception:  # a reading must always come back, or no probe would run again
            pass
        kind = "canary" if with_canary else "probe"
        self._put(Reading(pid, work, probe, metrics, cpu, metrics_at, gpu, kind=kind))

    def _keep_evidence(self, reading: Reading) -> None:
        """What explains the verdict, read before it is handed on: vLLM's stacks (ports/
        stacks.py, bounded by EVIDENCE_S), the GPUs' counters and memory, the last /metrics."""
        kept: dict[str, str] = {}
        try:
            pids = [reading.pid, *processes.descendants(reading.pid)]
            # and those of its unit's cgroup out of the tree, as the reading found them
            read = [t.pid for t in reading.cpu.tree] if reading.cpu is not None else []
            known = set(pids)
            pids = [*pids, *(p for p in read if p not in known)][:STACK_PROCESSES]
            kept["stacks"] = stacks.dump(pids, time.monotonic() + EVIDENCE_S)
        except Exception as e:  # evidence only: said, never a reason to hold the verdict
            kept["stacks"] = f"(not read: {e!r})"
        gpus: list[str] = []
        got = self._gpus()
        if got is None:
            gpus.append("(no GPU port)")
        elif isinstance(got, str):
            gpus.append(f"NVML's counters: no reading: {got}")
        else:
            gpus += [gpu_said(g, None) + f", SM clock {g.sm_clock_mhz} MHz" + (
                f"; unread: {', '.join(g.unread)}" if g.unread else "") for g in got]  # fmt: skip
        if self._gpu is not None:
            try:
                for d in self._gpu.sample(list(self._indices())):
                    procs = ", ".join(f"PID {p.pid} ({p.used_mib} MiB)" for p in d.processes)
                    gpus.append(f"GPU {d.index}: {d.used_mib} of {d.total_mib} MiB used; "
                                f"processes: {procs or 'none listed'}")  # fmt: skip
            except Exception as e:
                gpus.append(f"NVML's memory and processes: no reading: {reading_error(e)}")
        kept["gpus"] = "\n".join(gpus)
        kept["metrics"] = self._last_metrics or "(no /metrics answer was read)"
        self._put(dataclasses.replace(reading, canary=None, kept=kept, kind="evidence"))

    def seen(self, reading: Reading, now: float, capturing: bool = False) -> Hang | None:
        """The reading applied: the verdict if vLLM is hung, else None; the verdict is handed
        on with the reading that comes back with its evidence (`kept`). While a capture is
        under way only what no flush does is a verdict (decide/liveness.Judge.capturing)."""
        c = self.config.liveness
        if reading.kind == "evidence":
            verdict, self._verdict = self._verdict, None
            if verdict is None or reading.pid != self._pid:
                return None
            self.kept = reading.kept
            # How long the evidence took to read: the verdict was given that much earlier.
            verdict[0].evidence["evidence_read_s"] = round(now - self._verdict_at, 2)
            return verdict[0]
        if reading.kind == "canary":
            self._canary_out = False
            if reading.canary is None:
                return None  # not sent: work ran or waited (the probes judge it)
        else:
            self._probing = False
            if reading.metrics != "unreachable":  # the canary goes only to an idle engine
                self._idle = reading.work is None or reading.work.pending <= 0
        if reading.pid != self._pid or self._verdict is not None:
            return None
        if reading.canary is not None:
            self._next_canary = now + c.canary_interval_s
        if capturing:
            hang = self.judge.capturing(now, reading.cpu, reading.gpu, work=reading.work)
        elif (sent := reading.canary) is None:
            hang = self.judge.seen(now, reading.work, reading.metrics, cpu=reading.cpu,
                                   gpu=reading.gpu)  # fmt: skip
        else:
            canary = (sent.answered, sent.took_s, sent.cpu)
            hang = self.judge.seen(now, reading.work, reading.metrics, cpu=reading.cpu,
                                   canary=canary, others_s=sent.others_s,
                                   gpu=reading.gpu)  # fmt: skip
        if hang is not None:
            self._verdict, self._verdict_at = (hang, reading), now
            threading.Thread(
                target=self._keep_evidence, args=(reading,), name="liveness-evidence",
                daemon=True,
            ).start()  # fmt: skip
        return None
