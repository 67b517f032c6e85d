"""Which live process NVML means by a PID it lists.

NVML lists the PID that created a context for as long as the context lives, even after that PID
died (measured on 2x H200, `bench/results/h200x2-2026-11-30-cuda-probe.json`): a forked helper
keeps it alive. The PID can then be given to any other process (`pid_max` is 32768 on many
hosts), and every NVML client and every CUDA process has every /dev/nvidiaN open. So a listed
PID names the process that holds it only if all of these hold:

- it is alive (not a zombie);
- it started no later than the clock tick (10 ms) in which NVML was first seen listing that PID
  on that GPU, in the current unbroken run of samples that list it: a process started later
  cannot have created the context. (Within that one tick the start time cannot tell; a process
  that started there has not had the time to map a GPU's device file, which CUDA does only
  after loading the driver's libraries, so the next rule still holds for it. A PID that leaves
  the list and comes back starts a new run: a recycled PID that makes a context of its own is
  its holder again.)
- it has that GPU's device file open and mapped: an NVML client maps no device file, and a job
  restricted to other GPUs maps only theirs (measured, the same probe: `nvml_client` 6 open, 0
  mapped; `CUDA_VISIBLE_DEVICES=1` opened both, mapped only /dev/nvidia1).

A listed PID that fails one of them explains nothing. The same rule serves the teardown's rung 1
and the intrusion check while vLLM loads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.openfiles import NodeKey
from kimi_supervisor.ports.processes import ProcessRef

Sighting = tuple[int, int]  # (GPU index, PID)


class FirstListed:
    """When each (GPU, PID) NVML lists was first seen listed, in the current unbroken run of
    samples (clock ticks since boot: the clock of a process's start time)."""

    def __init__(self, seed: Mapping[Sighting, int] | None = None) -> None:
        self.since: dict[Sighting, int] = dict(seed or {})

    def saw(self, listed: Iterable[Sighting], at: int | None = None) -> None:
        """One sample's listings, read just before `at` (default: now)."""
        now = processes.now_ticks() if at is None else at
        seen = set(listed)
        for key in [k for k in self.since if k not in seen]:
            del self.since[key]
        for key in seen:
            self.since.setdefault(key, now)

    def snapshot(self) -> dict[Sighting, int]:
        return dict(self.since)

    def holder(
        self, gpu: int, pid: int, device_file: str, *, node_key: NodeKey | None = None
    ) -> ProcessRef | None:
        """The live process that holds what NVML lists as `pid` on `gpu`, or None (see the
        module's rule). Call `saw` with the sample first."""
        ref = processes.ref_of(pid)
        since = self.since.get((gpu, pid))
        if ref is None or since is None or ref.start_ticks > since:
            return None
        if not processes.is_alive(ref):
            return None
        if not openfiles.holds_any(pid, [device_file], node_key):
            return None
        mapped = openfiles.maps_of(pid, [device_file], node_key)
        return ref if mapped else None
