"""What the loop sees: vLLM's unit, its /health, the mode its MainPID runs, and the GPUs.

Each read costs something (a D-Bus call, an HTTP request, NVML), so the expensive ones are
reused while nothing suggests a change: while the same MainPID serves, /health and the GPUs are
read every `health_interval_s`, and a MainPID's mode is read once (its argv does not change).
Everything here is read-only towards the world; warnings go back to the caller.

Intruders: a foreign process on a managed GPU while vLLM loads, found from what NVML lists. A
teardown's CLEAN holds only until something else takes a GPU. vLLM takes minutes to load (30+
on the real host), and a process that starts on a managed GPU meanwhile makes it run out of
memory with no explanation. While loading, every live process NVML lists on a managed GPU must be
in vLLM's unit; anything else is an intruder. As in the teardown's rung 1, a listed PID names a
process only if it is the one NVML means (teardown/listing.py: alive, started before it was
first seen listed, that GPU's device file open and mapped); a dead, recycled or foreign-namespace
PID, an NVML client or another GPU's job explains nothing and is no intruder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kimi_supervisor.config import Config
from kimi_supervisor.decide.reconcile import Observed
from kimi_supervisor.model import DeviceReading, Mode, title, utcnow
from kimi_supervisor.ports import launcher, processes
from kimi_supervisor.ports.clock import Clock
from kimi_supervisor.ports.gpu import GpuPort, GpuUnavailable
from kimi_supervisor.ports.http import request as http_request
from kimi_supervisor.ports.openfiles import NodeKey
from kimi_supervisor.ports.systemd import SystemdError, SystemdPort
from kimi_supervisor.status import GpuStatus, Holder
from kimi_supervisor.teardown.listing import FirstListed

# Without a stored baseline (state lost while vLLM ran), teardowns judge "clean" against this
# until the GPUs are next seen idle and calibrated. An idle H200 with persistence mode reads
# 615 MiB; the status shows the baseline as provisional meanwhile.
PROVISIONAL_BASELINE_MIB = 1024
# The warning while the serving vLLM takes orders from its own clients (launcher.open_routes).
OPEN_ROUTES = "vLLM's clients can order it about"

# The warning while another user's socket answers on vLLM's address (status names it).
INTRUSION = "an intruder answers on vLLM's address"


@dataclass(frozen=True)
class Intruder:
    pid: int
    gpu: int
    name: str


def foreign(
    listed: Mapping[int, Iterable[int]],
    unit_pids: set[int],
    device_paths: Mapping[int, str],
    *,
    first_listed: FirstListed,
    node_key: NodeKey | None = None,
) -> list[Intruder]:
    """Live processes listed on managed GPUs (`listed`: GPU -> PIDs) that are not in vLLM's unit.
    `first_listed` has seen the sample `listed` comes from."""
    out: list[Intruder] = []
    for gpu, pids in sorted(listed.items()):
        for pid in pids:
            if pid in unit_pids:
                continue
            if first_listed.holder(gpu, pid, device_paths[gpu], node_key=node_key) is None:
                continue
            argv = processes.cmdline_of(pid)
            out.append(Intruder(pid, gpu, title(argv, processes.comm_of(pid))))
    return out


def intrusion_record(found: list[Intruder], unit: str, loading: Mode) -> tuple[str, dict[str, Any]]:
    """What the operator is told of intruders found while `loading` loads: the reason, and the
    incident recorded in the history (and shown as status's `last_intrusion`)."""
    who = "; ".join(f"PID {f.pid} ({f.name}) on GPU {f.gpu}" for f in found)
    reason = f"a process outside {unit} took a managed GPU while {loading.value} was loading: {who}"
    return reason, {
        "at": utcnow().isoformat(),
        "what": reason,
        "incident": "gpu_intrusion",
        "processes": [{"pid": f.pid, "gpu": f.gpu, "name": f.name} for f in found],
    }


@dataclass
class Observer:
    config: Config
    systemd: SystemdPort
    gpu: GpuPort
    clock: Clock
    warn: Callable[..., None]  # (message, key=None): see Context.warn
    unwarn: Callable[[str], None]
    gpus: list[GpuStatus] = field(default_factory=list)
    gpus_at: float | None = None  # when the GPUs were last sampled (monotonic)

    def __post_init__(self) -> None:
        self.unit = self.config.service.unit
        self._mode_of_pid: tuple[int, launcher.Running | None] = (0, None)
        # The last /health: its status, whether it gave no answer in time, when probed.
        self._health: tuple[int, bool, float] = (-1, False, 0.0)
        self._listed: dict[int, list[int]] = {}  # GPU -> PIDs NVML listed at the last sample
        self.first_listed = FirstListed()  # when each (GPU, PID) was first seen listed
        self._unit_pids: set[int] = set()  # vLLM's unit's processes, as last read
        self._titles: dict[int, str] = {}
        self.error = ""  # why the unit could not be read at the last observation
        self._told: list[dict[str, Any]] = []  # the readings readings_changed last gave
        self.last_ok: float | None = None  # the last /health 200 probed (monotonic)
        # The unit's User=, read once per MainPID: only a socket of that uid answering on
        # vLLM's address is vLLM (ports/http.request's peer_uid). None: not known, not checked.
        self.vllm_uid: int | None = None
        self._uid_of_pid = -1

    def observe(
        self,
        serving_pid: int,
        indices: list[int],
        baselines: dict[int, int],
        *,
        starting: bool = False,
    ) -> Observed | None:
        """The unit, its /health and the GPUs. `serving_pid`: the MainPID the loop serves (0:
        none); while it is the unit's MainPID, /health and the GPUs are reused for a while.
        `starting`: the loop started the unit; a unit not up yet is then asked for its job."""
        job = ""
        if starting:
            # Read before the unit's state: a start job seen here and a unit still inactive
            # below means the job is queued (or has just ended, which the next pass sees).
            try:
                job = self.systemd.jobs().get(self.unit, "")
            except SystemdError:
                job = ""
        try:
            st = self.systemd.status(self.unit)
        except SystemdError as e:
            self.error = f"cannot read {self.unit}: {e}"
            self.warn(self.error)
            return None
        self.error = ""
        self.unwarn(f"cannot read {self.unit}")
        up = st.up
        steady = serving_pid != 0 and st.main_pid == serving_pid
        if up and st.main_pid != self._uid_of_pid:
            self._uid_of_pid = st.main_pid
            try:
                self.vllm_uid = self.systemd.run_as(self.unit)
            except SystemdError:
                self.vllm_uid = None
        running = self._running_mode(st.main_pid) if up else None
        if running is not None and running.open_routes:
            self.warn(f"{OPEN_ROUTES} (PID {st.main_pid}): {running.open_routes}"
                      + (f"; `kimi-mode {running.mode.value} --apply` starts it again with the "
                         "guard" if running.unguarded else "; remove it from vLLM's unit"),
                      OPEN_ROUTES)  # fmt: skip
        else:
            self.unwarn(OPEN_ROUTES)
        health, slow = self._probe_health(st.main_pid, steady) if up else (-1, False)
        fresh = self.gpus_at is not None and (
            self.clock.monotonic() - self.gpus_at < self.config.daemon.health_interval_s
        )
        if steady and fresh:
            clean = all(g.clean for g in self.gpus)
        else:
            clean = self.sample(indices, baselines)
        return Observed(
            active_state=st.active_state,
            sub_state=st.sub_state,
            load_state=st.load_state,
            main_pid=st.main_pid,
            running_mode=running.mode if running else None,
            argv_stale=running is not None and running.stale,
            open_routes=running.open_routes if running else "",
            unguarded=running is not None and running.unguarded,
            health=health,
            health_slow=slow,
            gpus_clean=clean,
            result=st.result,
            exec_main_status=st.exec_main_status,
            job=job,
        )

    def readings_changed(self) -> list[dict[str, Any]]:
        """The GPUs as last sampled, if they changed since last asked (else empty)."""
        readings = [
            {"index": g.index, "used_mib": g.used_mib, "baseline_mib": g.baseline_mib,
             "total_mib": g.total_mib}
            for g in self.gpus
        ]  # fmt: skip
        if readings == self._told:
            return []
        self._told = readings
        return readings

    def forget_health(self) -> None:
        """vLLM's MainPID exited: the last /health answer says nothing any more."""
        self._health = (-1, False, 0.0)

    def _probe_health(self, main_pid: int, steady: bool) -> tuple[int, bool]:
        """GET /health (its status, and whether it gave no answer that says anything); while
        serving the same MainPID, a 200 at most every health_interval_s, a failure each pass."""
        d, now = self.config.daemon, self.clock.monotonic()
        last, slow, at = self._health
        # Only a 200 is kept for a while: a failure is asked again at each pass, so that the
        # restart's second sign (decide/liveness.health_failure) always stands beside a failure
        # of now, never one a busy vLLM has since got over (the bench saw that restart with a
        # grace shorter than the interval).
        if steady and last == 200 and now - at < d.health_interval_s:
            return last, slow
        r = http_request(
            self.config.vllm.health_url, timeout_s=d.health_timeout_s, peer_uid=self.vllm_uid
        )
        # Another user's listener on vLLM's address is an intrusion, said as such; what it
        # answers is never vLLM's (a 503 of its own tore a healthy vLLM down).
        if r.intruder:
            self.warn(f"{INTRUSION}: {r.error}", INTRUSION)
        else:
            self.unwarn(INTRUSION)
        # No answer that says anything (none in time, a reset, an intruder's, the daemon's own
        # error such as no descriptor left) needs a second sign before it restarts anything; a
        # refused connection (nothing listens) and an HTTP status are vLLM's own statements.
        slow = r.status == 0 and "refused" not in r.error.lower()
        self._health = (r.status, slow, now)
        if r.status == 200:
            self.last_ok = now
        return r.status, slow

    def _running_mode(self, main_pid: int) -> launcher.Running | None:
        """The mode MainPID was started in; read once per MainPID (its argv does not change)."""
        cached = self._mode_of_pid[1]
        if self._mode_of_pid[0] != main_pid or cached is None or cached.provisional:
            self._mode_of_pid = (main_pid, launcher.running_mode(self.config, main_pid))
        return self._mode_of_pid[1]

    def _title(self, pid: int) -> str:
        if pid not in self._titles:
            self._titles[pid] = title_of(pid)
        return self._titles[pid]

    def sample(self, indices: list[int], baselines: dict[int, int]) -> bool:
        """Read the GPUs now; True if every one is at its baseline with nothing listed."""
        try:
            samples = self.gpu.sample(indices)
        except GpuUnavailable as e:
            self.warn(f"cannot read the GPUs: {e}", "cannot read the GPUs")
            return False
        self.unwarn("cannot read the GPUs")
        self.gpus_at = self.clock.monotonic()
        self._listed = {s.index: [p.pid for p in s.processes] for s in samples}
        self.first_listed.saw((s.index, p.pid) for s in samples for p in s.processes)
        holders = {p.pid for s in samples for p in s.processes}
        self._titles = {pid: t for pid, t in self._titles.items() if pid in holders}
        self.gpus = [
            GpuStatus(
                index=s.index,
                used_mib=s.used_mib,
                baseline_mib=baselines.get(s.index, PROVISIONAL_BASELINE_MIB),
                tolerance_mib=self.config.gpus.tolerance_mib,
                total_mib=s.total_mib,
                holders=[
                    Holder(pid=p.pid, name=self._title(p.pid), used_mib=p.used_mib)
                    for p in s.processes
                ],
            )
            for s in samples
        ]
        return all(g.clean for g in self.gpus)

    def gpus_from_teardown(self, devices: Iterable[DeviceReading]) -> None:
        """The teardown's readings (its drain events) stand in for the loop's own."""
        devices = list(devices)
        self.first_listed.saw((d.index, p) for d in devices for p in d.processes)
        self.gpus = [
            GpuStatus(
                index=d.index,
                used_mib=d.used_mib,
                baseline_mib=d.baseline_mib,
                tolerance_mib=d.tolerance_mib,
                holders=[Holder(pid=p, name=self._title(p)) for p in d.processes],
            )
            for d in devices
        ]
        self.gpus_at = self.clock.monotonic()

    def intruders(self, main_pid: int) -> list[Intruder]:
        """While vLLM loads: live processes outside its unit and its tree that NVML listed on a
        managed GPU at the last sample."""
        if all(pid in self._unit_pids for pids in self._listed.values() for pid in pids):
            return []
        try:
            self._unit_pids = set(self.systemd.cgroup_pids(self.unit))
        except SystemdError:
            return []
        if main_pid:  # vLLM's own tree is vLLM's, even where a child left the unit's cgroup
            self._unit_pids |= {main_pid, *processes.descendants(main_pid)}
        paths = {i: self.gpu.device_path(i) for i in self._listed}
        return foreign(
            self._listed,
            self._unit_pids,
            paths,
            first_listed=self.first_listed,
            node_key=self.gpu.node_key,
        )


def title_of(pid: int) -> str:
    """What an operator recognises a process by: its (possibly retitled) command line."""
    return title(processes.cmdline_of(pid), processes.comm_of(pid), 48)
