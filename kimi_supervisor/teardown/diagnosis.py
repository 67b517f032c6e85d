"""The STUCK diagnosis: what is left, who is a suspect and who a bystander, and what to do next.

Built from one scene observed when the teardown ends (the unit, the GPUs' memory and lists, every
process that still opens or maps a GPU's device files, what was killed, who listens where vLLM
binds). Every process that touches a managed GPU is judged by the evidence ladder
(kimi_supervisor/teardown/ownership.py), so the report separates:
- suspects: evidence says they hold the memory, but they were not cleared (killed but not
  exited, protected, or appeared after the holder step);
- candidates: rung 3, never killed on that evidence, each with what to check;
- bystanders: protected processes, other GPUs' jobs and monitors, named so that nobody
  kills them by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kimi_supervisor.model import DeviceReading, KillRecord, RemainingHolder, Role, Step
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.teardown.ownership import DeviceUse, GpuFiles, judge


@dataclass(frozen=True)
class Scene:
    unit: str
    unit_active: bool
    devices: list[DeviceReading]
    files: GpuFiles
    users: Mapping[int, DeviceUse]  # every process that opens or maps a GPU's device files
    listed_alive: Mapping[int, set[int]]  # PID -> every GPU NVML lists it on (live ones only)
    killed: Mapping[ProcessRef, KillRecord]
    why_protected: Callable[[int], str | None]
    never: set[int]  # ourselves, our ancestors, PID 1: our own NVML handles explain nothing
    port: int
    port_holders: Mapping[int, set[str]]  # PID -> addresses, listening where vLLM binds


def _unexplained(scene: Scene) -> set[int]:
    return {
        d.index
        for d in scene.devices
        if not d.clean and not any(d.index in g for g in scene.listed_alive.values())
    }


def _holder(scene: Scene, pid: int, unexplained: set[int]) -> RemainingHolder | None:
    ref = processes.ref_of(pid)
    if ref is None or pid in scene.never:
        return None
    use = scene.users.get(pid, DeviceUse(pid))
    managed = set(scene.files.managed.values())
    v = judge(
        use,
        scene.files,
        set(scene.listed_alive.get(pid, ())),
        unexplained=unexplained,
        protected=scene.why_protected(pid),
    )
    if not v.gpus and not (use.open | use.mapped) & managed:
        return None  # it touches no managed GPU
    killed = scene.killed.get(ref)
    role, step, why = v.role, Step.KILL_GPU_HOLDERS, v.seen
    if killed is not None:
        role, step = Role.SUSPECT, killed.step
        why = (
            f"got SIGKILL in {killed.step.value} but has not exited (state "
            f"{processes.state_of(pid)}: uninterruptible sleep in the driver?)"
        )
    elif v.role is Role.SUSPECT and not v.protected:
        why = (
            f"{v.seen}, but it was not killed: it appeared after the holder step, or the step "
            "ran out of time (holders_timeout_s)"
        )
    elif v.protected:
        why = f"not signalled: {v.protected}"
    return RemainingHolder(
        process=processes.describe(ref),
        unit=processes.shown_path(processes.cgroup_of(pid).rsplit("/", 1)[-1]),
        devices=list(v.gpus),
        not_cleared_by=step,
        why=why,
        role=role,
        seen=v.seen,
        check=v.check,
    )


def diagnose(scene: Scene) -> tuple[list[RemainingHolder], str, str]:
    """(remaining holders, the diagnosis, the next action) for a teardown that ended STUCK."""
    lines: list[str] = []
    if scene.unit_active:
        lines.append(f"{scene.unit} is still active")
    unexplained = _unexplained(scene)
    for d in scene.devices:
        if d.clean:
            continue
        listed = [p for p in d.processes if d.index in scene.listed_alive.get(p, ())]
        dead = [p for p in d.processes if p not in listed]
        text = (
            f"GPU {d.index}: {d.used_mib} MiB used, baseline {d.baseline_mib} "
            f"(+{d.tolerance_mib} tolerance), processes {listed or 'none'}"
        )
        if dead:
            text += (
                f"; NVML also lists {dead}, which name no live holder (dead, or the PID now "
                "belongs to a newer process or an NVML client): a listed PID alone explains nothing"
            )
        lines.append(text)
    pids = set(scene.users) | set(scene.listed_alive)
    remaining = [
        h for h in (_holder(scene, pid, unexplained) for pid in sorted(pids)) if h is not None
    ]
    blockers = {
        pid: addrs
        for pid, addrs in scene.port_holders.items()
        if not any(h.process.pid == pid for h in remaining if h.role is Role.SUSPECT)
    }
    for pid, addrs in sorted(blockers.items()):
        lines.append(
            f"PID {pid} ({processes.comm_of(pid)}) listens on {', '.join(sorted(addrs))} port "
            f"{scene.port}, where vLLM binds"
        )
    return remaining, "; ".join(lines) or "not clean", _next_action(scene, remaining, blockers)


def _next_action(
    scene: Scene, remaining: list[RemainingHolder], blockers: Mapping[int, set[str]]
) -> str:
    suspects = [h for h in remaining if h.role is Role.SUSPECT]
    candidates = [h for h in remaining if h.role is Role.CANDIDATE]
    if scene.unit_active:
        return f"check `systemctl status {scene.unit}`: the manager did not stop it"
    if any(h.why.startswith("got SIGKILL") for h in suspects):
        return (
            "a killed process has not exited: look at its kernel stack (cat /proc/PID/stack); "
            "if it is stuck in the NVIDIA driver, drain the host and reboot (or reset the GPU "
            "by hand)"
        )
    protected = [h for h in suspects if h.why.startswith("not signalled: ")]
    if protected:
        pids = ", ".join(str(h.process.pid) for h in protected)
        mine = any("teardown.protected_" in h.why for h in protected)
        return f"if nvidia-smi shows the memory is theirs, stop PID(s) {pids} by hand" + (
            ", or take them out of teardown.protected_names/units" if mine else ""
        )
    if suspects:
        pids = ", ".join(str(h.process.pid) for h in suspects)
        return (
            f"PID(s) {pids} appeared on the GPUs after the holder step: find what starts them "
            "(ps -o ppid= PID) and stop it; the next retry kills what NVML lists"
        )
    if blockers:
        pids = ", ".join(map(str, sorted(blockers)))
        return (
            f"PID(s) {pids} listen where vLLM must bind but are not vLLM and use no managed "
            f"GPU, so they were not killed: stop them, or change vllm.port or vllm.host"
        )
    named = ""
    if candidates:
        pids = ", ".join(str(h.process.pid) for h in candidates)
        named = f"; candidates, never killed on that evidence: PID(s) {pids} (see each one's check)"
    return (
        "memory is held with no process behind it (none listed alive, none with the device "
        "open and mapped: a driver leak?): check `nvidia-smi` and dmesg for Xid errors; a GPU "
        f"reset or a reboot frees it{named}"
    )
