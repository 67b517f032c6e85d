"""How a mode's argv reaches vLLM byte for byte, and how the mode of a running vLLM is read back.

The daemon writes the exact argv as a JSON array into the argv file; the unit's ExecStart runs
`kimi-supervisor launch-vllm --argv-file %t/kimi-supervisor/vllm-argv.json`, which execs it.
No shell and no systemd quoting rules stand in between, so JSON arguments with quotes and
spaces arrive unchanged, and the exec keeps the unit's MainPID.

The unit runs vLLM as its own unprivileged user (`User=kimi-vllm`): the argv file is written
readable by all (what it says is in /proc/PID/cmdline anyway), in the daemon's runtime directory,
which that user cannot write.

Which mode a running vLLM was started in is judged from what it actually runs: its command line
(/proc/PID/cmdline ends with the argv; a script's interpreter may come first). A process that
rewrote its title is matched through the launch record, which names the PID and its start time,
so a recycled PID never matches. The unit's `ExecStartPost=+` writes it as root (`kimi-supervisor
launch-record --pid $MAINPID`), beside the argv file: vLLM's user cannot write there, nor
forge it. exec keeps the PID and the start time, so the record names vLLM whether the launcher
has exec'd it yet or not.

A vLLM whose argv matches no mode of the config in force, but which the launch record names
(that very PID and start time) as started in a mode, runs that mode with an earlier config's
argv: an edited `vllm.command` and a reload. It is `stale`, not foreign: the daemon adopts it and
says a restart is needed, and the operator decides when to pay for the new load
(`kimi-mode production --apply`).
"""

from __future__ import annotations

import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from kimi_supervisor.config import Config
from kimi_supervisor.model import Mode, utcnow
from kimi_supervisor.ports import processes


class LaunchError(Exception):
    pass


def cache_env(config: Config) -> dict[str, str]:
    """The environment that points vLLM, torch.compile and Triton at vllm.cache_dir."""
    d = config.vllm.cache_dir
    if d is None:
        return {}
    return {
        "VLLM_CACHE_ROOT": str(d),
        "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"),
        "TRITON_CACHE_DIR": str(d / "triton"),
    }


def write_argv_file(config: Config, mode: Mode) -> Path:
    path = config.vllm.argv_file
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "mode": mode.value,
        "argv": config.launch_argv(mode),
        "env": cache_env(config),
        "written_at": utcnow().isoformat(),
    }
    _write_json_atomic(path, payload, mode=0o644)  # read by launch-vllm, as vLLM's user
    return path


@dataclass(frozen=True)
class Running:
    """The mode a vLLM process was started in; `stale`: its argv is an earlier config's (the
    config in force would start that mode differently)."""

    mode: Mode
    stale: bool = False


def read_argv_file(path: Path) -> list[str]:
    return _argv_of(_read_argv_payload(path), path)


def _read_argv_payload(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LaunchError(
            f"{path} does not exist: vLLM is started by kimi-supervisor, which writes this file "
            "first. Use `kimi-mode production` instead of starting the unit by hand."
        ) from None
    except (OSError, ValueError) as e:
        raise LaunchError(f"{path} is unreadable or not JSON ({e})") from None


def _argv_of(data: object, path: Path) -> list[str]:
    argv = data.get("argv") if isinstance(data, dict) else None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise LaunchError(f"{path}: 'argv' must be a non-empty list of strings")
    return argv


def launch_record_path(argv_file: Path) -> Path:
    return argv_file.with_name("vllm-launched.json")


def _write_json_atomic(path: Path, payload: object, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), mode)
        json.dump(payload, f, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def record_launch(argv_file: Path, pid: int) -> str | None:
    """The launch record: the unit's MainPID `pid` (its start time read now) runs the argv the
    argv file names, in its mode (which a later config may start with another argv). Run by the
    unit's `ExecStartPost=+`, as root. Why nothing was recorded, or None."""
    ref = processes.ref_of(pid)
    if ref is None:
        return f"PID {pid} is gone: nothing to record"
    data = _read_argv_payload(argv_file)
    argv = _argv_of(data, argv_file)
    mode = data.get("mode") if isinstance(data, dict) else None
    _write_json_atomic(
        launch_record_path(argv_file),
        {"pid": ref.pid, "start_ticks": ref.start_ticks, "argv": argv, "mode": mode},
    )
    return None


def exec_vllm(path: Path) -> None:
    data = _read_argv_payload(path)
    argv = _argv_of(data, path)
    env = data.get("env") if isinstance(data, dict) else None
    if isinstance(env, dict) and env.get("VLLM_CACHE_ROOT"):
        why = cache_untrusted(Path(str(env["VLLM_CACHE_ROOT"])))
        if why:
            print(f"kimi-supervisor launch-vllm: not using the cache: {why}", file=sys.stderr)
        else:
            for k, v in env.items():
                # The unit's own Environment= (an operator's drop-in) wins.
                if isinstance(k, str) and isinstance(v, str):
                    os.environ.setdefault(k, v)
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        raise LaunchError(f"cannot execute {argv[0]}: {e}") from None


def cache_untrusted(d: Path) -> str | None:
    """Why vLLM must not use `d` as its cache (None: it may; it is created 0700 if missing).
    vLLM runs what is compiled there, so every directory from / to `d` must be owned by root or
    by this user, and writable by nobody else; `d` itself no link."""
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        return f"cannot create {d}: {e}"
    me = os.geteuid()
    path = Path("/")
    for part in ("/", *d.parts[1:]):
        path = path / part
        try:
            st = os.lstat(path) if path == d else os.stat(path)
        except OSError as e:
            return f"cannot read {path}: {e}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory (a link?)"
        if st.st_uid not in (0, me):
            return f"{path} is owned by uid {st.st_uid}: `chown {me} {path}`"
        if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and path != d):
            return f"{path} is writable by its group or others: `chmod go-w {path}`"
    return None


def argv_matches(cmdline: list[str], argv: list[str]) -> bool:
    """True if a process running `cmdline` was exec'd with `argv` (a script's interpreter, and
    its shebang option, come before it)."""
    return len(cmdline) >= len(argv) and cmdline[len(cmdline) - len(argv) :] == argv


def mode_of_argv(config: Config, argv: list[str]) -> Mode | None:
    for mode in Mode:
        if argv_matches(argv, config.launch_argv(mode)):
            return mode
    return None


def running_mode(config: Config, main_pid: int) -> Running | None:
    """The mode the process `main_pid` was started in, judged from its argv, or from the launch
    record that names this very process (stale when its argv is not the config's any more);
    None if neither says (another argv started by hand, or not vLLM at all)."""
    if main_pid <= 0:
        return None
    cmdline = processes.cmdline_of(main_pid)
    mode = mode_of_argv(config, cmdline)
    if mode is not None:
        return Running(mode)
    if cmdline[-3:] == ["launch-vllm", "--argv-file", str(config.vllm.argv_file)]:
        # The unit's ExecStart before its exec (its first tenth of a second): it runs what the
        # argv file says, which the daemon wrote before starting the unit.
        try:
            mode = mode_of_argv(config, read_argv_file(config.vllm.argv_file))
        except LaunchError:
            return None
        return Running(mode) if mode is not None else None
    try:
        rec = json.loads(launch_record_path(config.vllm.argv_file).read_text(encoding="utf-8"))
        ref = processes.ref_of(main_pid)
        if ref is None or [rec["pid"], rec["start_ticks"]] != [ref.pid, ref.start_ticks]:
            return None
        argv, recorded = rec["argv"], rec.get("mode")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(argv, list):
        return None
    mode = mode_of_argv(config, argv)
    if mode is not None:
        return Running(mode)
    if recorded in {m.value for m in Mode}:
        return Running(Mode(recorded), stale=True)
    return None
