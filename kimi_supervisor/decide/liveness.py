"""Whether a serving vLLM makes progress. Its engine can hang (a deadlock, a process stuck in the
driver, a frozen worker) while its API server goes on answering /health with 200: vLLM 0.16's
health check reads only an "errored" flag (measured, issue 27: VLLM::EngineCore SIGSTOPped,
/health 200 for 10 minutes, every request hanging). A "hung" verdict costs a teardown and a
model load (30 minutes on the real host), so it is as bad as a killed bystander when it is false.

Busy is not dead and slow is not hung: a verdict needs two independent signals of no progress,
one of them from outside vLLM's HTTP server:

- **the engine's processes** (`VLLM::EngineCore` and its workers, with their own children, a
  JIT compiler's; each process with its reaped children's time; the whole tree where vLLM
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
| a capture starts, records or flushes | none; the stall counts again from its end |
| work pending, counters still for `stall_s`, CPU flat or a process stopped | hung |
| work pending, counters still for `stall_s`, CPU busy (a long step, a flush) | a doubt |
| nothing pending (counters' idle) | not hung (the canary judges) |
| canary unanswered, CPU flat or a process stopped | hung |
| canary unanswered, the engine busy, or its API servers at a quarter core (once) | a doubt |
| canary answered, even with an error | not hung (an error is warned of) |
| /metrics with no `vllm:*` series (stats off, a renamed metric) | "absent": CPU and canary judge |
| /metrics unreachable or too slow | no work reading: the stall neither grows nor resets |
| the engine's processes unreadable | no CPU signal: never hung |

A doubt is no verdict: shown in status, alerted on after 15 minutes, and kept until a proof of
progress. The last proof of progress (a counter that moved, a canary answered) is when a hang's
unavailable window starts; "nothing pending" is no proof: a frozen engine's gauges are frozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

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


def no_progress(base: Cpu | None, cpu: Cpu | None, idle_fraction: float) -> str:
    """Why the processes show no progress from `base` to `cpu` ("" if they do, or cannot be
    read). A process counts as stopped only if it was stopped at both ends and its own CPU
    time did not grow between them: a sampling profiler (py-spy stops its target for each
    sample: state t in 44-58 % of reads of a busy real EngineCore at 100 Hz) or a debugger's
    moment during a long step is no hang. The sum going down (a process left the tree) says
    nothing."""
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
    used = cpu.seconds - base.seconds
    if 0 <= used < idle_fraction * took:
        return (
            f"{cpu.processes} process(es) used {used:.2f} s of CPU in {took:.0f} s "
            f"(under {idle_fraction:.0%} of one core)"
        )
    return ""


def health_failure(
    health: int, slow: bool, tree: Sequence[Cpu], window_s: float, idle_fraction: float
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
    progress_at: float | None = None  # since when no stall (progress, or nothing pending)
    cpu_at_progress: Cpu | None = None  # the engine's CPU then
    # The last proof of progress (a counter that moved, a canary answered): where a hang's
    # window starts. "Nothing pending" is none: a frozen engine's gauges are frozen too. A
    # counter that a reading sees moved moved after the reading before, so that one's time is
    # taken: the window is never shorter than what clients went without (taken at the reading
    # that saw it, the window was up to one metrics interval short, issue 41's review).
    alive_at: float | None = None
    read_at: float | None = None  # the last reading's time that had the counters
    counters: tuple[float | None, float | None, float] | None = None
    metrics: str = "unknown"  # "ok", "absent" (no vllm:* series), "unreachable"
    # One signal says no progress and the other does not (not hung): why, and since when. It
    # lasts until a proof of progress, so that an engine that spins on a GPU that never
    # answers (a hung collective: bench/cuda_wait_cpu.py) is shown, and alerted on, for as
    # long as it lasts; the daemon never restarts on it.
    doubt: str = ""
    doubt_since: float | None = None
    api_held = 0  # canaries in a row held, it seemed, behind busy API servers (API_HELD_CANARIES)
    samples: list[tuple[float, Cpu]] = field(default_factory=list)  # the engine's CPU, in time

    def progress(self, now: float, cpu: Cpu | None) -> None:
        self.progress_at, self.cpu_at_progress = now, cpu

    def cpu_signal(self, base: Cpu | None, cpu: Cpu | None) -> str:
        return no_progress(base, cpu, self.cpu_idle_fraction)

    def capturing(self, now: float, cpu: Cpu | None) -> None:
        """A capture starts, records or flushes: no verdict, and the stall starts again."""
        self.progress(now, cpu)
        self.counters = None

    def seen(
        self,
        now: float,
        work: Work | None,
        metrics: str,
        cpu: Cpu | None,
        canary: tuple[bool, float, Cpu | None] | None = None,
        others_s: float | None = None,
    ) -> Hang | None:
        """One reading: the work counters (None: no reading; `metrics` says why), the engine's
        CPU, and the canary if one was sent (answered, seconds taken, the engine's CPU when it
        was sent); `others_s`: the CPU seconds vLLM's other processes (its API servers) used
        while the canary waited. Returns the verdict, or None."""
        self.metrics = metrics
        if self.progress_at is None:
            self.progress(now, cpu)
            self.alive_at = now
        if cpu is not None:
            self.samples.append((now, cpu))
            self.samples = [(t, c) for t, c in self.samples if t >= now - 2 * self.stall_s]
        if work is not None:
            # The reading before with counters (one without them says nothing of when they
            # moved: taken from it, the window was one interval short, an outside review).
            before, self.read_at = self.read_at, now
            moved = self.counters is not None and work.counters() != self.counters
            if moved or work.pending <= 0 or self.counters is None:
                self.progress(now, cpu)
            if moved:
                self.alive_at = before if before is not None else now
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
                self.doubt, self.doubt_since = "", None
            return None
        if stalled:
            assert work is not None
            # Over the last stall_s: an engine busy for a while that then deadlocked is
            # noticed stall_s after it stopped, not once its average falls.
            base = self.cpu_at_progress
            for t, c in self.samples:
                if since <= t <= now - self.stall_s:
                    base = c
            cpu_why = self.cpu_signal(base, cpu)
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
        if work is not None:
            evidence |= {
                "running": work.running,
                "waiting": work.waiting,
                "steps": work.steps,
                "prompt_tokens": work.prompt_tokens,
                "tokens": work.tokens,
            }
        if cpu is not None:
            evidence |= {"cpu_s": round(cpu.seconds, 2), "stopped": list(cpu.stopped)}
        if canary is not None:
            evidence |= {"canary_answered": canary[0], "canary_s": round(canary[1], 1)}
            if others_s is not None:
                evidence["api_cpu_s"] = round(others_s, 2)
        if not cpu_why:
            # One signal alone: a slow answer, or a step longer than stall_s. Not a verdict.
            if not busy:
                why = "are busy" if cpu is not None else "cannot be read"
                busy = f"the engine's processes {why}"
            self.doubt = f"{work_why}, but {busy}: not hung"
            if self.doubt_since is None:
                self.doubt_since = since if stalled else now - canary[1] if canary else now
            return None
        assert self.alive_at is not None
        evidence["since_alive_s"] = round(now - self.alive_at, 1)
        return Hang(f"{work_why}; the engine: {cpu_why}", evidence, min(since, self.alive_at))
