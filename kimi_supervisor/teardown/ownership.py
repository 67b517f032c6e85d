"""Who holds a managed GPU's memory: the evidence ladder, as one pure decision per process.

The driver charges memory to a context, and a context is an open device file, not a PID: a fork
inherits it, and NVML keeps listing the PID that created it after that PID died (measured on 2x
H200, `bench/results/h200x2-2026-11-30-cuda-probe.json`). An open descriptor alone says almost
nothing: every CUDA process and every NVML client opens every /dev/nvidiaN. What a process maps
tells them apart: an NVML client maps no device file, a CUDA job maps the device files of the
GPUs it can see.

The ladder, strongest first, as `judge` applies it:

1. Rung 1, suspect, killed: NVML lists it on a managed GPU and it is the process NVML means
   (teardown/listing.py: alive, started before it was first seen listed, that GPU's device file
   open and mapped).
   - Listed alive on unmanaged GPUs only: a bystander (another GPU's job), never killed.
2. Rung 2, suspect, killed: it has a managed GPU's device file open and mapped, and no live
   listed process explains that GPU's memory.
   - Protected (by name, unit, or being ourselves): a bystander, never killed.
3. Rung 3, never killed, named in the diagnosis:
   - its mappings could not be read: unknown (never "a monitor": nothing is known of it);
   - it maps no GPU's device file (an NVML client, a monitor): a bystander;
   - it maps only unmanaged GPUs' device files: a bystander (another GPU's job);
   - it maps a managed GPU's device file with no descriptor of it open: a bystander (the driver
     frees a context with its last open file, measured);
   - anything else (a managed device file open and mapped where a live holder explains the
     memory, or only control files mapped): a candidate.

Device files are compared by what the driver takes them for (a character device's number), so a
node in a container's own /dev is the host's GPU. A listed PID that is not the process NVML means
(dead, recycled, another PID namespace's) explains nothing. A protected process with rung 1 or 2
evidence is still a suspect (it may hold the memory) but is never signalled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kimi_supervisor.model import Evidence, Role


@dataclass(frozen=True)
class DeviceUse:
    """Which GPU device files (and nvidiactl, nvidia-uvm) one process has open and mapped."""

    pid: int
    open: frozenset[str] = frozenset()
    mapped: frozenset[str] = frozenset()
    maps_unreadable: bool = False  # /proc/PID/maps could not be read: `mapped` is not known


@dataclass(frozen=True)
class GpuFiles:
    """Device file of each GPU: the managed ones, and the host's others."""

    managed: Mapping[int, str]
    others: Mapping[int, str] = field(default_factory=dict)

    def all(self) -> dict[int, str]:
        return {**self.others, **self.managed}


@dataclass(frozen=True)
class Verdict:
    role: Role
    gpus: tuple[int, ...]  # the managed GPUs the evidence is about
    seen: str  # what was seen, in an operator's words
    evidence: Evidence | None = None  # rung 1 or 2: what a kill would be recorded with
    check: str = ""  # for candidates and protected suspects: what to check by hand
    protected: str = ""

    @property
    def kill(self) -> bool:
        return self.evidence is not None and not self.protected


def _names(paths: set[str] | frozenset[str]) -> str:
    return ", ".join(sorted(paths))


def judge(
    use: DeviceUse,
    files: GpuFiles,
    listed_on: set[int],
    *,
    unexplained: set[int],
    protected: str | None = None,
) -> Verdict:
    """The verdict on one process. `listed_on`: every GPU (managed or not) where NVML lists it
    alive; `unexplained`: the managed GPUs above baseline that no live listed process explains."""
    managed = files.managed
    on_managed = tuple(sorted(listed_on & set(managed)))
    guard = protected or ""
    if on_managed:
        return _suspect(
            Evidence.NVML_LISTED,
            on_managed,
            f"NVML lists it on GPU(s) {_gpus(on_managed)}",
            protected=guard,
        )
    open_mapped = tuple(sorted(i for i, p in managed.items() if p in use.open and p in use.mapped))
    if listed_on:
        elsewhere = _gpus(tuple(sorted(listed_on)))
        if open_mapped and set(open_mapped) & unexplained:
            return Verdict(
                Role.CANDIDATE,
                open_mapped,
                f"NVML lists it on unmanaged GPU(s) {elsewhere}; it also has "
                f"{_names({managed[i] for i in open_mapped})} open and mapped",
                check=(
                    "a CUDA process maps every GPU it can see, so this is most likely a job on "
                    f"GPU(s) {elsewhere}; if the memory is its, stop it by hand"
                ),
            )
        return Verdict(Role.BYSTANDER, (), f"a job on GPU(s) {elsewhere} (NVML lists it there)")
    suspect_gpus = tuple(i for i in open_mapped if i in unexplained)
    if suspect_gpus:
        held = _names({managed[i] for i in suspect_gpus})
        seen = f"has {held} open and mapped; NVML lists it nowhere"
        return _suspect(Evidence.OPEN_AND_MAPPED, suspect_gpus, seen, protected=guard)
    if protected:
        return Verdict(Role.BYSTANDER, (), f"protected: {protected}")
    if use.maps_unreadable:
        return Verdict(
            Role.UNKNOWN,
            tuple(sorted(i for i, p in managed.items() if p in use.open)),
            f"has {_names(set(use.open)) or 'nothing'} open; what it maps could not be read",
            check="read `grep nvidia /proc/PID/maps` as root: a CUDA job maps its GPUs' files",
        )
    gpu_paths = set(files.all().values())
    mapped_gpus = use.mapped & gpu_paths
    if not mapped_gpus:
        if use.mapped:
            return _candidate(
                use,
                managed,
                f"maps {_names(set(use.mapped))} but no GPU's device file",
                check=(
                    "a CUDA process that has not created a context yet maps only the control "
                    "files; check it again in a few seconds"
                ),
            )
        return Verdict(
            Role.BYSTANDER,
            (),
            f"a monitor: has {_names(set(use.open)) or 'nothing'} open and maps no device file "
            "(as an NVML client such as nvidia-smi does)",
        )
    if not mapped_gpus & set(managed.values()):
        return Verdict(Role.BYSTANDER, (), f"a job on another GPU: maps only {_names(mapped_gpus)}")
    if not any(p in use.open and p in use.mapped for p in managed.values()):
        mapped_only = _names({p for p in managed.values() if p in use.mapped})
        return Verdict(
            Role.BYSTANDER,
            (),
            f"maps {mapped_only} with no descriptor of it open: a mapping alone holds no memory "
            "(the driver frees a context with its last open file; measured on an H200, a helper "
            "that closed its descriptors kept the mapping and the memory came back at once)",
        )
    return _candidate(
        use,
        managed,
        f"has {_names({p for p in managed.values() if p in use.mapped and p in use.open})} open "
        "and mapped, on a GPU a live listed process explains",
        check="check `nvidia-smi` for the processes that use this GPU",
    )


def _gpus(indices: tuple[int, ...]) -> str:
    return ", ".join(map(str, indices))


def _suspect(evidence: Evidence, gpus: tuple[int, ...], seen: str, *, protected: str) -> Verdict:
    # Why it was not killed is its `why`, and what to do the report's next action: said once.
    return Verdict(Role.SUSPECT, gpus, seen, evidence, "", protected)


def _candidate(use: DeviceUse, managed: Mapping[int, str], seen: str, *, check: str) -> Verdict:
    gpus = tuple(sorted(i for i, p in managed.items() if p in use.open | use.mapped))
    return Verdict(Role.CANDIDATE, gpus, seen, check=check)
