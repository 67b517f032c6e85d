"""A GPU's health before a long load: what the driver says that will fail it, in words.

Read before each start of vLLM (loop/lifecycle.py) and by `kimi-supervisor doctor`. What the
driver holds now (a row remapping waiting for a reset, one that failed, pages retired and
waiting, uncorrected ECC errors since the driver loaded) is a GPU a 30-minute load will fail
on, or fail soon after: `gpus.health_check = "refuse"` refuses the start for it. What the
kernel's log holds since boot (an Xid) may be the past a reset has since repaired: a warning,
never a refusal by itself. A signal not read is said, and decides nothing (slow is not hung,
and no reading is no evidence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kimi_supervisor.model import GpuHealth

# NVIDIA's Xid catalog: the codes that mean the GPU needs a reset or a replacement.
SERIOUS_XIDS = {
    48: "a double-bit ECC error",
    63: "a row remapping or page retirement recorded",
    64: "a row remapping or page retirement that failed",
    74: "an NVLink error",
    79: "the GPU fell off the bus",
    92: "a high single-bit ECC error rate",
    94: "a contained ECC error",
    95: "an uncontained ECC error",
    119: "a GSP RPC timeout",
    120: "a GSP error",
    154: "a recovery action asked for (a GPU reset or a reboot)",
}


@dataclass(frozen=True)
class HealthVerdict:
    """`failing`: what refuses a start under "refuse"; `warnings`: seen, never a refusal by
    itself; `unread`: signals the driver did not give (none decides anything); `not_read`: the
    GPUs none of whose failing signals (row remapping, page retirement, uncorrected ECC) could
    be read: of those nothing is known, so the health is not "healthy"."""

    failing: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    not_read: list[int] = field(default_factory=list)
    gpus: int = 0

    @property
    def verdict(self) -> str:
        """ "failing", "warnings", "unread" (a GPU, or all, not read), or "healthy"."""
        if self.failing:
            return "failing"
        if self.warnings:
            return "warnings"
        return "unread" if self.not_read or not self.gpus else "healthy"

    @property
    def healthy(self) -> bool:
        return self.verdict == "healthy"

    def text(self) -> str:
        """What was found; the GPUs not read are named whatever else was (a warning about
        one GPU never stands for the health of another that could not be read)."""
        which = tuple(f"GPU {i}: " for i in self.not_read)
        missing = "; ".join(u for u in self.unread if u.startswith(which)) if which else ""
        if self.verdict == "unread":
            return "not read: " + (missing or "no GPU")
        found = "; ".join([*self.failing, *self.warnings]) or "healthy"
        return f"{found}; not read: {missing}" if missing else found


def judge(healths: Sequence[GpuHealth]) -> HealthVerdict:
    v = HealthVerdict(gpus=len(healths))
    for h in healths:
        gpu = f"GPU {h.index}"
        if h.remap_failed:
            v.failing.append(f"{gpu}: a row remapping failed (no spare row: replace the GPU)")
        if h.remap_pending:
            v.failing.append(f"{gpu}: rows remapped, waiting for a GPU reset to take effect")
        if h.retired_pending:
            v.failing.append(f"{gpu}: pages retired, waiting for a GPU reset to take effect")
        if h.ecc_uncorrected:
            v.failing.append(
                f"{gpu}: {h.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded"
            )
        serious = sorted({x for x in h.xids or () if x in SERIOUS_XIDS})
        if serious:
            said = ", ".join(f"Xid {x} ({SERIOUS_XIDS[x]})" for x in serious)
            v.warnings.append(f"{gpu}: the kernel logged {said} since boot")
        if h.nvlink_errors:
            v.warnings.append(f"{gpu}: {h.nvlink_errors} NVLink error(s) on its active links")
        v.unread.extend(f"{gpu}: {u}" for u in h.unread)
        if h.remap_pending is None and h.retired_pending is None and h.ecc_uncorrected is None:
            v.not_read.append(h.index)
    return v


def signals(h: GpuHealth) -> dict[str, object]:
    """One GPU's signals as status and doctor show them (None: not read)."""
    return {
        "index": h.index,
        "remap_pending": h.remap_pending,
        "remap_failed": h.remap_failed,
        "retired_pending": h.retired_pending,
        "ecc_uncorrected": h.ecc_uncorrected,
        "nvlink_errors": h.nvlink_errors,
        "xids": list(h.xids) if h.xids is not None else None,
        "unread": list(h.unread),
    }


def dcgm_flags(signals_: dict[str, object]) -> dict[str, bool | None]:
    """One GPU's signals (as `signals` says them) as 0/1 flags named after DCGM's fields
    (ports/metrics.py's GPU_HEALTH_SIGNALS): True where the signal says the GPU will fail a
    load, None where it was not read."""

    def count(key: str) -> bool | None:
        n = signals_.get(key)
        return None if n is None else bool(n)

    xids = signals_.get("xids")
    return {
        "xid_errors": None if not isinstance(xids, list) else any(x in SERIOUS_XIDS for x in xids),
        "row_remap_pending": count("remap_pending"),
        "row_remap_failure": count("remap_failed"),
        "retired_pending": count("retired_pending"),
        "ecc_dbe_vol_total": count("ecc_uncorrected"),
        "nvlink_errors": count("nvlink_errors"),
    }
