"""Which collective a kernel or an operator is, by name: every implementation vLLM 0.16 runs
named apart, all-gathers and reduce-scatters apart from all-reduces (docs/operations.md has the
table as the operator reads it).

Meta's HolisticTraceAnalysis takes a kernel for communication when its name holds `ncclKernel`
(`hta/utils/utils.py`): vLLM's own all-reduce (`cross_device_reduce_2stage`) is compute there, and
on a host that runs it for every small all-reduce, the all-reduce share reads near zero. Here
each implementation has its row; a name that looks like communication but has no row is counted
as `other` communication and listed by name, so that an unknown kernel is seen, never hidden.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, OTHER_COMM = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "other",
)
# The collectives whose every rank's output needs every rank's input: none can end on any rank
# before the last rank has arrived, which is what splits their time into waiting and transfer.
SPLIT = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)
KINDS = (*SPLIT, OTHER_COMM)

# (pattern, collective, implementation); the first row that matches wins. The names are the
# kernels' and operators' as the profiler writes them.
TABLE: list[tuple[re.Pattern[str], str, str]] = [
    # NCCL (PyTorch's ProcessGroupNCCL and vLLM's PyNcclCommunicator): ncclDevKernel_AllReduce_
    # Sum_bf16_RING_LL (NCCL 2.19+; the H200 fixture), ncclKernel_AllReduce_RING_LL_Sum_half
    # (before).
    (re.compile(r"^nccl(Dev)?Kernel_AllReduce", re.I), ALL_REDUCE, "NCCL"),
    (re.compile(r"^nccl(Dev)?Kernel_AllGather", re.I), ALL_GATHER, "NCCL"),
    (re.compile(r"^nccl(Dev)?Kernel_ReduceScatter", re.I), REDUCE_SCATTER, "NCCL"),
    (re.compile(r"^nccl", re.I), OTHER_COMM, "NCCL"),  # Broadcast, SendRecv, Reduce, AllToAll
    # vLLM's custom all-reduce over CUDA IPC (csrc/custom_all_reduce.cuh).
    (re.compile(r"cross_device_reduce_[12]stage"), ALL_REDUCE, "vLLM custom all-reduce"),
    # vLLM's quick all-reduce on ROCm (csrc/quickreduce): allreduce_prototype_oneshot/twoshot.
    (re.compile(r"allreduce_prototype|quick_?reduce", re.I), ALL_REDUCE, "vLLM quick all-reduce"),
    # PyTorch's symmetric memory (c10d/symm_mem: one_shot_all_reduce_kernel,
    # two_shot_all_reduce_kernel, multimem_all_reduce_kernel, multimem_one_shot_reduce_kernel).
    (
        re.compile(r"multimem_(one_shot_)?(all_)?reduce|(one|two)_shot_all_reduce"),
        ALL_REDUCE,
        "symmetric memory",
    ),
    (re.compile(r"multimem_all_gather"), ALL_GATHER, "symmetric memory"),
    (re.compile(r"reduce_scatter.*symm|symm.*reduce_scatter"), REDUCE_SCATTER, "symmetric memory"),
    # FlashInfer's (TensorRT-LLM's) all-reduce fused with the RMS norm.
    (re.compile(r"allreduce_fusion|lamport", re.I), ALL_REDUCE, "FlashInfer all-reduce fusion"),
    # vLLM's CPU build: shared memory between the ranks' processes (csrc/cpu/shm.cpp).
    (re.compile(r"shm_allreduce"), ALL_REDUCE, "vLLM CPU shared memory"),
    (re.compile(r"shm_all_gather|shm_gather"), ALL_GATHER, "vLLM CPU shared memory"),
    (re.compile(r"shm_send|shm_recv"), OTHER_COMM, "vLLM CPU shared memory"),
    # gloo's worker threads' ranges, where a gloo collective runs (the c10d operator only hands
    # it over; analysis/timeline.py takes the kind from that operator: gloo runs a
    # reduce-scatter as `gloo:all_reduce`).
    (re.compile(r"^gloo:all_?reduce"), ALL_REDUCE, "gloo"),
    (re.compile(r"^gloo:_?all_?gather"), ALL_GATHER, "gloo"),
    (re.compile(r"^gloo:_?reduce_?scatter"), REDUCE_SCATTER, "gloo"),
    (re.compile(r"^gloo:"), OTHER_COMM, "gloo"),
    # torch.distributed's operators (gloo on a CPU, or any backend's CPU-side call).
    (re.compile(r"c10d::allreduce|gloo:all_?reduce|^all_reduce$", re.I), ALL_REDUCE, "c10d"),
    (re.compile(r"c10d::_?allgather|gloo:all_?gather|^all_gather", re.I), ALL_GATHER, "c10d"),
    (re.compile(r"c10d::_?reduce_scatter|gloo:reduce_?scatter", re.I), REDUCE_SCATTER, "c10d"),
]
# What looks like communication without a row of the table: counted as `other`, named.
LOOKS_LIKE = re.compile(
    r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|cross_device|custom_ar|gloo|"
    r"c10d|broadcast|sendrecv|record_param_comms|shm_",
    re.IGNORECASE,
)
# NCCL kernels say which collective they are in their arguments (PyTorch 2.4+: `Collective
# name`), which wins over the name.
_BY_ARG = {
    "allreduce": ALL_REDUCE,
    "allgather": ALL_GATHER,
    "_allgather_base": ALL_GATHER,
    "reduce_scatter": REDUCE_SCATTER,
    "_reduce_scatter_base": REDUCE_SCATTER,
}


@dataclass(frozen=True)
class Collective:
    """Which collective a name is (one of KINDS), and which implementation ran it."""

    kind: str
    implementation: str


def collective(name: str) -> Collective | None:
    """The collective and implementation of a kernel or operator's name; None when it is not
    communication. A name that looks like communication without a row: ("other", "unknown")."""
    for pattern, kind, impl in TABLE:
        if pattern.search(name):
            return Collective(kind, impl)
    if LOOKS_LIKE.search(name):
        return Collective(OTHER_COMM, "unknown")
    return None


def from_args(args: dict[str, Any] | None) -> str | None:
    """The collective an NCCL kernel's arguments name, if they do."""
    named = (args or {}).get("Collective name")
    return _BY_ARG.get(named.lower()) if isinstance(named, str) else None


def group_of(args: dict[str, Any] | None) -> str:
    """The process group a kernel's arguments name (NCCL's), else "" (one sequence per kind)."""
    g = (args or {}).get("Process Group Name")
    return str(g) if g is not None else ""


# Bytes per element of the dtypes the profiler names: record_shapes' "Input type" (C++ names,
# "float", "c10::BFloat16") and NCCL kernels' "dtype" (torch's, "BFloat16", "Float").
DTYPE_BYTES = {
    "float": 4, "double": 8, "half": 2, "bfloat16": 2, "int": 4, "long int": 8, "long": 8,
    "short int": 2, "short": 2, "signed char": 1, "unsigned char": 1, "char": 1, "byte": 1,
    "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4,
    "float64": 8, "complex<float>": 8, "complexfloat": 8, "complex<double>": 16,
}  # fmt: skip


def dtype_bytes(name: Any) -> int | None:
    """An element's size in bytes, by the profiler's dtype name; None for a name not known
    (a TensorList, an empty type): never guessed."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower().removeprefix("c10::").removeprefix("at::")
    return DTYPE_BYTES.get(key)


def _numel(dims: Any) -> int | None:
    if not isinstance(dims, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        return None
    n = 1
    for d in dims:
        n *= d
    return n


def shape_of(args: dict[str, Any] | None) -> tuple[int, int | None] | None:
    """What record_shapes' arguments of a collective's operator say of its message: the largest
    tensor among its inputs, as (elements, bytes per element, None where its type is not a
    dtype: a TensorList's); None where they carry no tensor. The largest input is the message as
    nccl-tests sizes it: an all-reduce's tensor, an all-gather's output, a reduce-scatter's
    input (`c10d::_allgather_base_(out, in)`, `c10d::_reduce_scatter_base_(out, in)`)."""
    dims, types = (args or {}).get("Input Dims"), (args or {}).get("Input type")
    if not isinstance(dims, list):
        return None
    types = types if isinstance(types, list) else []
    best: tuple[int, int | None] | None = None
    for i, d in enumerate(dims):
        n = _numel(d)
        size = dtype_bytes(types[i]) if i < len(types) else None
        if n is None and isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            parts = [_numel(x) for x in d]  # a TensorList: its tensors together, dtype unsaid
            n, size = (sum(p for p in parts if p is not None), None) if None not in parts else (
                None, None)  # fmt: skip
        if n is not None and n > 0 and (best is None or n > best[0]):
            best = (n, size)
    return best


def nccl_bytes(args: dict[str, Any] | None) -> int | None:
    """An NCCL kernel's message in bytes, as nccl-tests sizes it (the larger of its input and
    output: an all-gather's output, a reduce-scatter's input), from its arguments ("In msg
    nelems", "Out msg nelems", "dtype": PyTorch's record_param_comms, in every GPU trace);
    None where they do not say."""
    a = args or {}
    counts = [a.get("In msg nelems"), a.get("Out msg nelems")]
    known = [c for c in counts if isinstance(c, int) and not isinstance(c, bool) and c >= 0]
    size = dtype_bytes(a.get("dtype"))
    if not known or size is None:
        return None
    return max(known) * size
