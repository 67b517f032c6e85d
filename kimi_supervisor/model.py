"""Names shared by every layer: modes, teardown steps and outcomes, and the report models.

Plain data only; nothing here has side effects.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import BaseModel, Field


class Mode(enum.StrEnum):
    PRODUCTION = "production"
    PROFILE = "profile"


# The daemon's state, as status, the metrics and kimi-mode name it.
class State(enum.StrEnum):
    BOOTING = "booting"  # waiting for the GPU driver; the world not yet observed
    SERVING = "serving"  # the desired mode runs and answers /health
    # A switch reads the next mode's model files into the page cache; the old mode serves.
    WARMING = "warming"
    TEARING_DOWN = "tearing_down"
    STARTING = "starting"  # the unit was started; waiting for /health 200
    BACKOFF = "backoff"  # vLLM failed; waiting before starting it again
    STUCK = "stuck"  # a teardown could not make the GPUs clean; retried later
    FAILED = "failed"  # too many failures in the window; waits for an operator
    STOPPING = "stopping"  # the daemon is stopping: teardown, then exit


# States in which a mode switch is under way (a second switch joins it or is refused).
SWITCHING_STATES = frozenset({State.WARMING, State.TEARING_DOWN, State.STARTING})
# States in which the loop waits for a point in time before trying again.
WAITING_STATES = frozenset({State.BACKOFF, State.STUCK})


# The one definition of "the unit is up": systemd runs it, or is starting or reloading it.
# (Neither up nor inactive: "deactivating", while systemd stops it.)
UNIT_UP_STATES = frozenset({"active", "activating", "reloading"})


def unit_up(active_state: str) -> bool:
    return active_state in UNIT_UP_STATES


class CapturePhase(enum.StrEnum):
    """Where a profiler capture is: the first five are under way."""

    STARTING = "starting"
    RECORDING = "recording"
    FLUSHING = "flushing"
    SUMMARIZING = "summarizing"
    MEASURING = "measuring"  # the traces saved; serving's tokens/s read once more (stall_after_s)
    DONE = "done"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        return self not in (CapturePhase.DONE, CapturePhase.FAILED)

    @property
    def holds_switch(self) -> bool:
        """vLLM's profiler is at work: a switch (or profile expiry) waits. A summary only reads
        traces already saved, so it holds nothing: however long it takes, a switch goes on."""
        return self in (CapturePhase.STARTING, CapturePhase.RECORDING, CapturePhase.FLUSHING)

    @property
    def stoppable(self) -> bool:
        """Still before the flush: a stop (or a switch) can end the recording."""
        return self in (CapturePhase.STARTING, CapturePhase.RECORDING)


# The windows of a capture's cost to serving (capture/stall.py), in their order.
STALL_WINDOWS = ("before", "recording", "flush", "after")

# A capture's summary, written beside its traces.
SUMMARY = "summary.json"


class Step(enum.StrEnum):
    """Teardown steps, in the order they escalate."""

    STOP_UNIT = "stop_unit"
    KILL_CGROUP = "kill_cgroup"
    KILL_STRAYS = "kill_strays"
    KILL_GPU_HOLDERS = "kill_gpu_holders"
    WAIT_RELEASE = "wait_release"
    HOST_LEFTOVERS = "host_leftovers"
    VERIFY = "verify"


class Outcome(enum.StrEnum):
    CLEAN = "clean"
    STUCK = "stuck"


class Evidence(enum.StrEnum):
    """Why a process was judged to belong to the teardown's targets, strongest first. The last
    two are the GPU evidence ladder's rungs 1 and 2 (teardown/ownership.py); rung 3 (a
    device file only open, or only mapped) is never a reason to kill."""

    UNIT_CGROUP = "in the unit's cgroup"
    ESCAPED_UNIT = "was in the unit's process tree when the teardown began"
    LISTENS_ON_PORT = "listens where vLLM binds, and is vLLM or uses a managed GPU"
    VLLM_SIGNATURE = "carries vLLM's signature and uses a managed GPU"
    RESPAWNS = "its children came back on a managed GPU after being killed"
    NVML_LISTED = "NVML lists it, alive, on a managed GPU whose device file it has open"
    OPEN_AND_MAPPED = (
        "has a managed GPU's device file open and mapped, and no live listed process explains "
        "that GPU's memory"
    )


class Role(enum.StrEnum):
    """What a process that still touches a managed GPU's device files is to an operator."""

    SUSPECT = "suspect"  # rung 1 or 2: it holds the memory, but was not cleared (see why)
    CANDIDATE = "candidate"  # rung 3: might hold it; never killed on that; check by hand
    UNKNOWN = "unknown"  # its mappings could not be read: never killed, never called a monitor
    BYSTANDER = "bystander"  # protected, another GPU's job, or a monitor: not the holder


def utcnow() -> datetime:
    return datetime.now(UTC)


# How much of a process's command line is shown: a title in a line (TITLE_CHARS), the whole of it
# kept in a status (CMDLINE_CHARS).
TITLE_CHARS = 80
CMDLINE_CHARS = 200


def title(cmdline: Sequence[str], comm: str, width: int = TITLE_CHARS) -> str:
    """A process as a person reads it: its command line cut to `width`, else its `comm` (a kernel
    thread, or a process that emptied its argv). The one place a title is made; its control
    characters escaped (`printable`)."""
    return printable(" ".join(cmdline)[:width] or comm)


def printable(text: str) -> str:
    """`text` with its control characters escaped (\\n, \\x1b...): a name another user chose
    (a process's comm or argv, a file's name) reaches sd_notify's newline-separated fields, a
    terminal and a log line, where a newline would add a field of its own ("MAINPID=...") and an
    escape sequence would drive the operator's terminal."""
    if not any(_control(c) for c in text):
        return text
    return "".join(c.encode("unicode_escape").decode("ascii") if _control(c) else c for c in text)


def _control(c: str) -> bool:
    """C0 controls, DEL and C1 controls: what a terminal or sd_notify acts on."""
    o = ord(c)
    return o < 0x20 or 0x7F <= o < 0xA0


# Programs that run another one named in their argv: a line names the one they run.
INTERPRETERS = ("python", "pypy", "perl", "ruby", "node", "bash", "sh", "dash")
_VALUED = frozenset({"-X", "-W", "-Q", "--check-hash-based-pycs"})


def program(cmdline: Sequence[str] | str, comm: str) -> str:
    """The program a process runs, as a person reads it (`_program`), its control characters
    escaped: its argv is its owner's to choose, and a line showing it goes to a terminal."""
    return printable(_program(cmdline, comm))


def _program(cmdline: Sequence[str] | str, comm: str) -> str:
    """The program a process runs, as a line that names it says it: the module or script an
    interpreter runs (`python3 -m vllm.entrypoints.openai.api_server ...` ->
    `vllm.entrypoints.openai.api_server`; `/opt/vllm/bin/python /opt/vllm/bin/vllm serve ...`
    -> `vllm serve`), else the name of argv[0] and its sub-command (`VLLM::Worker_TP0`,
    `nvidia-persistenced`), else `comm`. A command line given as one string (a status's) is
    split at its spaces."""
    argv = cmdline.split() if isinstance(cmdline, str) else list(cmdline)
    if not argv:
        return comm
    head, rest = argv[0].rsplit("/", 1)[-1], argv[1:]
    if head.rstrip("0123456789.") in INTERPRETERS:
        i = 0
        while i < len(rest):
            a = rest[i]
            if a == "-c":  # the code it runs: its start, quoted (a kill line said nothing)
                return f"{head} -c {_snippet(rest[i + 1])}" if i + 1 < len(rest) else head
            if a == "-m":
                if i + 1 >= len(rest):
                    return head
                return _with_command(rest[i + 1], rest[i + 2 :])
            if not a.startswith("-"):
                return _with_command(a.rsplit("/", 1)[-1], rest[i + 1 :])
            i += 2 if a in _VALUED else 1
        return head
    return _with_command(head, rest) or comm


def _snippet(code: str, most: int = 40) -> str:
    """`python -c`'s code as a kill line names it: its words on one line, the first `most`
    characters and "..." if there are more, quoted."""
    words = " ".join(code.split())
    return repr(words if len(words) <= most else words[:most].rstrip() + "...")


def _with_command(name: str, after: Sequence[str]) -> str:
    """`name` and its sub-command, when the next word is one (`vllm serve`), not an option or
    a path."""
    nxt = after[0] if after else ""
    if nxt and nxt.isidentifier() and nxt.islower():
        return f"{name} {nxt}"
    return name


class ProcessDescription(BaseModel):
    pid: int
    start_time: float = Field(description="process start, seconds since the epoch")
    state: str = ""
    comm: str = ""
    cmdline: list[str] = Field(default_factory=list)
    cgroup: str = ""

    def title(self, width: int = TITLE_CHARS) -> str:
        return title(self.cmdline, self.comm, width)


class KillRecord(BaseModel):
    """One signal sent: the audit trail of a teardown."""

    at: datetime
    signal: str
    step: Step
    evidence: Evidence
    reason: str
    process: ProcessDescription
    result: str = Field(description="delivered, already gone, or why it was not sent")


def at_baseline(used_mib: int, baseline_mib: int, tolerance_mib: int, *, holders: Sized) -> bool:
    """What "clean" means for one GPU, everywhere: memory within tolerance of its baseline, and
    no process listed on it."""
    return used_mib <= baseline_mib + tolerance_mib and not len(holders)


class DeviceReading(BaseModel):
    index: int
    used_mib: int
    baseline_mib: int
    tolerance_mib: int
    processes: list[int] = Field(default_factory=list)

    @property
    def clean(self) -> bool:
        return at_baseline(
            self.used_mib, self.baseline_mib, self.tolerance_mib, holders=self.processes
        )


class StepReport(BaseModel):
    step: Step
    started_at: datetime
    duration_s: float
    skipped: bool = False
    note: str = ""
    devices_after: list[DeviceReading] = Field(default_factory=list)


class RemainingHolder(BaseModel):
    """A process left touching a managed GPU when a teardown ends STUCK, and what it is."""

    process: ProcessDescription
    unit: str = ""
    devices: list[int] = Field(default_factory=list)
    not_cleared_by: Step
    why: str
    role: Role = Role.SUSPECT
    seen: str = Field(default="", description="what was seen: listed, open, mapped")
    check: str = Field(default="", description="what an operator should check")


class TeardownReport(BaseModel):
    unit: str
    started_at: datetime
    duration_s: float = 0.0
    outcome: Outcome = Outcome.STUCK
    steps: list[StepReport] = Field(default_factory=list)
    kills: list[KillRecord] = Field(default_factory=list)
    devices: list[DeviceReading] = Field(default_factory=list)
    remaining: list[RemainingHolder] = Field(default_factory=list)
    shm_removed: list[str] = Field(default_factory=list)
    diagnosis: str = ""
    next_action: str = ""


def shown(name: str) -> str:
    """A file's name as it may be shown: one that is not UTF-8 (Python hands its bytes on as
    lone surrogates) with its odd bytes escaped, never a string that no JSON, journal or
    sd_notify can carry (an outside review: such a name in the model's folder wedged status
    and crashed the daemon)."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("ascii")


@dataclass(frozen=True)
class GpuHealth:
    """What the driver and the kernel say of one GPU's health; each field None where this GPU,
    its driver or the host cannot say (`unread` says why). Read before a mode's load starts
    (decide/gpuhealth.py judges it) and by `kimi-supervisor doctor`."""

    index: int
    # Row remapping (A100 and later: the H100/H200's way of repairing memory): rows remapped
    # and waiting for a GPU reset to take effect, and a remapping that failed (no spare row).
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    # Page retirement (before the A100): pages retired, waiting for a reset.
    retired_pending: bool | None = None
    # Uncorrected ECC errors since the driver loaded (volatile), all memory locations.
    ecc_uncorrected: int | None = None
    # NVLink errors (CRC, replay, recovery) summed over the GPU's active links; None: no NVLink.
    nvlink_errors: int | None = None
    # The Xid codes the kernel's log holds for this GPU since boot (NVRM: Xid (PCI:...): N).
    xids: tuple[int, ...] | None = None
    unread: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProcessTimes:
    """One process's CPU times at one moment (/proc/PID/stat): seconds, all its threads."""

    pid: int
    start_ticks: int  # with `pid`, the process's identity (a PID is reused)
    ppid: int
    state: str  # R, S, D, T, t, Z...
    cpu_s: float  # user and system, its own and its reaped children's (utime..cstime)
    # Its children's that it has waited for (cutime + cstime) alone: a child that ended (a
    # compiler run per kernel) moves its whole time here when it is reaped. A process that
    # merely spins never grows it.
    reaped_s: float


@dataclass(frozen=True)
class GpuActivity:
    """One GPU's own counters at one moment (NVML), read by the liveness probe: what tells a
    kernel that spins on a flag (a collective stuck on the GPU: busy, no memory traffic, idle
    power) from work (decide/liveness.py). Each field None where it could not be read
    (`unread` says why; not supported is said so too): no reading is never "idle"."""

    index: int
    util_gpu: float | None = None  # % of the last sample period a kernel ran
    util_memory: float | None = None  # % of it the device memory was read or written
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    pcie_mb_s: float | None = None  # sent and received over PCIe, MB/s (NVML's 20 ms sample)
    # NVLink data sent and received, KiB since the driver loaded, over every link (a counter:
    # its rate is taken between two readings); None where the GPU has no NVLink.
    nvlink_kib: float | None = None
    unread: tuple[str, ...] = ()
    # The processes NVML lists on this GPU (compute and graphics contexts), host PIDs as NVML
    # gives them (one in another PID namespace may read 0, or a PID that is nobody here); None
    # where the list could not be read (said in `unread`).
    pids: tuple[int, ...] | None = None
    # Those of `pids` that are not vLLM's (the probe knows its processes: loop/liveness.py): a
    # GPU shared with another's process has counters that say nothing of vLLM's work.
    foreign: tuple[int, ...] = ()
    # NVML's per-process samples newer than the GPU's previous reading (often one a process: its
    # last sample period, measured on an H100): (PID, % of the time a kernel of it ran, % the
    # memory was read or written for it), the highest of each; () where none was taken, None
    # where the GPU cannot sample processes. A process is sampled only while it
    # lives: one that ended before the reading is in neither `pids` nor here (measured on an
    # H100: bench/process_samples_probe.py), but its traffic is in the counters above.
    samples: tuple[tuple[int, float, float], ...] | None = None
    # vLLM's own processes' highest (kernel %, memory %) among `samples` (the probe knows its
    # PIDs), None where none of them was sampled: work that is vLLM's, whoever else used the
    # GPU between two readings.
    own: tuple[float, float] | None = None
