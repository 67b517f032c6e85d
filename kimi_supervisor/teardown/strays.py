"""Strays: what of vLLM a teardown kills beyond its unit, and, before a switch, who holds vLLM's
port that no teardown would stop.

Strays are the unit's processes at the start that escaped its cgroup, the listeners where vLLM
binds that hold a managed GPU or are an ancestor of a live holder of one (a vLLM started by hand:
its API server listens, its workers hold the GPUs), and live processes with vLLM's signature that
NVML lists on a managed GPU (as teardown/listing.py names them): a vLLM serving other GPUs is not
ours.

A listener where vLLM binds is a teardown's target only if it is in vLLM's tree (the unit's
cgroup and its main process's descendants, or an ancestor of a live holder of a managed GPU) or
holds a managed GPU by the evidence ladder's own rules (teardown/ownership.py). Anything else (a
plain server, a CUDA job or another team's vLLM on unmanaged GPUs) is never signalled, so a
switch would stop the serving vLLM and then fail to start the next one on a port it cannot have.
Such a switch is refused before anything stops.

Before the teardown the serving vLLM explains the managed GPUs' memory, so rung 2 cannot be
judged yet: a listener that has a managed GPU's device file open and mapped is left to the
teardown (which kills it if the memory turns out unexplained), never refused for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from kimi_supervisor.config import Config
from kimi_supervisor.model import Evidence, title
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.clock import Clock
from kimi_supervisor.ports.gpu import GpuPort, GpuUnavailable
from kimi_supervisor.ports.processes import ProcessRef
from kimi_supervisor.ports.systemd import SystemdPort
from kimi_supervisor.teardown.events import ignore
from kimi_supervisor.teardown.gpuview import GpuView, Target
from kimi_supervisor.teardown.listing import Sighting
from kimi_supervisor.teardown.ownership import judge
from kimi_supervisor.teardown.scan import has_vllm_signature, listeners, unit_tree


def holders_parents(view: GpuView) -> dict[int, set[int]]:
    """Ancestor PID -> the live holders of managed GPUs (rung 1) below it: a vLLM started by
    hand, outside the unit, is an API server whose engine's workers hold the GPUs."""
    out: dict[int, set[int]] = {}
    for holder in view.live_listed():
        for parent in processes.ancestors(holder):
            if parent > 1:
                out.setdefault(parent, set()).add(holder)
    return out


def stray_targets(
    snapshot: list[ProcessRef],
    found: Mapping[int, set[str]],
    port: int,
    *,
    view: GpuView,
    patterns: list[re.Pattern[str]],
) -> list[Target]:
    """The strays to kill: `snapshot` is the unit's tree at the start, `found` the listeners
    where vLLM binds (PID -> addresses)."""
    targets: dict[ProcessRef, Target] = {}
    for ref in snapshot:
        if processes.is_alive(ref):
            targets[ref] = Target(ref, Evidence.ESCAPED_UNIT, "escaped the unit's cgroup")
    # A port alone is no evidence, nor is a command line: another team's vLLM on its own GPUs
    # listening on the wildcard address is not ours.
    parents = holders_parents(view)
    for pid, addrs in found.items():
        lref = processes.ref_of(pid)
        if lref is None or lref in targets:
            continue
        where = f"listens on {', '.join(sorted(addrs))} port {port}, where vLLM binds"
        if view.holds_managed_gpu(pid):
            targets[lref] = Target(lref, Evidence.LISTENS_ON_PORT, f"{where}; holds a managed GPU")
        elif pid in parents:
            held = ", ".join(map(str, sorted(parents[pid])))
            targets[lref] = Target(
                lref,
                Evidence.LISTENS_ON_PORT,
                f"{where}; an ancestor of PID(s) {held}, which hold a managed GPU",
            )
    for pid, gpus in view.live_listed().items():
        vref = view.alive_listed[pid]
        if vref not in targets and has_vllm_signature(pid, patterns):
            targets[vref] = Target(
                vref, Evidence.VLLM_SIGNATURE, f"vLLM process on managed GPU {min(gpus)}"
            )
    return list(targets.values())


@dataclass(frozen=True)
class Blocker:
    pid: int
    name: str  # its title
    addresses: tuple[str, ...]
    what: str  # what it is, by the ladder's evidence

    def describe(self, port: int) -> str:
        return (
            f"PID {self.pid} ({self.name}) listens on {', '.join(self.addresses)} port {port}, "
            f"where vLLM must bind; it is not vLLM's and {self.what}"
        )


def port_blockers(
    config: Config,
    systemd: SystemdPort,
    gpu: GpuPort,
    *,
    baselines: dict[int, int],
    clock: Clock,
    listed_since: Mapping[Sighting, int] | None = None,
) -> list[Blocker]:
    """The listeners where vLLM binds that a teardown would never stop. Free unless something
    listens; empty when the GPUs cannot be read (the teardown then judges on its own)."""
    v = config.vllm
    tree = {r.pid for r in unit_tree(systemd, config.service.unit, ignore)}
    found = listeners(v.port, v.host, tree)
    strangers = {pid: addrs for pid, addrs in found.items() if pid not in tree}
    if not strangers:
        return []
    try:
        view = GpuView(gpu, clock, baselines, config.gpus.tolerance_mib, ignore, listed_since or {})
        view.sample()
        listed = view.listed_anywhere()
    except GpuUnavailable:
        return []
    out: list[Blocker] = []
    parents = holders_parents(view)
    for pid, addrs in sorted(strangers.items()):
        if pid in view.live_listed() or pid in parents:
            continue  # rung 1, or the parent of a rung-1 holder: the teardown kills it
        use = view.use_of(pid)
        # Every managed GPU counted as unexplained: open and mapped is left to the teardown.
        verdict = judge(use, view.files(), listed.get(pid, set()), unexplained=set(view.paths))
        if verdict.evidence is not None:
            continue  # rung 2 if the memory turns out unexplained: the teardown judges
        what = (
            f"uses no managed GPU ({verdict.seen})"
            if use.open or use.mapped or listed.get(pid)
            else "uses no GPU"
        )
        name = title(processes.cmdline_of(pid), processes.comm_of(pid), 48)
        out.append(Blocker(pid, name, tuple(sorted(addrs)), what))
    return out
