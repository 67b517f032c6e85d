"""What NVML shows of a GPU whose engine hangs spinning, beside a GPU at work: the measurement
the liveness rule's GPU signal and the simulated GPU's counters copy.

A tensor-parallel collective whose peer never comes leaves its kernel polling a flag that is
never set, and the host thread behind it spinning in a CUDA synchronize (100 % of a core). This
runs, one at a time and each in a process of its own, the shapes that matter:

- idle: a process that holds a CUDA context and does nothing;
- spin_sleep: `torch.cuda._sleep` (a kernel that spins on the clock, touching no memory), the
  host thread in `torch.cuda.synchronize()` behind it;
- poll_device_flag: a kernel that polls a flag in device memory that is never set (a stuck
  collective's wait on its peer's flag, as NCCL's and vLLM's custom all-reduce do);
- poll_host_flag: the same, polling a flag in mapped, pinned host memory (a proxy's flag),
  through its host pointer (unified addressing); skipped, saying why, on a GPU without it;
- decode_like: small bf16 GEMMs (batch 16, hidden 7168) and all-reduce-sized copies, back to
  back, as a decode step;
- big_gemm: 8192^3 bf16 products;
- d2d_copy: 1 GiB device-to-device copies (memory bound, no math);
- h2d_copy: 256 MiB pinned host-to-device copies (PCIe traffic).

For each, every `--interval-s` for `--seconds`, after a settle: utilization (gpu, memory), PCIe
TX/RX throughput, NVLink TX/RX (field values), SM clock, power, the energy counter, process
utilization where supported, GPM's DRAM bandwidth and SM activity where supported (Hopper), and
the workload's host CPU (from /proc). Medians, minima and maxima go to `--out` as JSON; a table
to stdout.

    python3 -m bench.gpu_hang_signature --out $OUT/gpu-hang-signature.json   # on the GPU host

Needs torch and nvidia-ml-py; the polling shapes need cupy too, and are skipped, saying why,
where it is missing (all three are on the lent GPU host). Every process it starts is its
own and is ended (by its PID) before the next shape starts; the GPU is never reset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CHILD = r"""
import os, sys, time
shape = sys.argv[1]
import torch
torch.cuda.init()
dev = torch.device("cuda")
torch.zeros(1, device=dev)
torch.cuda.synchronize()

def ready():
    print("ready", flush=True)

if shape == "idle":
    ready()
    while True:
        time.sleep(1)
elif shape == "spin_sleep":
    ready()
    while True:
        torch.cuda._sleep(int(20 * 2e9))
        torch.cuda.synchronize()
elif shape in ("poll_device_flag", "poll_host_flag"):
    try:
        import cupy as cp
    except ImportError as e:
        print(f"skip: cupy is not installed ({e}): it compiles the polling kernel", flush=True)
        sys.exit(0)
    src = r'''
    extern "C" __global__ void poll(volatile int* flag, int* out) {
        while (*flag == 0) { }
        *out = 1;
    }'''
    kern = cp.RawKernel(src, "poll")
    out = cp.zeros(1, dtype=cp.int32)
    if shape == "poll_device_flag":
        flag = cp.zeros(1, dtype=cp.int32)
        ptr = flag
    else:
        # Host memory the kernel reads across PCIe, as a proxy's flag. With unified addressing
        # (every 64-bit Linux host of a Hopper) a pinned host allocation is mapped into every
        # device at the same address as on the host (CUDA Runtime API, "Unified Addressing"): the
        # host pointer is the device's, no cudaHostGetDevicePointer (which the GPU image's cupy
        # lacks) needed. cudaHostAllocMapped (2) asks for the mapping all the same.
        dev_id = cp.cuda.Device().id
        unified = getattr(cp.cuda.runtime, "cudaDevAttrUnifiedAddressing", 41)
        uva = cp.cuda.runtime.deviceGetAttribute(unified, dev_id)
        if not uva:
            print("skip: this GPU has no unified addressing: a mapped host pointer is not the "
                  "device's", flush=True)
            sys.exit(0)
        import ctypes
        hptr = cp.cuda.runtime.hostAlloc(4, 2)  # kept until the process is killed
        ctypes.memset(hptr, 0, 4)
        mem = cp.cuda.UnownedMemory(hptr, 4, None, dev_id)
        ptr = cp.ndarray((1,), dtype=cp.int32, memptr=cp.cuda.MemoryPointer(mem, 0))
    kern((1,), (1,), (ptr, out))
    ready()
    cp.cuda.runtime.deviceSynchronize()  # never returns: the flag is never set
elif shape == "decode_like":
    a = torch.randn(16, 7168, device=dev, dtype=torch.bfloat16)
    ws = [torch.randn(7168, 7168, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    buf = torch.empty(16 * 7168, device=dev, dtype=torch.bfloat16)
    ready()
    while True:
        for w in ws:
            a = (a @ w).clamp_(-1, 1)
            buf.copy_(a.view(-1))  # an all-reduce's worth of bytes (229 KB)
        torch.cuda.synchronize()
elif shape == "big_gemm":
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ready()
    while True:
        for _ in range(10):
            c = a @ b
        torch.cuda.synchronize()
elif shape == "d2d_copy":
    a = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    b = torch.empty_like(a)
    ready()
    while True:
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize()
elif shape == "h2d_copy":
    h = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    d = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ready()
    while True:
        for _ in range(10):
            d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
"""

SHAPES = ["idle", "spin_sleep", "poll_device_flag", "poll_host_flag", "decode_like",
          "big_gemm", "d2d_copy", "h2d_copy"]  # fmt: skip


def _cpu_s(pid: int) -> float:
    """The process's CPU time, all threads (utime + stime)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Nvml:
    """The readings, each an error as data: a reading that a GPU does not support is None."""

    def __init__(self, index: int) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.name = pynvml.nvmlDeviceGetName(self.h)
        self.gpm = self._gpm_supported()
        self.last_proc_ts = 0
        self.gpm_prev: Any = None

    def _try(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # errors are data here
            return f"error: {type(e).__name__}: {e}"

    def _gpm_supported(self) -> bool:
        nv = self.nv
        try:
            return bool(nv.nvmlGpmQueryDeviceSupport(self.h).isSupportedDevice)
        except Exception:
            return False

    def _gpm(self) -> dict[str, Any]:
        nv = self.nv
        if not self.gpm:
            return {}
        try:
            sample = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(self.h, sample)
        except Exception as e:
            return {"gpm_error": str(e)}
        out: dict[str, Any] = {}
        if self.gpm_prev is not None:
            try:
                m = nv.c_nvmlGpmMetricsGet_t()
                m.version = nv.NVML_GPM_METRICS_GET_VERSION
                m.sample1 = self.gpm_prev
                m.sample2 = sample
                wanted = {
                    "gpm_sm_util": nv.NVML_GPM_METRIC_SM_UTIL,
                    "gpm_sm_occupancy": nv.NVML_GPM_METRIC_SM_OCCUPANCY,
                    "gpm_dram_bw_util": nv.NVML_GPM_METRIC_DRAM_BW_UTIL,
                    "gpm_any_tensor_util": nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
                    "gpm_pcie_tx_mb_s": nv.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
                    "gpm_pcie_rx_mb_s": nv.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
                    "gpm_nvlink_tx_mb_s": nv.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
                    "gpm_nvlink_rx_mb_s": nv.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
                }
                m.numMetrics = len(wanted)
                for i, mid in enumerate(wanted.values()):
                    m.metrics[i].metricId = mid
                nv.nvmlGpmMetricsGet(m)
                for i, key in enumerate(wanted):
                    out[key] = round(float(m.metrics[i].value), 2)
            except Exception as e:
                out["gpm_error"] = str(e)
            with contextlib.suppress(Exception):
                nv.nvmlGpmSampleFree(self.gpm_prev)
        self.gpm_prev = sample
        return out

    def read(self, pid: int | None) -> dict[str, Any]:
        nv, h = self.nv, self.h
        row: dict[str, Any] = {"t": time.monotonic()}
        u = self._try(nv.nvmlDeviceGetUtilizationRates, h)
        row["util_gpu"] = getattr(u, "gpu", None)
        row["util_memory"] = getattr(u, "memory", None)
        row["power_w"] = self._num(self._try(nv.nvmlDeviceGetPowerUsage, h), 1e-3)
        row["energy_mj"] = self._num(self._try(nv.nvmlDeviceGetTotalEnergyConsumption, h), 1)
        row["sm_clock_mhz"] = self._num(
            self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM), 1
        )
        row["mem_clock_mhz"] = self._num(
            self._try(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM), 1
        )
        row["pcie_tx_kb_s"] = self._num(
            self._try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES), 1
        )
        row["pcie_rx_kb_s"] = self._num(
            self._try(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES), 1
        )
        fields = self._try(
            nv.nvmlDeviceGetFieldValues,
            h,
            [nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX],
        )
        if isinstance(fields, list):
            for key, f in zip(("nvlink_tx_kib", "nvlink_rx_kib"), fields, strict=False):
                row[key] = f.value.ullVal if f.nvmlReturn == 0 else None
        procs = self._try(nv.nvmlDeviceGetProcessUtilization, h, self.last_proc_ts)
        if isinstance(procs, list):
            mine = [p for p in procs if pid is not None and p.pid == pid]
            if procs:
                self.last_proc_ts = max(p.timeStamp for p in procs)
            row["proc_sm_util"] = mine[-1].smUtil if mine else None
            row["proc_mem_util"] = mine[-1].memUtil if mine else None
        else:
            row["proc_sm_util"] = row["proc_mem_util"] = None
            row["proc_error"] = procs
        row.update(self._gpm())
        row["cpu_s"] = _cpu_s(pid) if pid else None
        return row

    @staticmethod
    def _num(v: Any, scale: float) -> float | None:
        return round(v * scale, 3) if isinstance(v, (int, float)) else None


def _stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in rows[0] if k not in ("t", "cpu_s", "energy_mj", "proc_error")]
    out: dict[str, Any] = {}
    for k in keys:
        vals = [r.get(k) for r in rows if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        else:
            errs = [r.get(k) for r in rows if isinstance(r.get(k), str)]
            out[k] = {"unsupported": errs[0] if errs else "no reading"}
    span = rows[-1]["t"] - rows[0]["t"]
    if rows[0].get("cpu_s") is not None and span > 0:
        out["host_cpu_fraction_of_a_core"] = round((rows[-1]["cpu_s"] - rows[0]["cpu_s"]) / span, 3)
    e0, e1 = rows[0].get("energy_mj"), rows[-1].get("energy_mj")
    if isinstance(e0, (int, float)) and isinstance(e1, (int, float)) and span > 0:
        out["mean_power_from_energy_w"] = round((e1 - e0) / 1000 / span, 1)
    out["samples"] = len(rows)
    out["seconds"] = round(span, 2)
    return out


def measure(nvml: Nvml, shape: str, seconds: float, interval_s: float, settle_s: float) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-c", CHILD, shape], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line.startswith("skip: "):  # what this host lacks for the shape, said by the child
            print(f"{shape}: skipped: {line[6:]}", file=sys.stderr, flush=True)
            return {"shape": shape, "skipped": line[6:]}
        if line != "ready":
            err = p.stderr.read() if p.stderr else ""
            return {"shape": shape, "error": f"child did not start: {line!r} {err[-2000:]}"}
        settle_end = time.monotonic() + settle_s
        while time.monotonic() < settle_end:
            nvml.read(p.pid)  # primes the GPM and process-utilization baselines
            time.sleep(interval_s)
        rows = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if p.poll() is not None:
                break
            rows.append(nvml.read(p.pid))
            time.sleep(interval_s)
        if len(rows) < 2:
            err = p.stderr.read() if p.stderr and p.poll() is not None else ""
            return {"shape": shape, "error": f"child ended early (rc {p.returncode}) {err[-2000:]}"}
        return {"shape": shape, **_stats(rows)}
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)  # our own child, by PID
        p.wait(timeout=60)


def table(results: list[dict[str, Any]]) -> str:
    cols = ["util_gpu", "util_memory", "power_w", "sm_clock_mhz", "pcie_tx_kb_s", "pcie_rx_kb_s",
            "nvlink_tx_kib", "proc_sm_util", "proc_mem_util", "gpm_sm_util", "gpm_sm_occupancy",
            "gpm_dram_bw_util", "gpm_any_tensor_util"]  # fmt: skip
    lines = ["shape | " + " | ".join(cols) + " | host CPU (cores)"]
    for r in results:
        if "error" in r or "skipped" in r:
            why = f"error: {r['error'][:200]}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"{r['shape']} | {why}")
            continue
        cells = []
        for c in cols:
            v = r.get(c, {})
            cells.append(str(v.get("median", "n/a")) if isinstance(v, dict) else "n/a")
        cpu = r.get("host_cpu_fraction_of_a_core")
        lines.append(f"{r['shape']} | " + " | ".join(cells) + f" | {cpu}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--interval-s", type=float, default=0.2)
    ap.add_argument("--settle-s", type=float, default=2.0)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeat", type=int, default=1)
    a = ap.parse_args()
    nvml = Nvml(a.gpu)
    results = []
    for rep in range(a.repeat):
        for shape in a.shapes.split(","):
            r = measure(nvml, shape, a.seconds, a.interval_s, a.settle_s)
            r["repeat"] = rep
            results.append(r)
            print(f"{shape} (run {rep + 1}) done", file=sys.stderr, flush=True)
    doc = {
        "what": "NVML readings of a GPU per workload shape (bench/gpu_hang_signature.py)",
        "gpu": str(nvml.name),
        "driver": str(nvml.nv.nvmlSystemGetDriverVersion()),
        "interval_s": a.interval_s,
        "seconds": a.seconds,
        "date": time.strftime("%Y-%m-%d"),
        "results": results,
    }
    a.out.write_text(json.dumps(doc, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
