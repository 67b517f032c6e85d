"""What a capture cost the clients that vLLM served meanwhile, from vLLM's own counters.

vLLM's /metrics is read at each edge of a capture: before it (the liveness probe's reading,
taken at least `MIN_BEFORE_S` earlier), when the profiler starts, when the flush begins, when
it ends, and `profiling.stall_after_s` later. Between two readings of one vLLM, its generated
token counter gives tokens/s; its error counters give the requests that failed. The windows:

    before     the last liveness reading -> /start_profile answered
    recording  /start_profile answered -> /stop_profile sent
    flush      /stop_profile sent -> answered (vLLM 0.16 exports the trace on its engine's loop:
               no step, no token, while it writes)
    after      /stop_profile answered -> stall_after_s later

A window whose edges are missing (no reading, /metrics not answering, no vllm:* series) or
whose counters went back (another vLLM answers: a restart in between) is not measured, and the
record says why: never a rate made up from half a window. A counter is believed only within what
a host can do (MAX_TOKENS_PER_S, MAX_REQUESTS_PER_S): a jump past it is not measured either, and
neither is any window after a reset or a jump (whose counters would they be?).

The counters, as vLLM 0.16 writes them (seen on the real-vLLM tier; a copy of a whole answer is
tests/fixtures/vllm-0.16-metrics.txt):

    vllm:generation_tokens_total{engine,model_name}             tokens generated
    vllm:request_success_total{engine,finished_reason,...}      finished_reason error: failed;
                                                                abort: its client gave up
    http_requests_total{handler,method,status}                  status "5xx": failed
                                                                (prometheus_fastapi_instrumentator,
                                                                status codes grouped)

The profiler's own routes are not the clients': their answers are the capture's, not counted.
Pure: the readings come in as text and monotonic times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kimi_supervisor.model import STALL_WINDOWS

# The liveness reading that opens the "before" window is at least this old: a reading taken a
# moment before the capture says nothing of a rate.
MIN_BEFORE_S = 5.0
# Routes whose answers belong to the capture itself.
PROFILER_ROUTES = ("/start_profile", "/stop_profile")
WINDOWS = STALL_WINDOWS


@dataclass(frozen=True)
class Sample:
    """vLLM's counters at one moment (`at`: monotonic seconds), summed over engines and
    models."""

    at: float
    tokens: float
    failed: float = 0.0  # 5xx answers to clients, and requests vLLM ended with an error
    aborted: float = 0.0  # requests whose clients went away
    # When the answering API server started (its process_start_time_seconds, Unix time): two
    # readings with different ones are two vLLMs, whatever their counters say. None: unknown.
    started: float | None = None


def sample_of(text: str, at: float) -> Sample | str:
    """The counters in a /metrics answer, or why there is no reading: no generated-token
    counter (vLLM's stats off, a renamed metric, not vLLM), or a counter that is no count (not
    finite, negative: nothing a rate or a number of requests can be made of)."""
    tokens: float | None = None
    failed = aborted = 0.0
    started: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            name = family.name
            if family.type == "unknown":
                name = name.removesuffix("_total")
            for s in family.samples:
                if s.name == "process_start_time_seconds":
                    started = s.value if math.isfinite(s.value) else None
                    continue
                if not s.name.endswith("_total"):
                    continue  # a counter's _created
                counted = name in ("vllm:generation_tokens", "vllm:request_success")
                if (counted or name == "http_requests") and not _count(s.value):
                    return f"/metrics: {s.name} is {s.value!r}, not a count"
                if name == "vllm:generation_tokens":
                    tokens = (tokens or 0.0) + s.value
                elif name == "vllm:request_success":
                    reason = s.labels.get("finished_reason")
                    if reason == "error":
                        failed += s.value
                    elif reason == "abort":
                        aborted += s.value
                elif name == "http_requests" and _client_failure(s.labels):
                    failed += s.value
    except ValueError as e:
        return f"/metrics is not Prometheus text ({str(e)[:80]})"
    if tokens is None:
        return "/metrics has no vllm:generation_tokens_total"
    return Sample(at, tokens, failed, aborted, started)


# A counter past this is no count of tokens or requests (float64 counts exactly to 2**53).
MAX_COUNT = float(2**53)
# The most tokens per second any host generates, with a wide margin: an 8-GPU H200 host makes
# some 10^4 to 5 * 10^4 generated tokens/s at its largest batches; 20 times the top of that.
# A counter that rose faster was not counting this vLLM's tokens (a fake, a bug, a wrap).
MAX_TOKENS_PER_S = 1_000_000.0
# A vLLM's own ceiling is 10 times the fastest it has shown, never below this (the top of what
# a host makes: a vLLM idle until a capture may serve that much during it).
MIN_CEILING = 50_000.0
# Likewise for requests failed or given up: a host finishes some 10^3 requests/s at most.
MAX_REQUESTS_PER_S = 100_000.0


def _count(value: float) -> bool:
    return math.isfinite(value) and 0 <= value <= MAX_COUNT


@dataclass(frozen=True)
class Window:
    name: str
    seconds: float | None
    tokens_per_s: float | None
    why_not: str = ""  # why no rate: the window was not measured

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seconds": None if self.seconds is None else round(self.seconds, 2),
            "tokens_per_s": None if self.tokens_per_s is None else round(self.tokens_per_s, 2),
        }
        if self.why_not:
            out["not_measured"] = self.why_not
        return out


def window(
    name: str, a: Sample | str | None, b: Sample | str | None, *, ceiling: float = MAX_TOKENS_PER_S
) -> Window:
    """The rate between two readings (believed up to `ceiling` tokens/s). A str in place of a
    reading says why it is missing."""
    if not isinstance(a, Sample):
        return Window(name, None, None, a or "not reached")
    if not isinstance(b, Sample):
        return Window(name, None, None, b or "not reached")
    seconds = b.at - a.at
    if (why := _other_vllm(a, b)) is not None:
        return Window(name, seconds, None, why)
    if seconds <= 0:
        return Window(name, seconds, None, "no time between its readings")
    if (why := _beyond_a_host(a, b, ceiling)) is not None:
        return Window(name, seconds, None, why)
    return Window(name, seconds, (b.tokens - a.tokens) / seconds)


def ceiling_of(readings: list[tuple[float, int, float]], pid: int) -> float:
    """The most tokens/s believed of vLLM `pid` during a capture: 10 times the fastest it has
    shown between two liveness readings (monotonic, MainPID, tokens), at least MIN_CEILING (a
    vLLM idle until now may serve a host's top rate), at most MAX_TOKENS_PER_S."""
    mine = sorted((at, tokens) for at, p, tokens in readings if p == pid)
    rates = [(t2 - t1) / (a2 - a1) for (a1, t1), (a2, t2) in itertools.pairwise(mine)
             if a2 > a1]  # fmt: skip
    fastest = max([r for r in rates if r > 0], default=0.0)
    return min(MAX_TOKENS_PER_S, max(10 * fastest, MIN_CEILING))


def _beyond_a_host(a: Sample, b: Sample, ceiling: float = MAX_TOKENS_PER_S) -> str | None:
    """Why the counters between `a` and `b` rose faster than believed, or None."""
    seconds = max(b.at - a.at, 1e-3)
    rate = (b.tokens - a.tokens) / seconds
    if rate > ceiling:
        return (
            f"the token counter rose by {b.tokens - a.tokens:.3g} in {seconds:.1f} s "
            f"({rate:.3g} tokens/s), past what this vLLM can make ({ceiling:.3g}/s: 10 times "
            f"its fastest, within {MIN_CEILING:.0g} and {MAX_TOKENS_PER_S:.0g})"
        )
    requests = (b.failed - a.failed) + (b.aborted - a.aborted)
    if requests / seconds > MAX_REQUESTS_PER_S:
        return (
            f"the failed-request counters rose by {requests:.3g} in {seconds:.1f} s, past what "
            f"any host serves ({MAX_REQUESTS_PER_S:.0g}/s)"
        )
    return None


@dataclass(frozen=True)
class Stall:
    windows: tuple[Window, ...]
    failed: int | None  # requests that failed from the start of the capture to its last reading
    aborted: int | None

    @classmethod
    def of(
        cls,
        edges: Sequence[Sample | str | None],
        *,
        ceiling: float = MAX_TOKENS_PER_S,
    ) -> Stall:
        assert len(edges) == len(WINDOWS) + 1, edges  # before, start, flushing, flushed, after
        start = edges[1]
        windows: list[Window] = []
        broken = ""  # the window whose counters went back or jumped: none after it is believed
        for i, n in enumerate(WINDOWS):
            w = window(n, edges[i], edges[i + 1], ceiling=ceiling)
            if broken and w.tokens_per_s is not None:
                w = Window(n, w.seconds, None, f"after the counters broke in the {broken} window")
            elif not broken and _broke(edges[i], edges[i + 1], ceiling):
                broken = n
            windows.append(w)
        # Failures from the capture's start to its last reading, every reading between of the
        # same vLLM and within what a host does.
        failed: int | None = None
        aborted: int | None = None
        if isinstance(start, Sample):
            last: Sample | None = None
            for e in edges[2:]:
                if not isinstance(e, Sample):
                    continue
                if _broke(last or start, e, ceiling):
                    break
                last = e
            if last is not None:
                failed = round(last.failed - start.failed)
                aborted = round(last.aborted - start.aborted)
        return cls(tuple(windows), failed, aborted)

    def get(self, name: str) -> Window:
        return next(w for w in self.windows if w.name == name)

    @property
    def slowdown(self) -> float | None:
        """1 - recording/before: the share of tokens/s the recording cost (None: unmeasured,
        or nothing was served before)."""
        b, r = self.get("before").tokens_per_s, self.get("recording").tokens_per_s
        if b is None or r is None or b <= 0:
            return None
        return 1 - r / b

    def as_dict(self) -> dict[str, Any]:
        slowdown = self.slowdown
        return {
            **{w.name: w.as_dict() for w in self.windows},
            "slowdown": None if slowdown is None else round(slowdown, 4),
            "failed": self.failed,
            "aborted": self.aborted,
        }

    def line(self) -> str:
        """One sentence for the capture's message: "serving: 412 tokens/s before, 380 while
        recording (8 % slower), 0 in the 12.3 s flush, 405 after; no request failed"."""
        parts = []
        for w in self.windows:
            label = {
                "before": "before",
                "recording": "while recording",
                "flush": f"in the {w.seconds:.1f} s flush" if w.seconds is not None else "flush",
                "after": "after",
            }[w.name]
            if w.tokens_per_s is None:
                parts.append(f"{label} not measured ({w.why_not})")
                continue
            text = f"{w.tokens_per_s:.0f} tokens/s {label}"
            if w.name == "recording" and self.slowdown is not None:
                text += f" ({_change(self.slowdown)})"
            parts.append(text)
        if self.failed is None:
            told = "failed requests not counted (no reading spans the capture)"
        elif self.failed == 0 and not self.aborted:
            told = "no request failed"
        else:
            told = f"{self.failed} request(s) failed, {self.aborted} given up by their clients"
        return "serving: " + ", ".join(parts) + "; " + told


def _client_failure(labels: dict[str, str]) -> bool:
    """An HTTP 5xx answer to a client (the profiler's routes are the capture's own)."""
    return labels.get("status", "").startswith("5") and labels.get("handler") not in PROFILER_ROUTES


def _broke(a: Sample | str | None, b: Sample | str | None, ceiling: float) -> bool:
    """Whether two readings are of one vLLM whose counters then went back or jumped."""
    if not isinstance(a, Sample) or not isinstance(b, Sample):
        return False
    return _other_vllm(a, b) is not None or _beyond_a_host(a, b, ceiling) is not None


def _other_vllm(a: Sample, b: Sample) -> str | None:
    """Why `b` is not a later reading of the vLLM that gave `a`, or None: its API server
    started at another time, or a counter went back (counters start again at 0)."""
    if a.started is not None and b.started is not None and a.started != b.started:
        return "another vLLM answered (its API server started at another time)"
    if b.tokens < a.tokens or b.failed < a.failed or b.aborted < a.aborted:
        return "vLLM's counters went back: another vLLM answered"
    return None


def _change(slowdown: float) -> str:
    pct = abs(slowdown) * 100
    if pct < 0.5:
        return "no slower"
    return f"{pct:.0f} % {'slower' if slowdown > 0 else 'faster'}"


def pick_before(readings: list[tuple[float, int, float]], pid: int, now: float) -> Sample | str:
    """The liveness reading that opens the "before" window: of (monotonic, MainPID, tokens)
    readings, the newest of this vLLM's taken at least MIN_BEFORE_S before `now`; else why
    there is none."""
    mine = [(at, tokens) for at, p, tokens in readings if p == pid]
    if not mine:
        return "no liveness reading of this vLLM yet"
    old = [(at, tokens) for at, tokens in mine if now - at >= MIN_BEFORE_S]
    if not old:
        return f"its only reading is under {MIN_BEFORE_S:g} s old"
    at, tokens = max(old)
    return Sample(at, tokens)
