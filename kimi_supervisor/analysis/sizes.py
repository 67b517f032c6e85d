"""Each collective against the fabric: the message sizes a trace carries, the bus bandwidth the
calls achieved, their share of what the host's links can carry, and whether the calls are
latency-bound or bandwidth-bound by the sizes the capture holds.

**Sizes** come from the trace only, never guessed: an NCCL kernel's arguments ("In msg nelems",
"Out msg nelems", "dtype": PyTorch writes them on every GPU trace), or an operator's shapes where
the profiler recorded them (vLLM's profiler config `"torch_profiler_record_shapes": true`; its
default, and the shipped profile mode, leave it off, so gloo's and vLLM's CPU collectives and
vLLM's custom all-reduce carry no size). A message is sized as nccl-tests sizes it: an
all-reduce's tensor, an all-gather's output, a reduce-scatter's input.

**Bus bandwidth** is nccl-tests' (doc/PERFORMANCE.md): algbw = bytes / time, busbw = algbw x
2(n-1)/n for an all-reduce and x (n-1)/n for an all-gather or a reduce-scatter, n the ranks. It
is comparable with one link's bandwidth per direction whatever n is, which is why it is set
against the fabric's limit. The time is the call's transfer: the median rank's time in the call
after the last rank arrived (the wait is not the fabric's).

**The fabric's limit** is the slowest GPU's, per direction: its active NVLink links x the link's
rate (NVLink 1: 20 GB/s, 2 to 4: 25, 5: 50 per direction per link), else its PCIe link's
(generation's rate per lane x width: PCI-SIG's 2.5, 5, 8, 16, 32, 64 GT/s with their encodings:
0.25, 0.5, 0.985, 1.969, 3.938, 7.563 GB/s per lane), at the link's maximum: an idle GPU trains
its link down, and NVML's current reading then understates it.

**Latency- or bandwidth-bound**, by the sizes present: between the smallest and the largest
size that ELASTIC_MIN_CALLS calls or more carry, at least SIZE_RATIO apart, the elasticity
e = ln(time ratio) / ln(size ratio): time nearly flat in size (e <= LATENCY_E) is latency-bound
(fewer, fused or larger collectives help, not a faster link), time in proportion to size
(e >= BANDWIDTH_E) bandwidth-bound (only less data or a faster link helps). One size cannot
tell.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any

# nccl-tests' bus factor per collective, of n ranks, as the formula it is stated with.
BUS = {
    "all_reduce": (lambda n: 2 * (n - 1) / n, "2(n-1)/n"),
    "all_gather": (lambda n: (n - 1) / n, "(n-1)/n"),
    "reduce_scatter": (lambda n: (n - 1) / n, "(n-1)/n"),
}
SIZE_RATIO, ELASTIC_MIN_CALLS, LATENCY_E, BANDWIDTH_E = 2.0, 3, 0.3, 0.7
BY_SIZE_MAX = 6  # sizes listed per collective (the most called)
# GB/s per lane per direction by PCIe generation; per link per direction by NVLink version.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
NVLINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
# How to get sizes where a capture has none (said, never guessed).
HOW = (
    'start the profile mode\'s vLLM with "torch_profiler_record_shapes": true in its '
    "--profiler-config (the shipped profile mode leaves it off, vLLM's default): gloo's, vLLM's "
    "CPU and custom all-reduce calls then carry their shapes; NCCL kernels carry their sizes "
    "without it"
)


def sizes(pairs: list[tuple[int, float]], unsized: int, *, coll: str, ranks: int) -> dict[str, Any]:
    """One collective's sizes (see the module): `pairs` are its sized calls' (bytes, transfer
    µs), `unsized` how many calls carried no size."""
    factor, rule = BUS.get(coll, (lambda n: 1.0, "1"))
    out: dict[str, Any] = {
        "sized_calls": len(pairs),
        "unsized_calls": unsized,
        "rule": f"busbw = algbw x {rule}, n = {ranks} (nccl-tests)",
    }
    if not pairs:
        return {**out, "known": False, "how": HOW}
    f = factor(ranks)
    by: dict[int, list[float]] = {}
    for b, t in pairs:
        by.setdefault(b, []).append(t)
    counts = Counter({b: len(ts) for b, ts in by.items()})
    rows = []
    for b, calls in counts.most_common(BY_SIZE_MAX):
        t = statistics.median(by[b])
        alg = b / t / 1e3 if t > 0 else 0.0  # bytes per µs is 1e6 B/s: / 1e3 is GB/s
        rows.append(
            {
                "bytes": b,
                "calls": calls,
                "transfer_ms_p50": round(t / 1000, 4),
                "algbw_gbps": round(alg, 3),
                "busbw_gbps": round(alg * f, 3),
            }
        )
    per_call = sorted(b / t / 1e3 * f for b, t in pairs if t > 0)
    return {
        **out,
        "known": True,
        "bytes_per_call": counts.most_common(1)[0][0],
        "busbw_gbps_p50": round(statistics.median(per_call), 3) if per_call else 0.0,
        "by_size": rows,
        "bound": bound(by),
    }


def bound(by: dict[int, list[float]]) -> dict[str, Any]:
    """Latency- or bandwidth-bound from the sizes present (see the module)."""
    held = sorted(b for b, ts in by.items() if len(ts) >= ELASTIC_MIN_CALLS and b > 0)
    if len(held) < 2 or held[-1] / held[0] < SIZE_RATIO:
        one = f"{held[0] if held else max(by)} bytes" if len(held) <= 1 else "sizes too close"
        return {
            "reading": "not told",
            "said": f"one size ({one}) in this capture: whether the calls are latency- or "
            f"bandwidth-bound needs sizes at least {SIZE_RATIO:g}x apart",
        }
    small, large = held[0], held[-1]
    ts, tl = statistics.median(by[small]), statistics.median(by[large])
    if ts <= 0 or tl <= 0:
        return {"reading": "not told", "said": "a size's transfer time is 0"}
    e = math.log(tl / ts) / math.log(large / small)
    reading = (
        "latency-bound" if e <= LATENCY_E else "bandwidth-bound" if e >= BANDWIDTH_E else "between"
    )
    said = (
        f"{large / small:.1f}x the bytes ({small} to {large}) took {tl / ts:.2f}x the time: "
        f"elasticity {e:.2f} ({'<=' if e <= LATENCY_E else '>=' if e >= BANDWIDTH_E else 'between'}"
        f" {LATENCY_E if e <= LATENCY_E else BANDWIDTH_E if e >= BANDWIDTH_E else '0.3 and 0.7'})"
    )
    return {"reading": reading, "elasticity": round(e, 3), "said": said}


def limit(fabric: Any) -> dict[str, Any] | None:
    """The fabric's limit per direction (GB/s) and how it was found, from the capture's fabric
    reading (ports/gpu.py's: per GPU, its PCIe link and NVLink); None where no GPU's reading
    gives one."""
    gpus = fabric.get("gpus") if isinstance(fabric, dict) else None
    if not isinstance(gpus, list):
        return None
    nvlink: list[tuple[float, str]] = []
    pcie: list[tuple[float, str]] = []
    for g in gpus:
        if not isinstance(g, dict):
            continue
        nv, link = g.get("nvlink") or {}, g.get("pcie") or {}
        active, version = nv.get("active"), nv.get("version")
        if isinstance(active, int) and active > 0 and version not in NVLINK_GBPS:
            return None  # links active at a rate not read: no limit rather than a wrong one
        if isinstance(active, int) and active > 0 and version in NVLINK_GBPS:
            nvlink.append(
                (
                    active * NVLINK_GBPS[version],
                    f"GPU {g.get('index')}: NVLink "
                    f"{version}, {active} active links x {NVLINK_GBPS[version]:g} GB/s",
                )
            )
        gen = link.get("max_gen") or link.get("gen")
        width = link.get("max_width") or link.get("width")
        now = "" if link.get("max_gen") and link.get("max_width") else " (its link now: max unread)"
        if gen in PCIE_LANE_GBPS and isinstance(width, int) and width > 0:
            pcie.append((PCIE_LANE_GBPS[gen] * width, f"GPU {g.get('index')}: PCIe Gen{gen} "
                         f"x{width}{now}"))  # fmt: skip
    # Every GPU on NVLink: its slowest's links. Else a GPU without one reaches the others over
    # PCIe: the slowest PCIe link.
    read = [g for g in gpus if isinstance(g, dict) and g.get("nvlink")]
    each = nvlink if nvlink and len(nvlink) == len(read) else pcie
    if each is pcie and pcie:
        why = "no GPU has an active NVLink" if not nvlink else "not every GPU has an active NVLink"
        each = [(gbps, f"{said} ({why})") for gbps, said in pcie]
    if not each:
        return None
    gbps, said = min(each)
    return {"gbps": round(gbps, 3), "said": f"{said}: {gbps:.1f} GB/s per direction"}


def fabric_line(fabric: Any) -> str:
    """The fabric as the operator reads it: each GPU's PCIe link and NVLink, as NVML reported
    them at capture time."""
    gpus = fabric.get("gpus") if isinstance(fabric, dict) else None
    if not isinstance(gpus, list) or not gpus:
        why = fabric.get("error") if isinstance(fabric, dict) else None
        return f"fabric: not read ({why})" if why else "fabric: not recorded with this capture"
    parts = []
    for g in gpus:
        if not isinstance(g, dict):
            continue
        p, nv = g.get("pcie") or {}, g.get("nvlink") or {}
        link = (
            f"PCIe Gen{p.get('gen')} x{p.get('width')} (max Gen{p.get('max_gen')} "
            f"x{p.get('max_width')})"
            if p
            else "PCIe unread"
        )
        if not nv:
            link += ", NVLink unread"
        elif nv.get("links"):
            link += f", NVLink {nv.get('version')}: {nv.get('active')} of {nv['links']} active"
        else:
            link += ", no NVLink"
        unread = g.get("unread") or []
        if isinstance(unread, list) and unread:
            link += f" (unread: {'; '.join(map(str, unread[:4]))})"
        parts.append(f"GPU {g.get('index')} {g.get('name') or ''}".rstrip() + f": {link}")
    lim = limit(fabric)
    tail = f"; limit {lim['said']}" if lim else "; no limit can be read from it"
    return f"fabric ({fabric.get('source', 'NVML at capture time')}): " + "; ".join(parts) + tail
