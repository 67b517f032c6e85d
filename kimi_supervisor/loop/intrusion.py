"""A foreign process on a managed GPU while vLLM loads: found from what NVML lists.

A teardown's CLEAN holds only until something else takes a GPU. vLLM takes minutes to load (30+
on the real host), and a process that starts on a managed GPU meanwhile makes it run out of
memory with no explanation. While loading, every live process NVML lists on a managed GPU must be
in vLLM's unit; anything else is an intruder. As in the teardown's rung 1, a listed PID names a
process only if it is the one NVML means (teardown/listing.py: alive, started before it was
first seen listed, that GPU's device file open and mapped); a dead, recycled or foreign-namespace
PID, an NVML client or another GPU's job explains nothing and is no intruder.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kimi_supervisor.model import Mode, title, utcnow
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.openfiles import NodeKey
from kimi_supervisor.teardown.listing import FirstListed


@dataclass(frozen=True)
class Intruder:
    pid: int
    gpu: int
    name: str


def foreign(
    listed: Mapping[int, Iterable[int]],
    unit_pids: set[int],
    device_paths: Mapping[int, str],
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
            if first_listed.holder(gpu, pid, device_paths[gpu], node_key) is None:
                continue
            argv = processes.cmdline_of(pid)
            out.append(Intruder(pid, gpu, title(argv, processes.comm_of(pid))))
    return out


def incident(found: list[Intruder], unit: str, loading: Mode) -> tuple[str, dict[str, Any]]:
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
