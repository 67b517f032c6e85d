"""Liveness while vLLM serves (decide/liveness.py judges): its /metrics read every
`liveness.metrics_interval_s`, and, when nothing runs, a one-token canary every
`canary_interval_s`. Both run on a thread of their own, so that a hung vLLM, which may take
`canary_timeout_s` not to answer, never holds the loop; the reading comes back through the inbox
(LivenessSeen) and the loop judges it. No canary while a capture records (it would be in the
traces), and none while requests run (the metrics say enough then).

A canary that gets an answer, even an error (the model's name refused, HTTP 400), is not a hang:
it is shown as a warning, and only the metrics judge. Only no answer within the timeout is.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kimi_supervisor.config import Config
from kimi_supervisor.decide.liveness import Stall, Work, parse
from kimi_supervisor.ports.http import HttpResult, request

# vLLM's /metrics is some 100 KB with its histograms; more than this is not vLLM's.
MAX_METRICS_BYTES = 4 << 20


@dataclass(frozen=True)
class Canary:
    answered: bool  # the server said something (an HTTP error is an answer)
    ok: bool  # and it was a completion
    took_s: float
    detail: str
    tokens: int = 0  # prompt and completion, as vLLM counted them (its answer's `usage`)


@dataclass(frozen=True)
class Reading:
    pid: int
    work: Work | None
    canary: Canary | None


def _timed_out(r: HttpResult) -> bool:
    return r.status == 0 and "timed out" in r.error


def canary(url: str, prompt: str, timeout_s: float) -> Canary:
    """One token of the served model (its name from /v1/models)."""
    t0 = time.monotonic()
    models = request(f"{url}/v1/models", "GET", timeout_s, max_bytes=1 << 16)
    if not models.ok:
        took = time.monotonic() - t0
        return Canary(not _timed_out(models), False, took, f"/v1/models: {models.error}")
    try:
        model = json.loads(models.body)["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return Canary(True, False, time.monotonic() - t0, "/v1/models named no model")
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = request(f"{url}/v1/completions", "POST", timeout_s, json_body=body)
    took = time.monotonic() - t0
    if r.ok:
        try:
            tokens = int(json.loads(r.body)["usage"]["total_tokens"])
        except (ValueError, KeyError, TypeError):
            tokens = 0
        return Canary(True, True, took, "", tokens)
    return Canary(not _timed_out(r), False, took, f"/v1/completions: {r.error} {r.body[:200]}")


class Liveness:
    """Owned by the loop thread: when to probe, and what each reading means."""

    def __init__(self, config: Config, put: Callable[[Reading], None]) -> None:
        self.config = config
        self._put = put
        self._pid = 0
        self._probing = False
        self._next_probe = 0.0
        self._next_canary = 0.0
        self.stall = Stall()

    @property
    def next_probe(self) -> float:
        """When the next probe falls due (the loop's clock): a pass is due then, too."""
        return self._next_probe

    def serving(self, pid: int, now: float, capturing: bool) -> None:
        """A pass while `pid` serves: a probe, if one is due and none runs."""
        c = self.config.liveness
        if not c.enabled:
            return
        if pid != self._pid:  # a new vLLM: judged from its own first reading
            self._pid, self.stall = pid, Stall()
            self._next_probe, self._next_canary = now, now + c.canary_interval_s
        if self._probing or now < self._next_probe:
            return
        self._probing = True
        self._next_probe = now + c.metrics_interval_s
        want_canary = not capturing and now >= self._next_canary
        v = self.config.vllm
        url = f"http://{v.host}:{v.port}"
        threading.Thread(
            target=self._probe, args=(pid, url, want_canary), name="liveness", daemon=True
        ).start()

    def _probe(self, pid: int, url: str, want_canary: bool) -> None:
        c = self.config.liveness
        try:
            r = request(f"{url}/metrics", "GET", c.canary_timeout_s, max_bytes=MAX_METRICS_BYTES)
            work = parse(r.body) if r.ok else None
            idle = work is None or work.running <= 0
            probe = (
                canary(url, c.canary_prompt, c.canary_timeout_s) if want_canary and idle else None
            )
        except Exception:  # a reading must always come back, or no probe would run again
            work, probe = None, None
        self._put(Reading(pid, work, probe))

    def seen(self, reading: Reading, now: float) -> str | None:
        """The reading applied: why the vLLM is hung, or None."""
        self._probing = False
        c = self.config.liveness
        if reading.pid != self._pid:
            return None
        if reading.canary is not None:
            self._next_canary = now + c.canary_interval_s
            if not reading.canary.answered:
                return (
                    f"idle, and a one-token request got no answer within "
                    f"{c.canary_timeout_s:g} s ({reading.canary.detail})"
                )
        if reading.work is not None:
            return self.stall.update(now, reading.work, c.stall_s)
        return None
