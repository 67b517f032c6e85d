"""Whether a serving vLLM does work. Its engine can hang (a deadlock in a collective, a process
stuck in the driver) while its API server goes on answering /health with 200: vLLM 0.16's health
check reads only an "errored" flag (measured, issue 27: VLLM::EngineCore SIGSTOPped, /health 200
for 10 minutes, every request hanging). So liveness is judged by work, from outside the engine:

- under load, by vLLM's own /metrics: requests running (`vllm:num_requests_running`) while no
  token is produced (`vllm:generation_tokens_total` does not grow) for `stall_s`;
- idle, by a canary: one token asked of the served model, answered within `canary_timeout_s`
  (loop/liveness.py runs it, never while a capture records).

Only a serving vLLM is judged: a loading one (30 minutes and more) never is.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
TOKENS = "vllm:generation_tokens"  # the counter's family; its sample is ..._total


@dataclass(frozen=True)
class Work:
    """vLLM's work counters at one moment, summed over its engines and models."""

    running: float
    tokens: float


def parse(text: str) -> Work | None:
    """`Work` from vLLM's /metrics text; None when either metric is missing (vLLM run with its
    stats off, or not vLLM at all): then only the canary can tell."""
    running = tokens = None
    try:
        for family in text_string_to_metric_families(text):
            if family.name == RUNNING:
                running = sum(s.value for s in family.samples)
            elif family.name == TOKENS:
                tokens = sum(s.value for s in family.samples if s.name.endswith("_total"))
    except ValueError:
        return None
    if running is None or tokens is None:
        return None
    return Work(running, tokens)


@dataclass
class Stall:
    """Since when requests have run with no token produced (`progress_at`: the last moment
    work moved, or nothing ran)."""

    progress_at: float | None = None
    tokens: float | None = None

    def update(self, now: float, work: Work, stall_s: float) -> str | None:
        """Take a reading; the reason vLLM is hung, or None."""
        moved = self.tokens is None or work.tokens != self.tokens
        if moved or work.running <= 0 or self.progress_at is None:
            self.progress_at = now
        self.tokens = work.tokens
        stalled = now - self.progress_at
        if work.running > 0 and stalled >= stall_s:
            return (
                f"{work.running:g} request(s) running and no token produced for {stalled:.0f} s "
                f"(vLLM's /metrics: {TOKENS}_total stayed at {work.tokens:g})"
            )
        return None
