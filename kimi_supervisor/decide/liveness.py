"""Whether a serving vLLM makes progress. Its engine can hang (a deadlock, a process stuck in the
driver, a frozen worker) while its API server goes on answering /health with 200: vLLM 0.16's
health check reads only an "errored" flag (measured: VLLM::EngineCore SIGSTOPped,
/health 200 for 10 minutes, every request hanging). A "hung" verdict costs a teardown and a
model load (30 minutes on the real host), so it is as bad as a killed bystander when it is false.

Busy is not dead and slow is not hung: a verdict needs two independent signals of no progress,
one of them from outside vLLM's HTTP server:

- **the engine's processes** (`VLLM::EngineCore` and its workers, with their own children, a
  JIT compiler's, and the processes of vLLM's unit's cgroup that left its tree, a compiler's
  server; each process with its reaped children's time; the whole tree where vLLM
  names none so: an API server busy taking requests in and answering /health polls uses the
  CPU while the engine it feeds is deadlocked): one of vLLM's processes stopped (state T or
  t, SIGSTOP or a tracer; D, stuck in the kernel or the driver) at both ends of the window
  with its own CPU time still (a profiler's samples stop a busy process for moments), or the
  engine's CPU time, summed, grew by less than `cpu_idle_fraction` of one core over the last
  `stall_s` (or since the last proof of progress, if that is nearer; over the canary's wait
  for the canary, and then vLLM's API servers must not have used API_BUSY_FRACTION of a core
  or more meanwhile, for fewer than API_HELD_CANARIES canaries in a row: an API server busy
  tokenizing a long prompt holds the canary while the engine idles, and the engine's counters
  do not show that work yet). A stopped or deadlocked engine stops using the CPU; a busy one
  (a long prefill, a capture's flush on the engine's loop, a guided-decoding step) does not.
  Measured with vLLM 0.16's CPU build, TP 2: docs/performance.md, "What real vLLM shows the
  liveness rule";
- and one of:
  - **the work counters**: requests running or waiting (`vllm:num_requests_running`,
    `vllm:num_requests_waiting`) while none of the engine's counters grows
    (`vllm:iteration_tokens_total`'s count: one per engine step; `vllm:prompt_tokens_total`;
    `vllm:generation_tokens_total`) for `stall_s`;
  - **the canary**: one token asked of the served model, sent only when the counters say
    nothing runs or waits (or there are no counters), and given no answer (not even an error)
    within `canary_timeout_s`.

| readings | verdict |
|---|---|
| a capture starts, records or flushes | none (the stall counts again from its end), unless: |
| ... one of vLLM's processes stopped on the serving path for `stall_s` | hung |
| ... the GPUs read showing a kernel that spins (others idle) for `hang_bound_s`, no step | hung |
| work pending, counters still for `stall_s`, CPU flat or a process stopped | hung |
| work pending, counters still for `stall_s`, CPU busy (a long step, a flush) | a doubt |
| nothing pending (counters' idle) | not hung (the canary judges) |
| canary unanswered, CPU flat or a process stopped | hung |
| canary unanswered, the engine busy, or its API servers at a quarter core (once) | a doubt |
| canary answered, even with an error | not hung (an error is warned of) |
| a doubt for `hang_bound_s`, and over the last `stall_s`: | |
| ... no helper's or ended child's CPU, the GPUs read with no memory or link traffic | hung |
| ... a helper (a JIT compiler, a worker's fork) or a child that ended used CPU | a doubt |
| ... a GPU showed memory or link traffic | a doubt |
| ... a GPU unread in this reading or in over half the window's (no NVML, an error) | a doubt |
| ... a GPU whose samples of vLLM's processes NVML has (shared or not) | their memory % judges it |
| ... a GPU shared, vLLM's unsampled: NVML lists another's process (nodes 0666) | GPU set aside |
| ... every GPU shared (another's kernel no spin, its copies no work) | CPU signals alone |
| /metrics with no `vllm:*` series (stats off, a renamed metric) | "absent": CPU and canary judge |
| /metrics unreachable or too slow | no work reading: the stall neither grows nor resets |
| the engine's processes unreadable | no CPU signal: never hung |

A doubt is no verdict: shown in status, alerted on after 15 minutes, and kept until a proof of
progress, or until `hang_bound_s` (at most 600 s shipped) bounds it. A collective stuck on the
GPU spins its host thread at 100 % of a core (bench/cuda_wait_cpu.py) for ever: busy, yet dead.
The bound's second signal is the GPUs' own counters (model.GpuActivity, measured on an H100:
a kernel that spins or polls a flag in device memory reads util.gpu 100 %, util.memory 0 %,
PCIe at the idle level; every shape of work moved memory or PCIe: MEMORY_BUSY_PCT,
PCIE_BUSY_MB_S), and real work that no step shows holds it off: a
helper process of vLLM's that has none of its roles using CPU (FlashInfer's JIT compile runs up
to 10 minutes in ninja and nvcc; a fork of a worker keeping its title; a compiler's daemon that
left vLLM's tree, sccache's, and is still in its unit's cgroup), children of vLLM's
processes that ended meanwhile (a compiler run per kernel: their time is in their parent's
reaped children's, `reaped_used`), or memory or link traffic on a GPU. A counter not read is
never "idle": the bound judges on the readings that exist, each GPU read in at least half the
window's readings and in the last one; with none, no verdict by the bound. During a capture,
the GPUs read are judged: a GPU idle beside spinning ones is a rank that never reached the
collective (the hang's shape); a flush leaves every GPU idle. A GPU on which NVML lists a
process that is not vLLM's (any user may open the device nodes) and samples none of vLLM's is
"shared": its counters are that process's as much as vLLM's, so it shows neither work, nor a
spin, nor idle, and the verdict names it and the PID (`gpus_shared`); the bound is judged on
the other GPUs, and with every GPU shared on the helpers' and ended children's CPU alone: a
doubt that another's process held would be a hang that any user could keep for ever (a doubt
longer than `hang_bound_s` that only the GPUs' traffic explains is a prefill of ten minutes with
no step). A job that starts and ends between two readings is listed nowhere (NVML lists and
samples a process only while it lives: measured on an H100, bench/process_samples_probe.py),
yet its traffic is in the GPU's counters; so where NVML samples vLLM's own processes
(`GpuActivity.own`), their memory traffic alone tells work, on a shared GPU too (another's
process is not sampled as vLLM's, nor is a sidecar of vLLM's unit), and the GPU's counters only
where it samples none. Measured on the H100 (bench/gpu_hang_signature.py, each process's own
samples): a spin or a polled flag read memory 0 %, every shape of work 2 % (a PCIe-bound copy)
to 100 %; an NVLink transfer's is unmeasured (no NVLink there). The last proof of progress (a
counter that moved, a canary answered) is when a hang's unavailable window starts;
"nothing pending" is no proof: a frozen engine's gauges are frozen.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kimi_supervisor.model import GpuActivity, ProcessTimes

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
TOKENS = "vllm:generation_tokens"  # a counter's family; its sample is ..._total
PROMPT = "vllm:prompt_tokens"
STEPS = "vllm:iteration_tokens_total"  # a histogram: its _count is the engine's steps
# vLLM's /metrics is some 60-100 KB with its histograms; more than this is not vLLM's.
MAX_METRICS_BYTES = 4 << 20
# vLLM's API servers using this share of a core or more while a canary waits are at work that
# the canary may wait behind (a long prompt's tokenization holds a whole core), the engine idle
# for want of it: a doubt, not a hang. Forwarding requests and answering /health polls stays
# below (the idle real freeze: 0.06 s over a 30 s canary; the real tier's deadlock under load
# records the share it saw, api_cpu_s).
API_BUSY_FRACTION = 0.25
# ...but never for more canaries in a row than this, the engine flat all along: a tokenization
# ends within one canary's interval and hands its work to the engine, so a busy API server over
# two canaries (10 minutes apart at the shipped values) in front of an engine that never works
# is a deadlock whose clients keep the API server busy, and it is a hang. A quarter of a core,
# not a whole one: an API server may get less than it wants on a loaded host (a CPUQuota, an
# oversubscribed machine), and the bound limits what a low threshold can hide.
API_HELD_CANARIES = 2


@dataclass(frozen=True)
class Work:
    """vLLM's work counters at one moment, summed over its engines and models."""

    running: float
    tokens: float
    waiting: float = 0.0
    prompt_tokens: float | None = None
    steps: float | None = None

    @property
    def pending(self) -> float:
        return self.running + self.waiting

    def counters(self) -> tuple[float | None, float | None, float]:
        return (self.steps, self.prompt_tokens, self.tokens)


def parse(text: str) -> Work | None:
    """`Work` from vLLM's /metrics text; None when it has no running gauge or no token counter
    (vLLM run with its stats off, a renamed metric, or not vLLM at all)."""
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            name, samples = family.name, family.samples
            if family.type == "unknown":  # no TYPE line: the family is named as its sample
                name = name.removesuffix("_total")
            if name in (RUNNING, WAITING):
                found[name] = sum(s.value for s in samples)
            elif name in (TOKENS, PROMPT):
                found[name] = sum(s.value for s in samples if s.name.endswith("_total"))
            elif name == STEPS:
                found[name] = sum(s.value for s in samples if s.name.endswith("_count"))
    except ValueError:
        return None
    if RUNNING not in found or TOKENS not in found:
        return None
    return Work(
        found[RUNNING], found[TOKENS], found.get(WAITING, 0.0), found.get(PROMPT), found.get(STEPS)
    )


@dataclass(frozen=True)
class Cpu:
    """vLLM's processes at one moment (`at`: the monotonic clock of the read): their CPU time
    summed (user and system, seconds), and those stopped or stuck (state T, t or D), by PID,
    name and state."""

    at: float
    seconds: float
    processes: int
    stopped: tuple[str, ...] = ()
    stopped_cpu: tuple[float, ...] = ()  # each stopped one's own CPU time, in that order
    # vLLM's helpers: its descendants that have none of its roles (a JIT compiler: ninja, nvcc,
    # cc; the resource tracker), each (PID, comm, CPU time): real work that no engine step
    # shows, which the bound on a doubt (`Judge.hang_bound_s`) waits for.
    helpers: tuple[tuple[int, str, float], ...] = ()
    # Each process's times (its identity, parent, CPU, its reaped children's): what its
    # children that ended between two readings used (`reaped_used`).
    tree: tuple[ProcessTimes, ...] = ()
    # More processes than were read (MAX_PROCESSES): a helper or a stopped rank may be among
    # those left out, so the bound gives no verdict on this reading.
    cut: bool = False
    # The processes of vLLM's unit's cgroup out of its tree that are neither an engine's nor a
    # compiler's (a sidecar, Ray's raylet): vLLM's (a GPU they hold is not another's), but
    # what they use is no sign of the engine's work.
    apart: tuple[int, ...] = ()


def no_progress(base: Cpu | None, cpu: Cpu | None, idle_fraction: float) -> str:
    """Why the processes show no progress from `base` to `cpu` ("" if they do, or cannot be
    read). A process counts as stopped only if it was stopped at both ends and its own CPU
    time did not grow between them: a sampling profiler (py-spy stops its target for each
    sample: state t in 44-58 % of reads of a busy real EngineCore at 100 Hz) or a debugger's
    moment during a long step is no hang. The sum going down (a process left the tree) says
    nothing, nor does a reading of fewer processes than there are (`cut`)."""
    if cpu is None or base is None or cpu.at <= base.at:
        return ""
    took = cpu.at - base.at
    before = dict(zip(base.stopped, base.stopped_cpu, strict=False))
    stopped = [
        p
        for p, s in zip(cpu.stopped, cpu.stopped_cpu, strict=False)
        if p in before and s - before[p] < idle_fraction * took
    ]
    if stopped:
        return f"stopped: {', '.join(stopped)}"
    if cpu.cut or base.cut:
        return ""  # a flat sum of some of the processes proves none of the others idle
    used = cpu.seconds - base.seconds
    if 0 <= used < idle_fraction * took:
        return (
            f"{cpu.processes} process(es) used {used:.2f} s of CPU in {took:.0f} s "
            f"(under {idle_fraction:.0%} of one core)"
        )
    return ""


def helpers_used(base: Cpu | None, cpu: Cpu | None) -> tuple[float, str]:
    """The CPU seconds vLLM's helpers (`Cpu.helpers`) used from `base` to `cpu`, and the
    busiest of them named; (0, "") where either is unread. One that started since counts
    whole; one that ended since takes its time away with it (into its parent's)."""
    if base is None or cpu is None:
        return 0.0, ""
    # A PID reused since (the next compile in a recycled PID) is a new helper: counted whole.
    born = {t.pid: t.start_ticks for t in base.tree}
    now_born = {t.pid: t.start_ticks for t in cpu.tree}
    before = {
        pid: s
        for pid, _name, s in base.helpers
        if born.get(pid) == now_born.get(pid, born.get(pid))
    }
    used = sorted(
        ((s - before.get(pid, 0.0), f"PID {pid} ({name})") for pid, name, s in cpu.helpers),
        reverse=True,
    )
    used = [(d, who) for d, who in used if d > 0]
    named = ", ".join(who for _d, who in used[:3]) + (
        f" and {len(used) - 3} more" if len(used) > 3 else ""
    )
    return sum(d for d, _who in used), named


def reaped_used(base: Cpu | None, cpu: Cpu | None) -> tuple[float, str]:
    """The CPU seconds that children of vLLM's processes used from `base` to `cpu` and that
    ended meanwhile, their time reaped into their parent's (cutime and cstime): a JIT compile as
    a compiler run per kernel spawned straight from a worker (Triton's ptxas, a C++ extension
    built without ninja), each ending between two readings, that no helper reading sees. With
    the parents that reaped the most named; (0, "") where either is unread.

    Only what was used after `base`: a process of the tree seen at `base` that has ended since
    (a helper that lived for hours, a worker) brings its whole life's time into its parent's,
    and what it had used by `base` is taken away again from the nearest of its ancestors seen at
    both ends. A process that merely spins never grows its reaped time, whatever it spins on."""
    if base is None or cpu is None:
        return 0.0, ""
    was = {(t.pid, t.start_ticks): t for t in base.tree}
    now = {(t.pid, t.start_ticks): t for t in cpu.tree}
    by_pid = {t.pid: key for key, t in was.items()}
    owed: dict[tuple[int, int], float] = {}
    for key, t in was.items():
        if key in now:
            continue
        up, seen = by_pid.get(t.ppid), 0
        while up is not None and up not in now and seen < len(was):  # its nearest ancestor kept
            up, seen = by_pid.get(was[up].ppid), seen + 1
        if up is not None and up in now:
            owed[up] = owed.get(up, 0.0) + t.cpu_s
    used = []
    for key, t in now.items():
        grew = t.reaped_s - (was[key].reaped_s if key in was else 0.0) - owed.get(key, 0.0)
        if grew > 0:
            used.append((grew, f"PID {t.pid}: {grew:.1f} s"))
    used.sort(reverse=True)
    return sum(d for d, _who in used), ", ".join(who for _d, who in used[:3])


# The GPU's own counters (model.GpuActivity) that tell a kernel spinning on a flag never set (a
# collective stuck on the GPU) from work, as measured on an H100 (NVML every 0.2 s; bench/
# gpu_hang_signature.py, bench/results/h100x1-2026-12-07-gpu-hang-signature*.json; docs/
# performance.md, "A spinning hang on the GPU"): a kernel that spins, or polls a flag in device
# memory, read util.gpu 100 %, util.memory 0 %, the idle power and PCIe at most 2.8 MB/s; one that
# polls a flag in mapped host memory (a proxy's flag: a stuck collective on a PCIe host without
# NVLink) read util.memory 0 % and PCIe 59 MB/s (58.8-60.4: its polls cross the bus). Every
# shape of work read util.memory 2 % (a host-to-device copy, PCIe-bound at 62,000 MB/s) to 100 %.
# So memory traffic decides; PCIe counts as work only far above what polling moves (34 times the
# one polling kernel measured: a stuck collective polls one flag per channel, NCCL's default at
# most 32) and far below a copy (31 times under). The host thread behind each used a whole core:
# the CPU tells nothing. Power does not separate them: it is shown, never judged.
MEMORY_BUSY_PCT = 1.0  # util.memory at or above this: the GPU moves memory, it works
PCIE_BUSY_MB_S = 2000.0  # PCIe traffic (sent and received) at or above this: it works
NVLINK_BUSY_MB_S = 0.0  # NVLink traffic above this: it works (not measured: no NVLink there)
SPIN_GPU_PCT = 90.0  # util.gpu at or above this with no traffic: a kernel that spins


def gpu_said(g: GpuActivity, nvlink_mb_s: float | None) -> str:
    """One GPU's counters in words, for a verdict's evidence."""

    def v(x: float | None, unit: str) -> str:
        return "unread" if x is None else f"{x:g}{unit}"

    link = "" if g.nvlink_kib is None else f", NVLink {v(nvlink_mb_s, ' MB/s')}"
    judged = "judged on vLLM's own samples" if g.own is not None else "not vLLM's: not judged"
    shared = f", shared with PID {', '.join(map(str, g.foreign))} ({judged})" if g.foreign else ""
    own = "" if g.own is None else f"; vLLM's: busy {g.own[0]:g} %, memory {g.own[1]:g} %"
    return (
        f"GPU {g.index}: busy {v(g.util_gpu, ' %')}, memory {v(g.util_memory, ' %')}, "
        f"{v(g.power_w, ' W')}, PCIe {v(g.pcie_mb_s, ' MB/s')}{link}{own}{shared}"
    )


def foreign_on(g: GpuActivity, ours: Set[int], apart: Set[int] = frozenset()) -> GpuActivity:
    """`g` with the processes it lists that are not vLLM's (`ours`: its engine's and helpers'
    PIDs as read by the probe; `apart`: its unit's others, a sidecar's) named in `foreign`, and
    the samples of `ours` (`own`: a sidecar's traffic is no more the engine's work than its CPU
    is). Any PID in neither is another's: NVML's PIDs are the host's, and a process in another
    PID namespace may read 0, or a PID that is nobody here. A list that could not be read names
    none (the counters are judged as before)."""
    mine = [(sm, mem) for pid, sm, mem in g.samples or () if pid in ours]
    own = (max(m[0] for m in mine), max(m[1] for m in mine)) if mine else None
    if g.pids is None:
        return replace(g, own=own)
    return replace(g, foreign=tuple(p for p in g.pids if p not in ours and p not in apart),
                   own=own)  # fmt: skip


def gpu_work(g: GpuActivity, nvlink_mb_s: float | None) -> bool | None:
    """Whether one GPU's counters show work (memory or link traffic); None where they cannot
    say (a counter unread: no reading is never "idle"). Where NVML sampled vLLM's own
    processes (`own`), their memory traffic alone decides: the GPU's counters also hold what
    another user's job moved between two readings and ended before the second (NVML then
    lists it nowhere), and a kernel polling a flag moves no memory in any shape measured."""
    if g.own is not None:
        return g.own[1] >= MEMORY_BUSY_PCT
    if g.util_memory is None or g.pcie_mb_s is None:
        return None
    if any(u.startswith("NVLink traffic") for u in g.unread):
        return None  # its links could not be read (not "no NVLink")
    if g.nvlink_kib is not None and nvlink_mb_s is None:
        return None  # a link's rate needs two readings
    return (
        g.util_memory >= MEMORY_BUSY_PCT
        or g.pcie_mb_s >= PCIE_BUSY_MB_S
        or (nvlink_mb_s is not None and nvlink_mb_s > NVLINK_BUSY_MB_S)
    )


GpuReading = tuple[GpuActivity, ...] | str  # the managed GPUs' counters, or why none


def nvlink_rates(readings: Sequence[tuple[float, GpuReading]]) -> dict[int, float]:
    """Each GPU's NVLink traffic (MB/s) at the last of `readings` (oldest first), from the
    newest one before it that read that GPU's links: a reading that failed between is passed
    over. None for a GPU whose counter went back (reset, wrapped): that reading is unread."""
    t, now = readings[-1]
    if isinstance(now, str):
        return {}
    out = {}
    for g in now:
        if g.nvlink_kib is None:
            continue
        for t0, r in reversed(readings[:-1]):
            k0 = (
                None
                if isinstance(r, str)
                else next((x.nvlink_kib for x in r if x.index == g.index), None)
            )
            if k0 is None:
                continue
            if t > t0 and g.nvlink_kib >= k0:
                out[g.index] = (g.nvlink_kib - k0) * 1.024 / (t - t0)
            break
    return out


def gpu_states(readings: Sequence[tuple[float, GpuReading]]) -> dict[int, str]:
    """What each GPU of the last of `readings` shows: "work" (memory or link traffic), "spin"
    (busy, SPIN_GPU_PCT, no traffic: a kernel polling a flag never set), "quiet" (no traffic,
    not busy: idle), "unread" (a counter not read: never "idle"), or "shared" (a process not
    vLLM's holds a context on it: its counters are that process's as much as vLLM's, and say
    nothing of either). Empty where it failed."""
    _t, now = readings[-1]
    if isinstance(now, str):
        return {}
    rates = nvlink_rates(readings)
    out = {}
    for g in now:
        if g.foreign and g.own is None:
            out[g.index] = "shared"
            continue
        work = gpu_work(g, rates.get(g.index))
        util = g.own[0] if g.own is not None else g.util_gpu
        busy = util is not None and util >= SPIN_GPU_PCT
        out[g.index] = "unread" if work is None else "work" if work else "spin" if busy else "quiet"
    return out


def health_failure(
    health: int, slow: bool, tree: Sequence[Cpu], *, window_s: float, idle_fraction: float
) -> str:
    """Why a serving vLLM whose /health fails makes no progress, or "" (a slow answer alone):
    the restart after `daemon.health_grace_s` needs this second signal.

    - /health answered, with anything but 200 (vLLM 0.16: 503 once its engine is dead), or the
      connection was refused (nothing listens): vLLM's own statement, not slowness.
    - no answer that says anything (`slow`: none in `daemon.health_timeout_s`, a reset, or the
      daemon's own error, such as no descriptor left): a busy API server is slow too. It counts
      only if vLLM's processes (MainPID and its descendants: the API servers, wherever they
      are, and the engine) used under `idle_fraction` of one core over the last `window_s`, or
      one of them was stopped throughout it. `tree`: their readings, oldest first; fewer than
      a window of them say nothing.
    """
    if not slow:
        return f"/health answered {health}" if health else "/health refused the connection"
    if not tree:
        return ""
    cpu, base = tree[-1], None
    for c in tree:
        if c.at <= cpu.at - window_s:
            base = c
    if base is None:
        return ""
    why = no_progress(base, cpu, idle_fraction)
    return f"/health gave no answer, and vLLM's processes: {why}" if why else ""


@dataclass(frozen=True)
class Hang:
    """A verdict: why, what each signal saw, and the last proof of progress (the loop's clock)."""

    reason: str
    evidence: dict[str, Any]
    since: float


@dataclass
class Judge:
    """The readings of one vLLM, in order (a new vLLM gets a new Judge)."""

    stall_s: float
    cpu_idle_fraction: float
    # A doubt (work waits, no step, the engine busy) this old, with no sign of real work (no
    # helper using CPU, the GPUs' own counters read with no memory or link traffic), is a
    # hang: a collective stuck on the GPU spins its host thread for ever. 0: unbounded.
    hang_bound_s: float = 0.0
    progress_at: float | None = None  # since when no stall (progress, or nothing pending)
    cpu_at_progress: Cpu | None = None  # the engine's CPU then
    # The last proof of progress (a counter that moved, a canary answered): where a hang's
    # window starts. "Nothing pending" is none: a frozen engine's gauges are frozen too. A
    # counter that a reading sees moved moved after the reading before, so that one's time is
    # taken: the window is never shorter than what clients went without (taken at the reading
    # that saw it, the window was up to one metrics interval short, an outside review).
    alive_at: float | None = None
    read_at: float | None = None  # the last reading's time that had the counters
    counters: tuple[float | None, float | None, float] | None = None
    # The last reading's counters and gauges, and when: a canary's verdict (its reading has
    # none of its own) says what they read.
    last_work: tuple[float, Work] | None = None
    metrics: str = "unknown"  # "ok", "absent" (no vllm:* series), "unreachable"
    # One signal says no progress and the other does not (not hung): why, and since when. It
    # lasts until a proof of progress, so that an engine that spins on a GPU that never
    # answers (a hung collective: bench/cuda_wait_cpu.py) is shown, and alerted on, until
    # `hang_bound_s` bounds it.
    doubt: str = ""
    doubt_since: float | None = None
    # When the canary that left the doubt standing was sent: the readings between canaries go
    # on counting towards the bound (a canary unanswered is work that waits).
    unanswered_since: float | None = None
    api_held = 0  # canaries in a row held, it seemed, behind busy API servers (API_HELD_CANARIES)
    samples: list[tuple[float, Cpu]] = field(default_factory=list)  # the engine's CPU, in time
    gpus: list[tuple[float, GpuReading]] = field(default_factory=list)  # the GPUs', in time
    # Since when the GPUs read have shown a kernel spinning (gpu_states: "spin" on one at
    # least, none at work), and in how many readings since they were read and not (a reading
    # that failed, or read no GPU, neither starts nor ends it).
    spin_since: float | None = None
    spin_read: int = 0
    spin_unread: int = 0
    # The work counters during a capture: a step while the GPUs spin ends the spin.
    capture_counters: tuple[float | None, float | None, float] | None = None
    captured_at: float | None = None  # a capture's last reading

    def progress(self, now: float, cpu: Cpu | None) -> None:
        self.progress_at, self.cpu_at_progress = now, cpu

    def cpu_signal(self, base: Cpu | None, cpu: Cpu | None) -> str:
        return no_progress(base, cpu, self.cpu_idle_fraction)

    def _keep(self, now: float, cpu: Cpu | None, gpu: GpuReading | None) -> None:
        """The readings over the last stall_s and more (the windows look back that far)."""
        keep = now - 2 * max(self.stall_s, 1.0)
        if cpu is not None:
            self.samples.append((now, cpu))
            self.samples = [(t, c) for t, c in self.samples if t >= keep]
        if gpu is not None:
            self.gpus.append((now, gpu))
            # and the one before the oldest kept: a link's rate needs it
            first = next(i for i, (t, _g) in enumerate(self.gpus) if t >= keep)
            del self.gpus[: max(first - 1, 0)]
            said = set(gpu_states(self.gpus).values())
            if "work" in said or (said == {"quiet"}):  # at work, or every GPU read idle
                self._spin_ended()
            elif "spin" in said:
                # A GPU idle beside spinning ones is the hang's shape, not work: the ranks that
                # entered a collective spin in it, one that never arrived (blocked in its host
                # code) leaves its GPU idle.
                self.spin_since = self.spin_since or now
                self.spin_read += 1
            elif self.spin_since is not None:  # the spinning GPUs unread: it says nothing
                self.spin_unread += 1

    def _spin_ended(self) -> None:
        self.spin_since, self.spin_read, self.spin_unread = None, 0, 0

    def _spun(self, now: float) -> bool:
        """The GPUs read have spun for hang_bound_s, read in at least half the readings since
        and in this one."""
        return (
            self.hang_bound_s > 0
            and self.spin_since is not None
            and now - self.spin_since >= self.hang_bound_s
            and self.spin_read >= self.spin_unread
            and bool(self.gpus)
            and self.gpus[-1][0] == now
            and "spin" in gpu_states(self.gpus).values()
        )

    def _base(self, since: float, now: float) -> Cpu | None:
        """The engine's CPU stall_s ago (or at `since`, if that is nearer)."""
        base = self.cpu_at_progress
        for t, c in self.samples:
            if since <= t <= now - self.stall_s:
                base = c
        return base

    def capturing(
        self,
        now: float,
        cpu: Cpu | None,
        gpu: GpuReading | None = None,
        *,
        work: Work | None = None,
    ) -> Hang | None:
        """A capture starts, records or flushes: its flush may hold the engine, busy, for as
        long as `profiling.flush_timeout_s`, so the stall starts again. But not what no flush
        does: one of vLLM's processes stopped on the serving path over the last stall_s, or
        the GPUs read showing a kernel that spins for `hang_bound_s` (a flush runs no kernel:
        its GPUs read idle) with no engine step meanwhile (`work`, where its counters are
        read): the verdict, as without a capture."""
        if work is not None:
            if self.capture_counters not in (None, work.counters()):
                self._spin_ended()  # a step: whatever the GPUs read, the engine works
            self.capture_counters = work.counters()
        self._keep(now, cpu, gpu)
        if self.alive_at is None:
            self.alive_at = now
        base = None
        for t, c in self.samples:
            if t <= now - self.stall_s:
                base = c
        why = self.cpu_signal(base, cpu)
        spun = self._spun(now)
        self.progress(now, cpu)
        self.counters, self.captured_at = None, now
        # A doubt's clock starts again after the capture too: its flush may hold the engine,
        # busy, for as long as it takes (else the bound after it would be stall_s).
        self.doubt, self.doubt_since, self.unanswered_since = "", None, None
        if not why.startswith("stopped") and not spun:
            return None
        if not why.startswith("stopped"):
            # A spin is the bound's verdict: what holds the bound off outside a capture (a
            # helper compiling, children that ended, a tree not read whole) holds it off here.
            used, _who = self._cpu_work(now)
            if used >= self.cpu_idle_fraction * self.stall_s or (cpu is not None and cpu.cut):
                return None
        evidence: dict[str, Any] = {"capturing": True, "metrics": self.metrics}
        if cpu is not None:
            evidence |= {"cpu_s": round(cpu.seconds, 2), "stopped": list(cpu.stopped)}
        if why.startswith("stopped"):
            reason = f"a capture is under way, and the engine: {why}"
        else:
            said = self._gpus_said()
            evidence |= {"gpus": said, **self._foreign()}
            readings = self.spin_read + self.spin_unread
            reason = (
                f"a capture is under way, and the GPUs read have shown a kernel that spins (busy, "
                f"no memory or link traffic; any other idle, as a rank that never reached the "
                f"collective) for {now - (self.spin_since or now):.0f} s, read in "
                f"{self.spin_read} of {readings} readings, with no engine step (liveness."
                f"hang_bound_s = {self.hang_bound_s:g} s): {'; '.join(said)}"
            )
        assert self.alive_at is not None
        evidence["since_alive_s"] = round(now - self.alive_at, 1)
        return Hang(reason, evidence, self.alive_at)

    def _gpus_said(self) -> list[str]:
        """The GPUs' newest reading in words."""
        if not self.gpus:
            return ["not read"]
        _t, g = self.gpus[-1]
        if isinstance(g, str):
            return [f"no reading: {g}"]
        rates = nvlink_rates(self.gpus)
        return [gpu_said(x, rates.get(x.index)) for x in g]

    def _foreign(self) -> dict[str, dict[str, list[int]]]:
        """The newest reading's GPUs shared with another's process, and its PIDs, by index
        (evidence: {"gpus_shared": {"1": [4242]}}); {} where there are none."""
        if not self.gpus or isinstance(self.gpus[-1][1], str):
            return {}
        shared = {str(g.index): list(g.foreign) for g in self.gpus[-1][1] if g.foreign}
        return {"gpus_shared": shared} if shared else {}

    def _cpu_work(self, now: float) -> tuple[float, str]:
        """The CPU that vLLM's helpers (a JIT compiler) and its processes' children that ended
        meanwhile (a compiler run per kernel) used over the last stall_s, and who."""
        cpu = self.samples[-1][1] if self.samples else None
        base = self._base(0.0, now)
        helpers, who = helpers_used(base, cpu)
        reaped, parents = reaped_used(base, cpu)
        said = [who] if who else []
        said += [f"children that ended, reaped by {parents}"] if parents else []
        return helpers + reaped, "; ".join(said)

    def _real_work(self, now: float) -> str:
        """Why vLLM may be at real work that no step shows, over the last stall_s: a helper
        (a JIT compiler) or a child that ended using CPU, the GPUs' counters showing traffic in
        a reading, or too few of them read (not in this reading, or a GPU in fewer than half of
        the window's: no reading is never idle); "" if none. A GPU shared with another's process
        (gpu_states' "shared") is set aside: neither work nor unread. Were it a doubt, any user
        who can open the device nodes (0666 by default) would hold a hung vLLM's doubt for
        ever; so with every GPU shared, the helpers' and ended children's CPU alone judge."""
        used, who = self._cpu_work(now)
        latest_cpu = self.samples[-1][1] if self.samples else None
        if latest_cpu is not None and latest_cpu.cut:
            return "vLLM has more processes than a reading takes (a helper may be among the rest)"
        if used >= self.cpu_idle_fraction * self.stall_s:
            return (
                f"vLLM's helpers and ended children used {used:.1f} s of CPU in "
                f"{self.stall_s:g} s ({who})"
            )
        window = [i for i, r in enumerate(self.gpus) if r[0] >= now - self.stall_s]
        if not window or self.gpus[window[-1]][0] != now:
            return "the GPUs' counters were not read with this reading"
        _t, latest = self.gpus[-1]
        if isinstance(latest, str):
            return f"the GPUs' counters could not be read ({latest})"
        if not latest:
            return "the GPUs' counters could not be read (no managed GPU)"
        read: dict[int, int] = {}
        shared: dict[int, int] = {}  # the readings in which a GPU was shared: none of vLLM's
        for i in window:
            for index, state in gpu_states(self.gpus[: i + 1]).items():
                if state == "work":
                    return f"the GPU works ({self._said_at(i, index)})"
                read[index] = read.get(index, 0) + (state not in ("unread", "shared"))
                shared[index] = shared.get(index, 0) + (state == "shared")
        states = gpu_states(self.gpus)
        for g in latest:
            if states[g.index] == "shared":
                continue  # another's process on it: the others and the CPU judge
            if states[g.index] == "unread":
                return f"the GPUs' counters could not be read ({self._said_at(-1, g.index)})"
            of = len(window) - shared[g.index]
            if 2 * read[g.index] < of:
                return (
                    f"GPU {g.index}'s counters were read in {read[g.index]} of the "
                    f"{of} readings of the last {self.stall_s:g} s (fewer than half)"
                )
        return ""

    def _said_at(self, i: int, index: int) -> str:
        """GPU `index` of reading `i` in words."""
        upto = self.gpus[: i + 1] if i >= 0 else self.gpus
        _t, g = upto[-1]
        assert not isinstance(g, str)
        rates = nvlink_rates(upto)
        x = next(x for x in g if x.index == index)
        return gpu_said(x, rates.get(index))

    def _bounded(self, now: float, why: str, evidence: dict[str, Any]) -> Hang | None:
        """The doubt standing since `doubt_since` (work waiting, no step, the engine busy):
        past `hang_bound_s` with no sign of real work, a hang (`why`: what waits)."""
        if not self.hang_bound_s or self.doubt_since is None or self.alive_at is None:
            return None
        # A stall's doubt counts from the last reading before the counters' last move (the
        # step came after it): the verdict comes within hang_bound_s and a reading of the last
        # step, at the cost of one interval's doubt about when that step was. An unanswered
        # canary's counts from its sending.
        start = self.doubt_since
        if self.unanswered_since is None:
            start = min(start, self.alive_at)
        # ...and never from before a capture's last reading: its flush may have held the engine
        # busy for as long as it took, a doubt before it (a long prefill) shortening the bound
        # after it to stall_s (an outside review).
        lasted = now - max(start, self.captured_at or start)
        if lasted < self.hang_bound_s:
            return None
        work = self._real_work(now)
        used, who = self._cpu_work(now)
        said = self._gpus_said()
        evidence |= {"doubt_s": round(lasted, 1), "hang_bound_s": self.hang_bound_s,
                     "helpers_cpu_s": round(used, 2), "gpus": said, **self._foreign()}  # fmt: skip
        if work:
            past = "; past liveness.hang_bound_s, but "
            self.doubt = f"{self.doubt.split(past)[0]}{past}{work}"
            return None
        evidence["since_alive_s"] = round(now - self.alive_at, 1)
        helpers = (
            f"vLLM's helpers and ended children used {used:.2f} s of CPU in {self.stall_s:g} s"
            + (f" ({who})" if who else "")
        )
        reason = (
            f"{why}; the engine busy for {lasted:.0f} s (liveness.hang_bound_s = "
            f"{self.hang_bound_s:g} s) with no sign of real work: {helpers}; {'; '.join(said)}"
        )
        return Hang(reason, evidence, min(start, self.alive_at))

    def seen(
        self,
        now: float,
        work: Work | None,
        metrics: str,
        *,
        cpu: Cpu | None,
        canary: tuple[bool, float, Cpu | None] | None = None,
        others_s: float | None = None,
        gpu: GpuReading | None = None,
    ) -> Hang | None:
        """One reading: the work counters (None: no reading; `metrics` says why), the engine's
        CPU, and the canary if one was sent (answered, seconds taken, the engine's CPU when it
        was sent); `others_s`: the CPU seconds vLLM's other processes (its API servers) used
        while the canary waited; `gpu`: the managed GPUs' counters (None: not read with this
        reading). Returns the verdict, or None."""
        self.metrics = metrics
        self.capture_counters = None  # a capture's counters are compared within it alone
        if self.progress_at is None:
            self.progress(now, cpu)
            self.alive_at = now
        self._keep(now, cpu, gpu)
        if work is not None:
            self.last_work = (now, work)
            # The reading before with counters (one without them says nothing of when they
            # moved: taken from it, the window was one interval short, an outside review).
            before, self.read_at = self.read_at, now
            moved = self.counters is not None and work.counters() != self.counters
            if moved or work.pending <= 0 or self.counters is None:
                self.progress(now, cpu)
            if moved:
                self.alive_at = before if before is not None else now
                self._spin_ended()  # a step: whatever the GPUs read, the engine works
            self.counters = work.counters()
        if canary is not None and canary[0]:
            self.progress(now, cpu)  # an answer is progress
            self.alive_at = now
            self.api_held = 0
        assert self.progress_at is not None
        since = self.progress_at
        busy = ""  # why a signal of no progress is not one
        stalled = work is not None and work.pending > 0 and now - since >= self.stall_s
        unanswered = canary is not None and not canary[0]
        if not (stalled or unanswered):
            if self.doubt_since is None or (self.alive_at or 0.0) > self.doubt_since:
                self.doubt, self.doubt_since, self.unanswered_since = "", None, None
            elif (
                self.unanswered_since is not None
                and cpu is not None  # the helpers' CPU unread: no verdict
                and (work is None or work.pending <= 0)
            ):
                # An unanswered canary's doubt stands between canaries: the bound counts on.
                ago = now - self.unanswered_since
                why = f"a one-token request sent {ago:.0f} s ago got no answer"
                standing: dict[str, Any] = {
                    "metrics": metrics,
                    "since_progress_s": round(now - since, 1),
                    "cpu": "busy" if cpu is not None else "unreadable",
                }
                return self._bounded(now, why, standing)
            return None
        if stalled:
            assert work is not None
            # Over the last stall_s: an engine busy for a while that then deadlocked is
            # noticed stall_s after it stopped, not once its average falls.
            cpu_why = self.cpu_signal(self._base(since, now), cpu)
            work_why = (
                f"{work.running:g} running and {work.waiting:g} waiting, and no engine step, "
                f"prompt or generated token for {now - since:.0f} s"
            )
        else:
            assert canary is not None
            cpu_why = self.cpu_signal(canary[2], cpu)
            work_why = f"a one-token request got no answer in {canary[1]:.0f} s"
            held = (
                cpu_why
                and not cpu_why.startswith("stopped")
                and others_s is not None
                and others_s >= API_BUSY_FRACTION * canary[1]
            )
            self.api_held = self.api_held + 1 if held else 0
            if held and self.api_held < API_HELD_CANARIES:
                # The API servers at work (a long prompt's tokenization holds a core): the
                # canary may wait behind them, the engine idle for want of work. A stopped
                # process answers nothing whatever they do; and work that never reaches the
                # engine over API_HELD_CANARIES canaries in a row is no longer a tokenization.
                assert others_s is not None
                busy = (
                    f"vLLM's API server(s) used {others_s:.1f} s of CPU in {canary[1]:.0f} s "
                    "(the canary may wait behind them)"
                )
                cpu_why = ""
            elif held:
                cpu_why += (
                    f"; and {self.api_held} canaries in a row waited behind busy API server(s) "
                    "with the engine idle"
                )
        evidence: dict[str, Any] = {
            "metrics": metrics,
            "since_progress_s": round(now - since, 1),
            "cpu": cpu_why or "busy" if cpu is not None else "unreadable",
        }
        shown = work
        if work is None and self.last_work is not None:
            at, shown = self.last_work
            evidence["work_read_s_ago"] = round(now - at, 1)
        if shown is not None:
            evidence |= {
                "running": shown.running,
                "waiting": shown.waiting,
                "steps": shown.steps,
                "prompt_tokens": shown.prompt_tokens,
                "tokens": shown.tokens,
            }
        if cpu is not None:
            evidence |= {"cpu_s": round(cpu.seconds, 2), "stopped": list(cpu.stopped)}
        if canary is not None:
            evidence |= {"canary_answered": canary[0], "canary_s": round(canary[1], 1)}
            if others_s is not None:
                evidence["api_cpu_s"] = round(others_s, 2)
        if not cpu_why:
            # One signal alone: a slow answer, or a step longer than stall_s. Not a verdict,
            # until it has lasted hang_bound_s with no sign of real work.
            if not busy:
                why = "are busy" if cpu is not None else "cannot be read"
                busy = f"the engine's processes {why}"
            self.doubt = f"{work_why}, but {busy}: not hung"
            if self.doubt_since is None:
                self.doubt_since = since if stalled else now - canary[1] if canary else now
            if unanswered and not stalled and canary is not None:
                self.unanswered_since = self.unanswered_since or now - canary[1]
            if cpu is None or (busy and not busy.startswith("the engine's")):
                return None  # no CPU reading, or a canary held by busy API servers
            return self._bounded(now, work_why, evidence)
        assert self.alive_at is not None
        evidence["since_alive_s"] = round(now - self.alive_at, 1)
        return Hang(f"{work_why}; the engine: {cpu_why}", evidence, min(since, self.alive_at))
