"""Run inside the booted Debian host, with the installed package's python: make the installed
kimi-supervisor serve the simulated GPU host and the fake vLLM, through /etc only (the config,
and drop-ins for both units), as an operator's test host would be set up.

    /usr/lib/kimi-supervisor/current/bin/python3 /src/tests/booted/configure.py /src [--ports V M]
"""

from __future__ import annotations

import grp
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from kimi_supervisor.config import Config
from kimi_supervisor.sandbox import simgpu
from kimi_supervisor.sandbox.simreader import SimGpu
from kimi_supervisor.store import baseline

SIM = Path("/var/lib/kimi-sim")
PYTHON = "/usr/lib/kimi-supervisor/current/bin/python3"  # the installed package's


def _fill(v: object) -> object:
    if isinstance(v, str):
        return v.replace("{sandbox}", str(SIM))
    if isinstance(v, list):
        return [_fill(x) for x in v]
    if isinstance(v, dict):
        return {k: _fill(x) for k, x in v.items()}
    return v


def gpus(sim: Path) -> None:
    """The simulated GPUs as a host's device files may be: 0660 root:video (Debian's driver
    packaging has used NVreg_DeviceFileGID=44; NVIDIA's default is 0666), so vLLM's user
    reaches them only through its unit's SupplementaryGroups=video. A context is made in the
    driver's side (driver/N) and recorded in alloc/, both the driver's, so those are too; the
    fake engine marks its GPUs at work in activity/."""
    video = grp.getgrnam("video").gr_gid
    for node in [*(sim / "dev").iterdir(), *(sim / "driver").iterdir()]:
        os.chown(node, 0, video)
        node.chmod(0o660)
    for shared in ("alloc", "activity"):  # what a context and the fake engine's steps write
        (sim / shared).mkdir(exist_ok=True)
        os.chown(sim / shared, 0, video)
        (sim / shared).chmod(0o1770)


def main(src: Path, ports: tuple[int, int] | None = None) -> None:
    raw = _fill(tomllib.loads((src / "config" / "sandbox.toml").read_text()))
    assert isinstance(raw, dict)
    if ports is not None:
        raw["vllm"]["port"], raw["metrics"]["port"] = ports
    raw["systemd"] = {"scope": "system"}
    raw["state"] = {"dir": "/var/lib/kimi-supervisor"}
    raw["control"] = {**raw["control"], "socket": "/run/kimi-supervisor/control.sock",
                      "group": "kimi"}  # fmt: skip
    raw["vllm"].pop("log_file", None)  # vLLM's output goes to the journal, as on a real host
    raw["vllm"]["argv_file"] = "/run/kimi-supervisor/vllm-argv.json"
    raw["profiling"]["captures_dir"] = "/var/lib/kimi-supervisor/captures"
    raw["teardown"]["shm_dir"] = "/dev/shm"
    cmd = raw["vllm"]["command"]
    cmd[0] = "/usr/local/bin/vllm"
    cmd[cmd.index("--tensor-parallel-size") + 1] = "4"
    # The package's own folders for vLLM: its caches, and the profile mode's trace folder (its
    # unit makes both its user's).
    raw["vllm"]["cache_dir"] = "/var/cache/kimi-supervisor/vllm"
    for mode in raw["modes"].values():
        mode["args"] = [
            a.replace(str(SIM / "traces"), "/var/lib/kimi-supervisor/traces") for a in mode["args"]
        ]
    config = Config.model_validate(raw)
    Path("/etc/kimi-supervisor/kimi-supervisor.toml").write_text(config.effective_toml())
    for d in ("logs", "tmp"):  # tmp: teardown.tmp_dir (vLLM's own /tmp is private)
        (SIM / d).mkdir(parents=True, exist_ok=True)
    simgpu.create_host(SIM / "gpu", 4)
    gpus(SIM / "gpu")
    vllm = Path("/usr/local/bin/vllm")
    vllm.write_text(f"#!{PYTHON}\nfrom kimi_supervisor.sandbox.fake_vllm import main\nmain()\n")
    vllm.chmod(0o755)
    env = f"Environment=KIMI_SIM_GPU_DIR={SIM / 'gpu'}\n"
    # The simulated driver keeps its state in files the daemon writes (a real one is in /dev):
    # writable for the hardened daemon. vLLM runs as its package's user, with no drop-in.
    extra = {"kimi-supervisor.service": f"ReadWritePaths={SIM}\n", "vllm-kimi-k25.service": ""}
    for unit, more in extra.items():
        d = Path("/etc/systemd/system") / f"{unit}.d"
        d.mkdir(parents=True, exist_ok=True)
        (d / "test-host.conf").write_text("[Service]\n" + env + more)
    # As `systemctl edit` does: the package enabled the daemon, so systemd has its unit loaded
    # and reads the new drop-ins only now (a start would run without them).
    if Path("/run/systemd/system").is_dir():
        subprocess.run(["systemctl", "daemon-reload"], check=True)
    gpu = SimGpu(SIM / "gpu")
    try:
        baseline.save(config.state.dir, baseline.calibrate(gpu, [0, 1, 2, 3]))
    finally:
        gpu.close()
    print(json.dumps({"config": "/etc/kimi-supervisor/kimi-supervisor.toml", "gpus": 4}))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]), (int(args[2]), int(args[3])) if args[1:2] == ["--ports"] else None)
