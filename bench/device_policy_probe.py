"""Does the daemon unit's confinement let NVML work on this host's driver? Measured, not assumed:
the [Service] hardening lines of units/kimi-supervisor.service (DevicePolicy=closed with its
DeviceAllow= list, the system call filter, MemoryDenyWriteExecute=, the capability bounding set,
...) go into a probe unit of a real systemd user manager (carried where the host has none) whose
process initialises NVML and reads every GPU's memory and process list. A control unit with
DevicePolicy=closed and no DeviceAllow= must fail: otherwise the manager does not enforce device
policies here and the first probe proves nothing about the device list.

    python3 -m bench.device_policy_probe --out probe.json     # on a GPU host, as root
    python3 -m bench.device_policy_probe --render probe.json --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_section
from kimi_supervisor.sandbox.sandbox import MOUNT_SETTINGS
from kimi_supervisor.sandbox.usermanager import UserManager

ROOT = Path(__file__).resolve().parents[1]
NVML = (
    "import pynvml as n; n.nvmlInit(); c = n.nvmlDeviceGetCount(); "
    "print('gpus', c, [(n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(i)).used >> 20, "
    "len(n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(i)))) "
    "for i in range(c)])"
)
KEYS = (
    "NoNewPrivileges", "CapabilityBoundingSet", "DevicePolicy", "DeviceAllow", "ProtectKernel",
    "ProtectClock", "ProtectHostname", "LockPersonality", "MemoryDenyWriteExecute",
    "RestrictRealtime", "RestrictSUIDSGID", "RestrictNamespaces", "RestrictAddressFamilies",
    "SystemCallArchitectures", "SystemCallFilter", "SystemCallErrorNumber", "UMask",
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateMounts",
)  # fmt: skip


def hardening() -> list[str]:
    text = (ROOT / "units" / "kimi-supervisor.service").read_text()
    return [ln for ln in text.splitlines() if ln.startswith(KEYS)]


def probe(m: UserManager, name: str, lines: list[str], out_dir: Path) -> dict[str, object]:
    log = out_dir / f"{name}.log"
    env = f"Environment=PYTHONPATH={':'.join(p for p in sys.path if p)}\n"
    body = "".join(f"{ln}\n" for ln in lines)
    unit = f"kimi-devprobe-{name}.service"
    (m.unit_dir / unit).write_text(
        f'[Service]\nType=oneshot\nExecStart={sys.executable} -c "{NVML}"\n{env}{body}'
        f"StandardOutput=file:{log}\nStandardError=file:{log}\n"
    )
    m.systemctl("daemon-reload")
    t0 = time.monotonic()
    r = m.systemctl("start", unit, check=False)
    took = time.monotonic() - t0
    return {
        "lines": lines,
        "ok": r.returncode == 0,
        "seconds": round(took, 2),
        "output": log.read_text(errors="replace")[-600:] if log.exists() else "",
    }


def render(path: Path) -> str:
    d = json.loads(path.read_text())
    rows = [
        ("the unit's hardening" + (f" (but {', '.join(d['manager_cannot_apply'])}, which that "
         "manager cannot build)" if d["manager_cannot_apply"] else ""), d["unit_hardening"]),
        ("DevicePolicy=closed, no DeviceAllow= (the control)", d["closed_without_allow"]),
        ("no confinement", d["no_confinement"]),
    ]  # fmt: skip
    lines = [
        f"From `{path}`: `/proc/devices` lists {', '.join(d['proc_devices'])}.",
        "",
        "| probe unit | NVML init, memory and processes of every GPU |",
        "|---|---|",
    ]
    for what, r in rows:
        first = (r["output"].strip().splitlines() or [""])[-1][:90]
        lines.append(f"| {what} | {'works' if r['ok'] else 'fails'}: `{first}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path, help="a probe's JSON, rendered as Markdown")
    ap.add_argument("--write", type=Path, help="with --render: into this document's section")
    args = ap.parse_args()
    if args.render:
        body = render(args.render)
        if args.write:
            write_section(args.write, "device-policy", body)
        print(body, end="")
        return 0
    if args.out is None:
        ap.error("--out or --render")
    work = Path(tempfile.mkdtemp(prefix="kimi-devprobe-"))
    m = UserManager.start(work)
    try:
        lines = hardening()
        mounts = [ln for ln in lines if ln.split("=", 1)[0] in MOUNT_SETTINGS]
        off = m.cannot_apply(mounts)
        kept = [ln for ln in lines if ln not in off]
        devices = [ln for ln in Path("/proc/devices").read_text().splitlines() if "nvidia" in ln]
        result = {
            "proc_devices": devices,
            "dev_nodes": sorted(str(p) for p in Path("/dev").glob("nvidia*")),
            "manager_cannot_apply": off,
            "unit_hardening": probe(m, "unit", kept, work),
            "closed_without_allow": probe(m, "closed", ["DevicePolicy=closed"], work),
            "no_confinement": probe(m, "none", [], work),
        }
    finally:
        m.stop()
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
