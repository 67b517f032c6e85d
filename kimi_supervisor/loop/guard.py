"""The loop's passes, guarded: an unexpected error in one never ends the daemon.

A pass reads ports (NVML, /proc, systemd, the disk); a port failing in a way it was not written
for must not end the loop, or systemd restarts the daemon into the same error, gives up, and
vLLM runs unsupervised (issue 26: "GPU is lost" from NVML, five restarts in 15 s, then failed).
The error is logged, counted, shown in status, and the pass is tried again after a doubling
delay; the next pass that goes through clears it.
"""

from __future__ import annotations

from collections.abc import Callable

from kimi_supervisor.loop.context import Context

# A pass that failed unexpectedly is retried after 1 s, doubling up to 5 minutes.
STEP_RETRY_S = 1.0
STEP_RETRY_MAX_S = 300.0
STEP_FAILED = "the loop's pass failed"


class StepGuard:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.failures = 0  # passes in a row that ended in an unexpected error

    def run(self, step: Callable[[], None]) -> float | None:
        """Run one pass; after an unexpected error, the delay before the next try (None after
        a pass that went through)."""
        try:
            step()
        except Exception as e:
            self.failures += 1
            delay = min(STEP_RETRY_S * 2.0 ** (self.failures - 1), STEP_RETRY_MAX_S)
            self.ctx.log(
                "step_failed", level="error", error=repr(e), failures=self.failures,
                retry_in_s=delay,
            )  # fmt: skip
            self.ctx.unwarn(STEP_FAILED)
            self.ctx.warn(
                f"{STEP_FAILED} ({type(e).__name__}: {e}); {self.failures} in a row, "
                f"retrying in {delay:g} s"
            )
            return delay
        if self.failures:
            self.ctx.log("step_recovered", failures=self.failures)
            self.ctx.unwarn(STEP_FAILED)
            self.failures = 0
        return None
