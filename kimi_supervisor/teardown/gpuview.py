"""The managed GPUs as a teardown sees them: memory, who NVML lists, and who holds what.

It samples the GPUs, tracks which listed PIDs are live holders (teardown/listing.py: alive,
older than the listing, the device file open and mapped) and when each died, and picks the
processes the evidence ladder (teardown/ownership.py) says hold a managed GPU: rung 1 (a live
holder NVML lists there) and rung 2 (the device file open and mapped, where no live listed
process explains the memory). Device files are compared as the GPU port's driver tells them
apart, so a container's own nodes count. It signals nothing: the teardown does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kimi_supervisor.model import DeviceReading, Evidence
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.clock import Clock
from kimi_supervisor.ports.gpu import GpuPort, GpuUnavailable
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.teardown.events import EventSink, GpusRead, ignore
from kimi_supervisor.teardown.listing import FirstListed, Sighting
from kimi_supervisor.teardown.ownership import DeviceUse, GpuFiles, judge
from kimi_supervisor.teardown.scan import device_users

# After a process that held a managed GPU dies, its memory is on its way out: the driver frees
# it as the process's exit runs, 0.150-0.163 s from SIGKILL to NVML at baseline on an H200
# (bench/results/h200x2-2026-11-30-cuda-probe.json). For this long after such a death, memory
# is waited for rather than blamed on an open-and-mapped holder.
DRIVER_RELEASE_GRACE_S = 1.0


@dataclass
class Target:
    ref: ProcessRef
    evidence: Evidence
    reason: str


@dataclass
class GpuView:
    gpu: GpuPort
    clock: Clock
    baselines: dict[int, int]
    tolerance_mib: int
    on_event: EventSink = ignore
    # When the daemon first saw each (GPU, PID) listed, before this teardown (its observer's
    # samples): a PID recycled before the teardown began is known by it.
    listed_since: Mapping[Sighting, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.indices = sorted(self.baselines)
        self.paths = {i: self.gpu.device_path(i) for i in self.indices}
        self.node_key = self.gpu.node_key
        self.first_listed = FirstListed(self.listed_since)
        self.devices: list[DeviceReading] = []
        self._files: GpuFiles | None = None
        self._last_drain: dict[int, int] = {}
        # Listed PIDs seen alive with their GPU's device file open (rung 1), and when they died.
        self.alive_listed: dict[int, ProcessRef] = {}
        self._died_at: dict[int, float] = {}
        self._others_listed = FirstListed()  # the unmanaged GPUs, sampled by listed_anywhere

    # -- observation --
    def sample(self) -> list[DeviceReading]:
        samples = self.gpu.sample(self.indices)
        self.devices = [
            DeviceReading(
                index=s.index,
                used_mib=s.used_mib,
                baseline_mib=self.baselines[s.index],
                tolerance_mib=self.tolerance_mib,
                processes=sorted({p.pid for p in s.processes}),
            )
            for s in samples
        ]
        self._track_listed()
        drain = {d.index: d.used_mib for d in self.devices}
        if drain != self._last_drain:
            self._last_drain = drain
            self.on_event(GpusRead(tuple(self.devices)))
        return self.devices

    def clean(self) -> bool:
        return all(d.clean for d in self.sample())

    def _track_listed(self) -> None:
        """Which listed PIDs are live holders (rung 1), and when each of them died. A listed PID
        that does not name its holder (dead, recycled, another PID namespace's, an NVML client
        or another GPU's job: teardown/listing.py) explains nothing."""
        self.first_listed.saw((d.index, pid) for d in self.devices for pid in d.processes)
        for d in self.devices:
            for pid in d.processes:
                if pid in self.alive_listed or pid in self._died_at:
                    continue
                ref = self.first_listed.holder(
                    d.index, pid, self.paths[d.index], node_key=self.node_key
                )
                if ref is not None:
                    self.alive_listed[pid] = ref
        now = self.clock.monotonic()
        for pid, ref in self.alive_listed.items():
            if pid not in self._died_at and not processes.is_alive(ref):
                self._died_at[pid] = now

    def live_listed(self) -> dict[int, set[int]]:
        """PID -> the managed GPUs NVML lists it on, for live holders only."""
        out: dict[int, set[int]] = {}
        for d in self.devices:
            for pid in d.processes:
                if pid in self.alive_listed and pid not in self._died_at:
                    out.setdefault(pid, set()).add(d.index)
        return out

    def files(self) -> GpuFiles:
        """Device files of the managed GPUs and of the host's others (found once)."""
        if self._files is None:
            try:
                others = [i for i in range(self.gpu.device_count()) if i not in self.baselines]
                other_paths = {i: self.gpu.device_path(i) for i in others}
            except GpuUnavailable:
                other_paths = {}
            self._files = GpuFiles(self.paths, other_paths)
        return self._files

    def all_files(self) -> list[str]:
        """Every GPU's device file, nvidiactl and nvidia-uvm."""
        folder = os.path.dirname(next(iter(self.paths.values()), "/dev/nvidia0"))
        controls = [os.path.join(folder, n) for n in ("nvidiactl", "nvidia-uvm")]
        return [*self.files().all().values(), *controls]

    def listed_anywhere(self) -> dict[int, set[int]]:
        """PID -> every GPU (managed or not) NVML lists it on, for live processes only."""
        out = self.live_listed()
        others = list(self.files().others)
        try:
            samples = self.gpu.sample(others) if others else []
        except GpuUnavailable:
            samples = []
        self._others_listed.saw((s.index, p.pid) for s in samples for p in s.processes)
        for s in samples:
            for p in s.processes:
                path = self.files().others[s.index]
                if self._others_listed.holder(s.index, p.pid, path, node_key=self.node_key):
                    out.setdefault(p.pid, set()).add(s.index)
        return out

    def use_of(self, pid: int, mapped_too: bool = False) -> DeviceUse:
        """What `pid` has open and mapped of every GPU's files (as `device_users` reads it)."""
        users = device_users(self.all_files(), None, mapped_too, node_key=self.node_key, pids=[pid])
        return users.get(pid, DeviceUse(pid))

    def holds_managed_gpu(self, pid: int) -> bool:
        """Whether the ladder's own rules say `pid` holds a managed GPU: rung 1, or rung 2 where
        a managed GPU's memory is unexplained. A process listed only on unmanaged GPUs, or
        mapping only their files, never does, whatever its command line."""
        if pid in self.live_listed():
            return True
        listed = self.listed_anywhere()
        v = judge(
            self.use_of(pid), self.files(), listed.get(pid, set()), unexplained=self.unexplained()
        )
        return v.evidence is not None

    # -- the ladder --
    def draining(self, gpu: int | None = None) -> bool:
        """Whether NVML still lists, on `gpu` (default: any managed GPU), a holder seen alive in
        this teardown that died less than DRIVER_RELEASE_GRACE_S ago: its memory is on its way
        out. A PID listed dead from the start (a ghost's creator) drains nothing."""
        now = self.clock.monotonic()
        return any(
            now - self._died_at.get(pid, float("-inf")) < DRIVER_RELEASE_GRACE_S
            for d in self.devices
            if gpu is None or d.index == gpu
            for pid in d.processes
        )

    def held_only_by(self, spared: set[int]) -> list[int]:
        """The holders in `spared` (live processes the teardown will not signal), when they alone
        explain what is left: every managed GPU above baseline has a live listed holder, all of
        them in `spared`, and nothing listed there is draining. Empty otherwise."""
        live = self.live_listed()
        held: set[int] = set()
        for d in self.devices:
            if d.clean:
                continue
            on = {pid for pid, gpus in live.items() if d.index in gpus}
            if not on or not on <= spared or self.draining(d.index):
                return []
            held |= on
        return sorted(held)

    def unexplained(self) -> set[int]:
        """Managed GPUs above baseline that no live listed process explains, once the memory of
        any listed holder that just died there has had time to come back."""
        live = self.live_listed()
        return {
            d.index
            for d in self.devices
            if not d.clean
            and not any(d.index in gpus for gpus in live.values())
            and not self.draining(d.index)
        }

    def listed_targets(self) -> dict[ProcessRef, Target]:
        """Rung 1: live processes NVML lists on managed GPUs."""
        out: dict[ProcessRef, Target] = {}
        for pid, gpus in self.live_listed().items():
            ref = self.alive_listed[pid]
            where = ", ".join(map(str, sorted(gpus)))
            out[ref] = Target(ref, Evidence.NVML_LISTED, f"listed on managed GPU {where}")
        return out

    def mapped_targets(self, never: set[int]) -> dict[ProcessRef, Target]:
        """Rung 2: on unexplained GPUs, processes that have the device file open and mapped
        (`never`: our own PIDs, whose NVML handles explain nothing)."""
        unexplained = self.unexplained()
        if not unexplained:
            return {}
        holding = [self.paths[i] for i in sorted(unexplained)]
        users = device_users(self.all_files(), holding, node_key=self.node_key)
        listed = self.listed_anywhere() if users else {}
        out: dict[ProcessRef, Target] = {}
        for pid, use in users.items():
            ref = processes.ref_of(pid)
            if ref is None or pid in never:
                continue
            v = judge(use, self.files(), listed.get(pid, set()), unexplained=unexplained)
            if v.evidence is Evidence.OPEN_AND_MAPPED:
                above = ", ".join(map(str, v.gpus))
                out[ref] = Target(
                    ref, v.evidence, f"{v.seen}; GPU {above} above baseline, unexplained"
                )
        return out
