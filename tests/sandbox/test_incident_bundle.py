"""The incident bundle as systemd runs the daemon: a STUCK in the sandbox
leaves one root-only file that names the holder and its device-file maps, and status names it."""

from __future__ import annotations

import json
import re
import stat
import urllib.request
from pathlib import Path

import pytest

from kimi_supervisor.ports import processes

from ..conftest import DaemonHelper, SandboxHelper

pytestmark = pytest.mark.systemd


def test_a_stuck_leaves_a_root_only_bundle_naming_the_protected_holder_and_its_device_maps(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    holder = sandbox.ghost(gpu="1", mib=20_000, title="nvidia-fabricmanager")  # protected
    r = daemon.kimi_mode("profile")
    assert r.returncode == 6 and "STUCK" in r.stdout + r.stderr, r.stdout + r.stderr
    # Its trigger, not only a path: a bundle an earlier test left in the sandbox's state is
    # found at the daemon's start (a path, no trigger) before this one is written.
    st = daemon.wait_status(
        lambda s: (s.get("incident_bundle") or {}).get("trigger") == "stuck",
        20,
        "the STUCK's bundle",
    )
    b = st["incident_bundle"]
    path = Path(b["path"])
    assert b["trigger"] == "stuck" and path.parent == sandbox.config.state.dir / "incidents"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    text = path.read_text()
    assert len(text.encode()) <= 1 << 20 and text.endswith("== end of the bundle ==\n")
    # The holder by its PID, with its /proc entries and the lines that map its device files.
    part = text.split(f"-- PID {holder.pid}: suspect:", 1)[1].split("\n-- PID ", 1)[0]
    assert "protected" in part and "status:\n  Name:" in part and "cgroup:\n" in part
    maps = part.split("maps of device files (", 1)[1].split("\n== ", 1)[0]
    assert re.search(r"/dev/nvidia1$", maps, re.M), maps
    assert f"PID {holder.pid} (compute, 20000 MiB)" in text  # NVML's view
    assert '"outcome": "stuck"' in text and "trigger:   stuck" in text
    # `kimi-mode status`, in words and in JSON, names it; the metrics count it.
    said = daemon.kimi_mode("status").stdout
    assert "incident:      the newest bundle (stuck at " in said, said
    assert str(path) in re.sub(r"\n +", "", said)  # at 80 columns a long path takes two rows
    out = daemon.kimi_mode("status", "-o", "json").stdout
    (line,) = [x for x in map(json.loads, out.splitlines()) if x.get("type") == "status"]
    assert line["incident_bundle"]["path"] == str(path)
    m = sandbox.config.metrics
    with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as f:
        metrics = f.read().decode()
    assert re.search(r"^kimi_supervisor_incident_bundles_total 1\.0$", metrics, re.M)
    assert re.search(
        r"^kimi_supervisor_incident_bundle_last_timestamp_seconds [1-9]", metrics, re.M
    )
    assert processes.is_alive(holder)  # a bystander of the bundle: read, never touched
