"""The configuration: one TOML file validated by pydantic models.

Every error names the file, the key path and the reason (kimi_supervisor/configfile.py reads
and parses the file). Nothing outside these two modules touches the host before `load_config`
has returned, so a bad file never leaves half-done work behind. A key's comment here is its
description in kimi-supervisor.toml(5) (cli/configdoc.py).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import threading
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kimi_supervisor.model import Mode
from kimi_supervisor.paths import scratch_dir
from kimi_supervisor.tomlwrite import to_toml

# Every number is finite (allow_inf_nan=False below) and bounded: a duration beyond these is a
# typo, and an unbounded one overflows the dates and deadlines computed from it.
DAY_S = 86400.0
MAX_SECONDS = 30 * DAY_S  # any timeout, interval or window
MAX_PROFILE_S = 366 * DAY_S  # how long profile mode may be asked for
PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]


class ConfigError(Exception):
    """A configuration file that cannot be used; the message says where and why."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ServiceConfig(_Strict):
    # The systemd unit that runs vLLM (it must exec `kimi-supervisor launch-vllm`, as the
    # shipped vllm-kimi-k25.service does).
    unit: str = "vllm-kimi-k25.service"

    @field_validator("unit")
    @classmethod
    def _is_service(cls, v: str) -> str:
        if not v.endswith(".service") or "/" in v:
            raise ValueError("must be a unit name ending in .service, e.g. vllm-kimi-k25.service")
        return v


class SystemdConfig(_Strict):
    # Which manager runs the unit: the system's, or a user manager (the sandbox's).
    scope: Literal["system", "user"] = "system"
    # Only for scope = "user": the D-Bus address of the user manager's bus. Empty: taken from
    # DBUS_SESSION_BUS_ADDRESS at run time.
    bus_address: str = ""


RESOLVE_TIMEOUT_S = 5.0


def one_address(host: str) -> str:
    """`host` as the one literal address it names; ValueError says why not and what to write.
    A name is looked up (/etc/hosts first, as everywhere), bounded: a resolver that does not
    answer never holds the daemon's start."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    got: list[set[str] | BaseException] = []

    def look_up() -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            got.append({str(info[4][0]) for info in infos})
        except (OSError, UnicodeError) as e:
            got.append(e)

    t = threading.Thread(target=look_up, daemon=True, name="resolve-vllm-host")
    t.start()
    t.join(RESOLVE_TIMEOUT_S)  # abandoned, never joined longer, if the resolver hangs
    if not got:
        raise ValueError(f"{host!r} gave no answer in {RESOLVE_TIMEOUT_S:g} s: give an address")
    found = got[0]
    if isinstance(found, BaseException):
        raise ValueError(f"{host!r} does not resolve ({found}): give an address, e.g. 127.0.0.1")
    if len(found) != 1:
        listed = sorted(found, key=lambda a: (":" in a, a))
        raise ValueError(
            f"{host!r} resolves to {len(found)} addresses ({', '.join(listed)}): vLLM listens on "
            "one, and any local user could listen on another and receive the daemon's probes "
            f"and the profile guard's secret. Set vllm.host to one address, e.g. {listed[0]!r}"
        )
    return found.pop()


class ModeConfig(_Strict):
    # Passed to vLLM after vllm.command, byte for byte: no shell, no quoting rules applied.
    args: list[str]


class VllmConfig(_Strict):
    # argv of vLLM before the mode's arguments, e.g. ["/opt/vllm/bin/vllm", "serve", "MODEL", ...]
    command: list[str] = Field(min_length=1)
    # Where vLLM listens (passed as --host and --port); /health is probed there. One address:
    # a name is resolved here, once, to the one address it names, and vLLM and every probe get
    # that literal. A name that resolves to several (`localhost`: ::1 and 127.0.0.1) is refused:
    # vLLM binds one of them, and any local user could listen on another and receive the
    # daemon's probes and the profile guard's secret.
    host: str = "127.0.0.1"
    # vLLM's port (see host).
    port: int = Field(default=8000, ge=1, le=65535)
    # Where the daemon writes the argv that the unit's launcher execs; the unit file reads
    # %t/kimi-supervisor/vllm-argv.json, so keep the two in step.
    argv_file: Path = Path("/run/kimi-supervisor/vllm-argv.json")
    # Where the unit's output can be followed when there is no journal (the sandbox).
    log_file: Path | None = None
    # vLLM's caches, kept across restarts and shared by both modes (the profiler's config is
    # not in vLLM's compile-cache key): VLLM_CACHE_ROOT, torch.compile's and Triton's under it.
    # vLLM runs code compiled there: used only if every directory on its path is root's or
    # vLLM's user's, writable by nobody else. Empty: vLLM's defaults (inductor's in /tmp).
    cache_dir: Path | None = Path("/var/cache/kimi-supervisor/vllm")

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _cache_dir(cls, d: object) -> object:
        if isinstance(d, str) and d and not d.startswith("/"):
            raise ValueError(f"{d!r} is relative: give an absolute path")
        return None if d == "" else d

    @field_validator("host")
    @classmethod
    def _one_address(cls, v: str) -> str:
        return one_address(v)

    @field_validator("command")
    @classmethod
    def _no_host_port(cls, v: list[str]) -> list[str]:
        for flag in ("--host", "--port"):
            if any(a == flag or a.startswith(flag + "=") for a in v):
                raise ValueError(f"remove {flag} from command: it is set from vllm.{flag[2:]}")
        return v

    @property
    def url(self) -> str:
        """vLLM's base URL: its one address (an IPv6 one in brackets) and port."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def health_url(self) -> str:
        return f"{self.url}/health"


class ModesConfig(_Strict):
    production: ModeConfig
    profile: ModeConfig

    @model_validator(mode="after")
    def _told_apart(self) -> ModesConfig:
        if self.production.args == self.profile.args:  # the daemon knows a mode by its argv
            why = "an armed production: its own torch_profiler_dir"
            raise ValueError(f"equal args: the daemon tells the modes apart by their argv ({why})")
        return self

    def args_for(self, mode: Mode) -> list[str]:
        return list(self.production.args if mode is Mode.PRODUCTION else self.profile.args)


class GpusConfig(_Strict):
    # How the GPUs are read: NVML (a real host), or a simulated host's files (the sandbox).
    backend: Literal["nvml", "sim"] = "nvml"
    # Indices of the GPUs this supervisor owns; empty means every GPU NVML reports.
    managed: list[Annotated[int, Field(ge=0, le=1023)]] = Field(default_factory=list)
    # A device counts as clean when used <= baseline + tolerance.
    tolerance_mib: int = Field(default=256, ge=0, le=1 << 20)
    # Fixed baselines (MiB) per GPU index; a GPU missing here is calibrated and persisted.
    baseline_mib: dict[str, Annotated[int, Field(ge=0, le=1 << 24)]] = Field(default_factory=dict)
    # Only for backend = "sim": the simulated host's directory.
    sim_dir: Path | None = None
    # How long one NVML query may take (NVML's calls have no timeout of their own). One that
    # takes longer is abandoned on its thread and counts as no reading: status says so, the
    # teardown cannot call the GPUs clean (STUCK, retried), and nothing is killed on it. Until
    # the stuck call returns, the GPUs are not asked again. A healthy host answers in well
    # under a millisecond (0.05 ms for two H200s:
    # bench/results/h200x2-2026-11-30-nvml-sample.txt).
    timeout_s: PositiveSeconds = 10.0
    # Before each start of vLLM the managed GPUs' health is read (decide/gpuhealth.py): a row
    # remapping waiting for a reset or failed, pages retired and waiting, uncorrected ECC
    # errors since the driver loaded. "warn": said in status, the history and the log, and the
    # load goes on; "refuse": the start fails with the reason (retried with the failure
    # backoff, so a reset GPU is taken up again); "off": not read. An Xid in the kernel's log
    # and NVLink errors are only ever warnings; a signal not read decides nothing.
    health_check: Literal["warn", "refuse", "off"] = "warn"

    @model_validator(mode="after")
    def _sim_needs_dir(self) -> GpusConfig:
        if self.backend == "sim" and self.sim_dir is None:
            raise ValueError('backend "sim" needs sim_dir, the simulated GPU host\'s directory')
        for key in self.baseline_mib:
            if not key.isdigit():
                raise ValueError(f'baseline_mib keys are GPU indices like "0", not {key!r}')
        return self


class TeardownConfig(_Strict):
    # Step stop_unit: how long vLLM gets to exit after the unit's stop (SIGTERM) before the
    # next step kills what is left.
    term_grace_s: PositiveSeconds = 30.0
    # Step kill_cgroup: how long the unit's processes get to die after SIGKILL to its cgroup.
    cgroup_kill_timeout_s: PositiveSeconds = 10.0
    # Step kill_strays: how long vLLM's processes outside the unit get to die after SIGKILL.
    strays_timeout_s: PositiveSeconds = 10.0
    # Step kill_gpu_holders: how long the processes that hold a managed GPU get to die.
    holders_timeout_s: PositiveSeconds = 10.0
    # Step wait_driver: how long the driver gets to free the memory of the dead before the
    # teardown ends STUCK (an H200 frees 90 GB in about 0.15 s).
    release_timeout_s: PositiveSeconds = 60.0
    # How often a teardown re-reads the GPUs and the processes it waits for: a freed GPU is
    # seen at most this late (docs/performance.md has the cost of one NVML read).
    poll_interval_s: Annotated[float, Field(gt=0, le=1)] = 0.01
    # After killing a GPU holder whose parent lives on, how long to watch for that parent
    # putting a new holder on a managed GPU before calling the GPUs clean. It must cover a CUDA
    # start: on an H200 a respawned child was listed 3.6-4.4 s after its predecessor's SIGKILL
    # (bench/results/h200x2-2026-11-30-cuda-probe.json, `respawn_gap_s`).
    respawn_watch_s: Annotated[float, Field(ge=0, le=600)] = 6.0
    # Extra regular expressions (searched in the command line) that mark a process as vLLM's.
    stray_patterns: list[str] = Field(default_factory=list)

    @field_validator("stray_patterns")
    @classmethod
    def _patterns_compile(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"{p!r} is not a valid regular expression: {e}") from None
        return patterns

    # Never signalled, in addition to the built-in list: executable names, matched against the
    # executable's and argv[0]'s basename and against comm (the name cut to 15 characters).
    protected_names: list[str] = Field(default_factory=list)
    # Never signalled either: every process in these systemd units (the daemon's own service
    # is always spared).
    protected_units: list[str] = Field(default_factory=list)
    # /dev/shm entries the service may leak (fnmatch patterns), removed when no live process
    # has them open or mapped. Measured with real vLLM 0.16 killed by SIGKILL: psm_* (its
    # shared-memory message queues), sem.mp-* (multiprocessing semaphores) and, on its CPU
    # build, <pid>-tp:0-[0-1]-cpushm_N; NCCL leaves nccl-*, vLLM 0.32 vllm_dist_*.
    shm_patterns: list[str] = Field(
        default_factory=lambda: ["nccl-*", "vllm*", "psm_*", "sem.mp-*", "*-cpushm_*"]
    )
    # Where shm_patterns are looked for.
    shm_dir: Path = Path("/dev/shm")
    # vLLM's TMPDIR ("": not looked at). Even a clean stop of vLLM 0.16 leaves its ZMQ IPC
    # sockets there, named by a UUID: those that no live socket is bound to are removed, with
    # the entries named by tmp_patterns that no live process has open or mapped.
    tmp_dir: Path | None = Path("/tmp")
    # Entries of tmp_dir vLLM may leak (fnmatch patterns), removed when nothing holds them.
    tmp_patterns: list[str] = Field(default_factory=lambda: ["vllm_dist_*"])

    @field_validator("shm_patterns", "tmp_patterns")
    @classmethod
    def _names_only(cls, patterns: list[str]) -> list[str]:
        # The daemon removes what these match as root: a pattern names entries of one folder
        # and says something about them ("*" or "?*" would take everything nobody holds open).
        for p in patterns:
            if "/" in p:
                raise ValueError(f"{p!r}: a name pattern, without '/'")
            if len(p.replace("*", "").replace("?", "")) < 3:
                raise ValueError(f"{p!r} matches almost anything: use 3 literal characters or more")
        return patterns

    @field_validator("tmp_dir", mode="before")
    @classmethod
    def _empty_is_off(cls, d: object) -> object:
        return None if d == "" else d

    @field_validator("shm_dir", "tmp_dir")
    @classmethod
    def _a_scratch_directory(cls, d: Path | None) -> Path | None:
        # The daemon removes entries there as root: a relative path would depend on its working
        # directory, and a system directory holds what nobody may remove by a name pattern.
        return None if d is None else scratch_dir(d)


class StateConfig(_Strict):
    # Holds state.json (desired mode, transition, baseline) and history.jsonl.
    dir: Path = Path("/var/lib/kimi-supervisor")
    # history.jsonl is rotated once it is this large (to history.jsonl.1, .2, ...), keeping
    # this many rotated files; `kimi-mode history` reads across them.
    history_max_mb: Annotated[float, Field(gt=0, le=100_000)] = 64.0
    # How many rotated history files are kept (see history_max_mb).
    history_keep: Annotated[int, Field(ge=1, le=100)] = 5
    # How many incident bundles (state.dir/incidents/incident-TIME-TRIGGER.txt, 1 MiB at most
    # each, written at a STUCK, a FAILED or a hang restart) are kept: the newest, the older
    # ones removed as each is written.
    bundles_keep: Annotated[int, Field(ge=1, le=1000)] = 10
    # How long one write or read of state.json or history.jsonl may hold the daemon's loop.
    # One that takes longer (a hung or frozen file system) is abandoned on its thread: what it
    # wrote is kept in memory and written again once the folder answers, and until then the
    # folder is not asked again. An operator's switch, which must be on disk before anything
    # is torn down for it, is refused meanwhile, with the reason.
    timeout_s: PositiveSeconds = 10.0


class DaemonConfig(_Strict):
    # How often the loop compares desired with observed while vLLM serves (and when idle):
    # the unit's state every tick, /health and the GPUs every health_interval_s. A vLLM that
    # dies is noticed within tick_s; every wake-up costs CPU on an idle host.
    tick_s: Annotated[float, Field(gt=0, le=60)] = 10.0
    # While vLLM loads: how often /health and the unit's output are read.
    start_poll_s: Annotated[float, Field(gt=0, le=10)] = 0.25
    # Loading Kimi-K2.5 takes over 30 minutes; this may be hours.
    start_timeout_s: PositiveSeconds = 3 * 3600.0
    # How long one GET /health may take before it counts as no answer.
    health_timeout_s: PositiveSeconds = 2.0
    # While serving, /health and the GPUs are read this often (the unit's state every tick).
    health_interval_s: PositiveSeconds = 30.0
    # /health failing for this long while serving counts as unhealthy (a busy server may be
    # slow to answer; a 30-minute reload is not started over one missed probe).
    health_grace_s: Seconds = 60.0
    # A mode that does not become ready sends the host back to the mode before it.
    rollback: bool = True
    # After vLLM dies or fails to start: wait initial, doubling up to max, before starting again.
    restart_backoff_initial_s: Seconds = 5.0
    # The longest of those waits (see restart_backoff_initial_s).
    restart_backoff_max_s: Seconds = 300.0
    # This many failures within the window: stop retrying and report FAILED.
    max_failures: Annotated[int, Field(ge=1, le=1_000_000)] = 3
    # The window max_failures counts failures in.
    failure_window_s: PositiveSeconds = 1800.0
    # A teardown that ends STUCK is retried after this, doubling up to restart_backoff_max_s.
    stuck_retry_s: PositiveSeconds = 30.0
    # At boot: how long to keep asking NVML for the driver, the interval doubling up to this.
    driver_retry_max_s: PositiveSeconds = 30.0
    # Lines of the unit's output kept for reports when a start fails.
    output_tail_lines: Annotated[int, Field(ge=1, le=1000)] = 30
    # Where the daemon's own output goes when there is no journal (the sandbox): what
    # `kimi-mode logs --daemon` reads there. Empty: the journal of kimi-supervisor.service.
    log_file: Path | None = None


class LivenessConfig(_Strict):
    """While vLLM serves (never while it loads), whether its engine makes progress
    (decide/liveness.py): hung needs two signals, vLLM's processes using no CPU (or stopped)
    and either requests pending with no engine step or token for `stall_s`, or, idle, a
    one-token canary (every `canary_interval_s`) unanswered within `canary_timeout_s`. Never
    judged while a capture is under way. A hung vLLM is restarted as a dead one is, up to
    max_hang_restarts in hang_window_s. Noticed within stall_s + metrics_interval_s under load,
    and within canary_interval_s + metrics_interval_s + canary_timeout_s idle."""

    # Whether the liveness probes run at all (off: only /health says vLLM lives).
    enabled: bool = True
    # How often vLLM's /metrics is read (requests running, tokens made).
    metrics_interval_s: Annotated[float, Field(gt=0, le=3600)] = 15.0
    # Requests running and no token made for this long: vLLM is hung.
    stall_s: PositiveSeconds = 120.0
    # Idle (no request running): how often a one-token canary request is sent.
    canary_interval_s: PositiveSeconds = 300.0
    # A canary unanswered for this long: vLLM is hung.
    canary_timeout_s: PositiveSeconds = 60.0
    # The canary's prompt (one token is asked for).
    canary_prompt: Annotated[str, Field(min_length=1, max_length=1000)] = "Hello"
    # vLLM's processes using less than this share of one core (summed) show no progress: the
    # second signal every hang verdict needs (a busy engine is never called hung). Real vLLM
    # 0.16's idle floor is 2.0-2.2 % with VLLM_SLEEP_WHEN_IDLE=1, and a working one far more.
    cpu_idle_fraction: Annotated[float, Field(gt=0, le=1)] = 0.05
    # This many hangs within hang_window_s: vLLM is torn down and not restarted (FAILED).
    max_hang_restarts: Annotated[int, Field(ge=1, le=1000)] = 3
    # The window max_hang_restarts counts hangs in.
    hang_window_s: PositiveSeconds = 86400.0
    # A doubt (requests wait, or a canary went unanswered, with no engine step while the
    # engine's processes stay busy) that lasts this long is a hang, unless vLLM shows real work
    # no step shows: a helper process of its (a JIT compiler, in its tree or its unit's cgroup)
    # using CPU, or memory or link traffic in the GPUs' own counters (any counter unread: no
    # verdict; a GPU on which NVML lists another's process is set aside, its counters no one's:
    # with every GPU so, the helpers' CPU alone judges). A collective stuck on
    # the GPU spins its host thread at a full core for ever, and production stays down until a
    # person acts. 600 s: twice the 300 s after which SGLang's watchdog and TensorRT-LLM's
    # HangDetector end a step, as the GPU's counters are there to tell long work apart; a
    # FlashInfer JIT compile of up to 10 minutes shows its compiler's CPU. At least stall_s.
    # Counted from the last reading before the counters' last move: the verdict comes within
    # hang_bound_s + metrics_interval_s of the last step.
    hang_bound_s: Annotated[float, Field(gt=0, le=86400)] = 600.0
    # After a hang or unhealthy verdict, how long vLLM's unit gets to stop before what is left
    # is killed (instead of teardown.term_grace_s): a hung engine finishes no request, and an
    # API server holding a client's open request waits out the whole grace (30.2 s of a
    # 95-127 s outage on real vLLM 0.16).
    hang_term_grace_s: PositiveSeconds = 5.0

    @model_validator(mode="after")
    def _bound_after_stall(self) -> LivenessConfig:
        if self.hang_bound_s < self.stall_s:
            raise ValueError(
                f"hang_bound_s ({self.hang_bound_s:g}) must be at least stall_s "
                f"({self.stall_s:g}): the bound looks back over the last stall_s"
            )
        return self


class ControlConfig(_Strict):
    # The control socket kimi-mode talks to.
    socket: Path = Path("/run/kimi-supervisor/control.sock")
    # Members of this group (and root) may use the socket; it is created 0660 root:group.
    group: str = "kimi"
    # Connections open at once, at most (and fewer per user): the next is refused.
    max_clients: Annotated[int, Field(ge=1, le=4096)] = 128
    # The longest request line accepted.
    max_line_bytes: Annotated[int, Field(ge=1024, le=16 * 1024 * 1024)] = 64 * 1024
    # A client that connects and sends nothing is dropped after this.
    idle_timeout_s: PositiveSeconds = 10.0


class ProfilingConfig(_Strict):
    # `kimi-mode profile` without --for: go back to production after this (0: stay until asked).
    default_duration_s: Annotated[float, Field(ge=0, le=MAX_PROFILE_S)] = 0.0
    # The longest --for accepted (0: no limit).
    max_duration_s: Annotated[float, Field(ge=0, le=MAX_PROFILE_S)] = 24 * 3600.0
    # Each capture goes into its own timestamped folder here.
    captures_dir: Path = Path("/var/lib/kimi-supervisor/captures")
    # Where vLLM writes its traces; empty: torch_profiler_dir of the profile mode's
    # --profiler-config.
    vllm_trace_dir: Path | None = None
    # Retention, applied after each capture: keep the newest N captures, and at most this many
    # GB in all (0: no limit).
    # (keep the newest keep_captures, and at most max_total_gb in all)
    keep_captures: Annotated[int, Field(ge=1, le=10_000)] = 10
    # Retention's size limit in GB (0: no limit).
    max_total_gb: Annotated[float, Field(ge=0, le=1_000_000)] = 200.0
    # How long POST /start_profile may take to answer.
    start_timeout_s: PositiveSeconds = 60.0
    # POST /stop_profile returns when the traces are written, many minutes on big models (150 s
    # on the seed's host). The capture fails past it, and liveness judges again: a vLLM that
    # hangs in its flush is found (vllm #22748: over 20 minutes at TP 2). 0: no bound.
    flush_timeout_s: Seconds = 1800.0
    # After the flush, each rank's trace is summarized (steps, time per step, communication,
    # GEMM and attention shares, top kernels) into summary.json beside the traces; one process
    # per rank, each stopped at this deadline.
    summarize: bool = True
    # Each rank's summary is stopped at this deadline (see summarize).
    summary_timeout_s: PositiveSeconds = 900.0
    # A capture in a mode other than profile (production started with the profiler armed) is a
    # window of at most this many seconds, whatever was asked ("until stopped" included): a
    # capture left recording would slow production and fill the disk.
    armed_capture_max_s: Annotated[float, Field(gt=0, le=MAX_PROFILE_S)] = 60.0
    # After a capture's flush, vLLM's tokens/s is read again this much later: the capture's
    # record says what serving got back to (capture/stall.py). 0: not measured.
    stall_after_s: Annotated[float, Field(ge=0, le=600)] = 10.0


class WarmConfig(_Strict):
    """Before a switch's teardown, while the old mode serves, the next mode's model files are
    read into the page cache (loop/warming.py). A --force switch and a stop never wait for it."""

    # Whether a switch warms the page cache first.
    enabled: bool = True
    # The most it reads, as a share of MemAvailable when it begins; files past it are skipped
    # (and said so): vLLM reads them from disk.
    max_ram_share: Annotated[float, Field(gt=0, le=0.9)] = 0.5
    # The longest a warming may take; the teardown then begins all the same (a read stuck in a
    # hung mount is left to its reader process, never waited for).
    timeout_s: PositiveSeconds = 900.0
    # Files read at once (a striped or NVMe volume reads faster with several).
    threads: Annotated[int, Field(ge=1, le=64)] = 4


class MetricsConfig(_Strict):
    # Whether the daemon serves Prometheus metrics (/metrics).
    enabled: bool = True
    # Where /metrics listens: 127.0.0.1 for this host alone; 0.0.0.0 for the fleet's Prometheus
    # (open the unit's IP allow-list too: docs/operations.md).
    address: str = "127.0.0.1"
    # The metrics' port.
    port: int = Field(default=9464, ge=1, le=65535)
    # One connection's whole exchange, from its accept (the request whole, then the answer
    # taken): a client idle or trickling for longer is closed, and holds back no scrape meanwhile.
    timeout_s: PositiveSeconds = 10.0
    # Connections held at once; a new one beyond them closes the oldest.
    max_connections: Annotated[int, Field(ge=1, le=512)] = 128


class Config(_Strict):
    service: ServiceConfig = Field(default_factory=ServiceConfig)
    systemd: SystemdConfig = Field(default_factory=SystemdConfig)
    vllm: VllmConfig
    modes: ModesConfig
    gpus: GpusConfig = Field(default_factory=GpusConfig)
    teardown: TeardownConfig = Field(default_factory=TeardownConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)
    liveness: LivenessConfig = Field(default_factory=LivenessConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    warm: WarmConfig = Field(default_factory=WarmConfig)

    def profiler_config(self, mode: Mode) -> str | None:
        """The --profiler-config a mode starts vLLM with (None: its profiler is not armed)."""
        args = self.modes.args_for(mode)
        for i, a in enumerate(args):
            if a == "--profiler-config" and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--profiler-config="):
                return a.split("=", 1)[1]
        return None

    def vllm_trace_dir(self, mode: Mode = Mode.PROFILE) -> Path | None:
        """Where vLLM in `mode` writes traces: profiling.vllm_trace_dir, else the
        torch_profiler_dir of the mode's --profiler-config."""
        if self.profiling.vllm_trace_dir is not None:
            return self.profiling.vllm_trace_dir
        value = self.profiler_config(mode)
        try:
            d = json.loads(value).get("torch_profiler_dir") if value else None
        except (ValueError, AttributeError):
            return None
        return Path(d) if d else None

    def profiler_max_iterations(self, mode: Mode) -> int:
        """vLLM's own bound on a capture in `mode`, in engine steps: max_iterations of the
        mode's --profiler-config (vLLM 0.16 stops recording after that many steps); 0: none."""
        value = self.profiler_config(mode)
        try:
            n = json.loads(value).get("max_iterations", 0) if value else 0
        except (ValueError, AttributeError):
            return 0
        return n if isinstance(n, int) and n > 0 else 0

    def launch_argv(self, mode: Mode) -> list[str]:
        """The exact argv vLLM must be started with in `mode`."""
        v = self.vllm
        return [*v.command, "--host", v.host, "--port", str(v.port), *self.modes.args_for(mode)]

    def effective_toml(self) -> str:
        """The effective configuration, defaults included, as TOML."""
        return to_toml(self)
