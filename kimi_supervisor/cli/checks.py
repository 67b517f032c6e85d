"""What can be checked of a host against a config: the files and the group it names
(`kimi-supervisor check-config`), and, for `kimi-mode doctor`, each precondition the daemon
needs at run time: the GPU driver and NVML, the system bus and the units, the daemon on its
socket, the stored baseline, the metrics, nvidia-persistenced.

Every check says what it found; a failed one says how to fix it; one that cannot be made here
(another user's view, no driver to ask) says so, with ok=None, and never counts as passed.
Checks only read: nothing here changes the host.
"""

from __future__ import annotations

import grp
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.output import CheckOut
from kimi_supervisor.config import Config


def ok(name: str, message: str) -> CheckOut:
    return CheckOut(name=name, ok=True, message=message)


def bad(name: str, message: str, fix: str) -> CheckOut:
    return CheckOut(name=name, ok=False, message=message, fix=fix)


def unknown(name: str, message: str) -> CheckOut:
    return CheckOut(name=name, ok=None, message=message)


def _as_whom() -> str:
    return "" if os.geteuid() == 0 else f" (checked as uid {os.geteuid()}; the daemon is root)"


# ------------------------------------------------------------------------------ the config's files
def check_vllm(config: Config, source: str) -> CheckOut:
    exe = Path(config.vllm.command[0])
    name = "vllm executable"
    fix = f"install vLLM there, or point vllm.command at it in {source}"
    if not exe.is_absolute():
        return bad(name, f"vllm.command[0] {exe} is not an absolute path", fix)
    try:
        st = exe.stat()
    except FileNotFoundError:
        return bad(name, f"vllm.command[0] {exe} does not exist", fix)
    except PermissionError:
        return unknown(name, f"vllm.command[0] {exe} cannot be looked at{_as_whom()}")
    if not stat.S_ISREG(st.st_mode):
        return bad(name, f"vllm.command[0] {exe} is not a file", fix)
    if not st.st_mode & 0o111:
        return bad(name, f"vllm.command[0] {exe} is not executable", f"chmod +x {exe}")
    return ok(name, f"{exe} is an executable file")


def check_group(config: Config) -> CheckOut:
    g = config.control.group
    try:
        members = grp.getgrnam(g).gr_mem
    except KeyError:
        return bad(
            "control group",
            f"control.group {g!r} does not exist: only root could use kimi-mode",
            f"groupadd --system {g} (the package creates it), then usermod -aG {g} USER",
        )
    who = ", ".join(members) if members else "no members yet (root only)"
    return ok("control group", f"{g} exists: {who}")


def _dir(name: str, key: str, path: Path | None, *, made_at_start: bool) -> CheckOut | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except FileNotFoundError:
        if made_at_start:
            # made with its parents (mkdir -p): only a file in the way can stop it
            above = next((a for a in path.parents if a.exists()), Path("/"))
            if above.is_dir():
                return ok(name, f"{key} {path} is made when the daemon needs it")
            return bad(
                name, f"{key} {path} cannot be made: {above} is not a directory", f"fix {key}"
            )
        return bad(name, f"{key} {path} does not exist", f"mkdir -p {path}, or fix {key}")
    except NotADirectoryError:
        return bad(name, f"{key} {path}: a file is in its path", f"fix {key}")
    except PermissionError:
        return unknown(name, f"{key} {path} cannot be looked at{_as_whom()}")
    if not stat.S_ISDIR(st.st_mode):
        return bad(name, f"{key} {path} is not a directory", f"fix {key}")
    return ok(name, f"{key} {path} is a directory")


def check_paths(config: Config) -> list[CheckOut]:
    out = [
        _dir("state directory", "state.dir", config.state.dir, made_at_start=True),
        _dir(
            "captures directory",
            "profiling.captures_dir",
            config.profiling.captures_dir,
            made_at_start=True,
        ),
        _dir("shared memory", "teardown.shm_dir", config.teardown.shm_dir, made_at_start=False),
        _dir("temporary files", "teardown.tmp_dir", config.teardown.tmp_dir, made_at_start=False),
        _dir(
            "simulated GPUs",
            "gpus.sim_dir",
            config.gpus.sim_dir if config.gpus.backend == "sim" else None,
            made_at_start=False,
        ),
    ]
    for key, path in (
        ("vllm.log_file", config.vllm.log_file),
        ("daemon.log_file", config.daemon.log_file),
    ):
        if path is not None:
            out.append(_dir("log directory", f"{key}'s folder", path.parent, made_at_start=False))
    return [c for c in out if c is not None]


def check_metrics_address(config: Config) -> CheckOut | None:
    m = config.metrics
    if not m.enabled:
        return None
    try:
        socket.getaddrinfo(m.address, m.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return bad(
            "metrics address",
            f"metrics.address {m.address!r} does not resolve: {e.strerror}",
            "set metrics.address to an address of this host (127.0.0.1, 0.0.0.0)",
        )
    return ok("metrics address", f"{m.address}:{m.port} resolves")


# What check-config cannot know, said each time (doctor checks them on the live host).
NOT_CHECKED = [
    "the GPUs, the driver and the baseline (kimi-mode doctor)",
    "systemd and vLLM's unit (kimi-mode doctor)",
    "that vllm.command runs vLLM: it is not run here",
]


def config_checks(config: Config, source: str) -> list[CheckOut]:
    out = [check_vllm(config, source), check_group(config), *check_paths(config)]
    if (m := check_metrics_address(config)) is not None:
        out.append(m)
    return out


# ------------------------------------------------------------------------------ the live host
def check_gpus(config: Config) -> list[CheckOut]:
    """The driver answers, the managed GPUs exist, the baseline is stored, persistence mode."""
    from kimi_supervisor.cli.compose import open_gpu
    from kimi_supervisor.ports.gpu import GpuUnavailable

    try:
        gpu = open_gpu(config)
        count = gpu.device_count()
        version = gpu.driver_version()
    except (GpuUnavailable, OSError) as e:
        fix = (
            "load the NVIDIA driver (nvidia-smi must work); after a driver upgrade, reboot"
            if config.gpus.backend == "nvml"
            else f"start the sandbox (gpus.sim_dir {config.gpus.sim_dir})"
        )
        return [bad("GPU driver", f"NVML does not answer: {e}", fix)]
    out = [ok("GPU driver", f"driver {version}, {count} GPU(s)")]
    managed = list(config.gpus.managed) or list(range(count))
    missing = [i for i in managed if i >= count]
    if missing:
        out.append(
            bad(
                "managed GPUs",
                f"gpus.managed names GPU(s) {missing}; NVML sees {count}",
                "fix gpus.managed (or the missing GPUs: nvidia-smi -L)",
            )
        )
    else:
        out.append(ok("managed GPUs", f"{len(managed)} managed: {managed}"))
    try:
        stored = stored_baseline(config.state.dir)
    except (OSError, ValueError) as e:
        out.append(unknown("baseline", f"cannot read the stored baseline{_as_whom()}: {e}"))
    else:
        if stored is None:
            out.append(
                bad(
                    "baseline",
                    "no baseline stored: teardowns judge 'clean' against a provisional one",
                    "with vLLM stopped: kimi-supervisor calibrate (the daemon also calibrates "
                    "when it finds the GPUs idle)",
                )
            )
        elif lacking := sorted(set(managed) - set(stored.devices)):
            out.append(
                bad(
                    "baseline",
                    f"the stored baseline lacks GPU(s) {lacking}",
                    "with vLLM stopped: kimi-supervisor calibrate",
                )
            )
        else:
            mib = ", ".join(f"{i}: {stored.devices[i]}" for i in managed)
            out.append(ok("baseline", f"stored, MiB per GPU {mib}"))
    out.append(_persistence(config, gpu, managed))
    if not missing:
        out.append(_health(config, gpu, managed))
    gpu.close()
    return out


def _health(config: Config, gpu: Any, managed: list[int]) -> CheckOut:
    """The GPUs' health signals, as the daemon reads them before each load
    (decide/gpuhealth.py): failing ones fail the check, whatever gpus.health_check says."""
    from kimi_supervisor.decide.gpuhealth import judge
    from kimi_supervisor.ports.gpu import reading_error

    name = "GPU health"
    try:
        v = judge(gpu.health(managed))
    except Exception as e:  # a check says what it could not read, never dies
        return unknown(name, f"the health signals could not be read: {reading_error(e)}")
    if v.verdict == "unread":
        return unknown(name, f"the health of GPU(s) {_listed(v.not_read)} could not be read: "
                       f"{v.text().removeprefix('not read: ')}")  # fmt: skip
    from kimi_supervisor.cli.render import fold_gpus

    unread = f" (not read: {'; '.join(fold_gpus(v.unread))})" if v.unread else ""
    found = "; ".join(fold_gpus([*v.failing, *v.warnings]))
    policy = config.gpus.health_check
    if v.failing:
        refuses = "refuses" if policy == "refuse" else f"warns (gpus.health_check = {policy!r})"
        return bad(
            name,
            f"{found}; the daemon {refuses} before a load{unread}",
            "reset the GPU (nvidia-smi -r -i N, with nothing running on it) or replace it; "
            "see dmesg for its Xid lines",
        )
    if v.warnings:
        if v.not_read:
            missing = "; ".join(fold_gpus(v.unread))
            return unknown(name, f"no failing signal among those read, but {found}; not read: "
                           f"{missing}")  # fmt: skip
        return ok(name, f"no failing signal, but {found}{unread}")
    return ok(name, f"no failing signal and no warning among those read{unread}")


def _listed(indices: list[int]) -> str:
    return ", ".join(map(str, indices)) or "-"


def stored_baseline(state_dir: Path) -> Any:
    """The baseline in state.json, read only (the store would move an unusable file aside;
    a check changes nothing): None if there is none; OSError or ValueError if unreadable."""
    import json

    from kimi_supervisor.store.state import PersistedState

    try:
        fd = os.open(state_dir / "state.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(1 << 20)
    return PersistedState.model_validate(json.loads(raw)).baseline


def _persistence(config: Config, gpu: Any, managed: list[int]) -> CheckOut:
    name = "nvidia-persistenced"
    if config.gpus.backend != "nvml":
        return unknown(name, "simulated GPUs: no persistence mode to check")
    try:
        import pynvml

        off = [
            i
            for i in managed
            if pynvml.nvmlDeviceGetPersistenceMode(pynvml.nvmlDeviceGetHandleByIndex(i)) == 0
        ]
    except Exception as e:  # an old driver, no permission
        return unknown(name, f"persistence mode could not be read: {e}")
    if off:
        return bad(
            name,
            f"persistence mode is off on GPU(s) {off}: each start re-initializes the driver "
            "and the baseline moves",
            "systemctl enable --now nvidia-persistenced",
        )
    return ok(name, "persistence mode is on for every managed GPU")


def check_systemd(config: Config) -> list[CheckOut]:
    import importlib.util

    from kimi_supervisor.ports.systemd import PystemdSystemd, SystemdError

    if importlib.util.find_spec("pystemd") is None:  # no daemon can run without it
        return [bad("system bus", "pystemd is not installed", "reinstall kimi-supervisor")]
    unit = config.service.unit
    sd = PystemdSystemd(config.systemd.scope, config.systemd.bus_address)
    user: int | str | None = None
    try:
        st = sd.status(unit)
        try:
            user = sd.run_as(unit) if st.load_state == "loaded" else None
        except SystemdError as e:
            user = str(e)
    except SystemdError as e:
        return [
            bad(
                "system bus",
                f"the {config.systemd.scope} manager does not answer on D-Bus: {e}",
                "systemctl status dbus (the daemon needs the system bus)",
            )
        ]
    finally:
        sd.close()
    out = [ok("system bus", f"the {config.systemd.scope} manager answers")]
    if st.load_state != "loaded":
        out.append(
            bad(
                "vLLM's unit",
                f"{unit} is {st.load_state or 'not loaded'}",
                f"install {unit} (the package ships it), then systemctl daemon-reload",
            )
        )
    else:
        out.append(ok("vLLM's unit", f"{unit} loaded, {st.active_state}/{st.sub_state}"))
        out.append(_vllm_user(unit, user))
    return out


def _vllm_user(unit: str, uid: int | str | None) -> CheckOut:
    """Whom the unit runs vLLM as: whose files in /dev/shm the teardown may remove."""
    import pwd

    name = "vLLM's user"
    if isinstance(uid, str):
        return unknown(name, f"cannot read {unit}'s user: {uid}")
    if uid is None:
        return bad(
            name,
            f"{unit} runs vLLM as a user this host has no entry for (or DynamicUser=): the "
            "teardown can tell none of vLLM's leftovers from other programs' files",
            "systemd-sysusers (it makes the package's kimi-vllm), or a drop-in with User=",
        )
    try:
        who = f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        who = f"uid {uid}"
    if uid == 0:
        return ok(
            name,
            f"{unit} runs vLLM as root: of root's files in /dev/shm the teardown removes only "
            'those vLLM\'s processes held (operations.md, "Running vLLM as root anyway")',
        )
    return ok(name, f"{unit} runs vLLM as {who}: the teardown removes that user's leftovers")


def check_daemon(sock: Path, status: Callable[[Path], dict[str, Any]]) -> tuple[CheckOut, bool]:
    """The daemon answers, and is neither STUCK nor FAILED: either is a person's to look at,
    named with its cause and where its incident bundle is. With whether it answered."""
    from kimi_supervisor.control.client import NotUnderstood, Unreachable

    try:
        data = status(sock)
    except NotUnderstood as e:  # it answers, but as another version does
        return bad("daemon", str(e), "systemctl restart kimi-supervisor"), False
    except Unreachable as e:
        fix = "systemctl start kimi-supervisor; kimi-mode logs --daemon"
        return bad("daemon", str(e), fix), False
    return _daemon_state(sock, data), True


def _daemon_state(sock: Path, data: dict[str, Any]) -> CheckOut:
    line = data.get("status_line", data.get("state"))
    state = data.get("state")
    if state in ("stuck", "failed"):
        bundle = data.get("incident_bundle") or {}
        if bundle.get("path"):
            where = f"its incident bundle: {bundle['path']} (root only)"
        elif bundle.get("error"):
            where = f"its incident bundle could not be written: {bundle['error']}"
        else:
            where = "no incident bundle was written"
        fix = (
            "kimi-mode status names what holds the GPUs; a teardown is retried on its own"
            if state == "stuck"
            else "fix the cause (kimi-mode history, kimi-mode logs), then kimi-mode MODE"
        )
        if state == "stuck":
            cause = (data.get("last_teardown") or {}).get("diagnosis")
        else:
            cause = (data.get("last_failure") or {}).get("reason")
        said = [str(line), f"cause: {cause}" if cause else "", where]
        return bad("daemon", "; ".join(x for x in said if x), fix)
    return ok("daemon", f"answers at {sock}: {line}")


def check_metrics(config: Config, daemon_up: bool) -> CheckOut | None:
    from kimi_supervisor.ports.http import request

    m = config.metrics
    if not m.enabled:
        return None
    host = "127.0.0.1" if m.address in ("0.0.0.0", "") else m.address
    host = "::1" if host == "::" else host
    if daemon_up:
        url = (
            f"http://[{host}]:{m.port}/metrics"
            if ":" in host
            else f"http://{host}:{m.port}/metrics"
        )
        r = request(url, timeout_s=2.0)
        if r.status == 200:
            return ok("metrics", f"{url} answers")
        return bad(
            "metrics",
            f"{url} does not answer (HTTP {r.status or 'no answer'})",
            "another process may hold the port (ss -ltnp); kimi-mode logs --daemon says why",
        )
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        try:
            s.bind((m.address, m.port))
        except OSError as e:
            return bad(
                "metrics",
                f"{m.address}:{m.port} cannot be listened on: {e.strerror}",
                "free the port (ss -ltnp) or set metrics.port",
            )
    return ok("metrics", f"{m.address}:{m.port} is free for the daemon")
