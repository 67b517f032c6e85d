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

An armed vLLM (its argv names a --profiler-config) serves /start_profile and /stop_profile to
anyone who reaches its port. The launcher starts it with the profile guard
(vllm_guard/kimi_profile_guard.py): `--middleware kimi_profile_guard.ProfileGuard` after the
argv, the guard's folder first on PYTHONPATH, and the secret of this start in KIMI_PROFILE_TOKEN.
The daemon makes the secret fresh for each armed start and writes it beside the argv file,
readable by root and vLLM's user only (root:<vLLM's group>, 0440): never into the argv file,
which all may read. The guard's two arguments are not the mode's: a command line that ends with
the mode's argv and then them runs that mode (`argv_matches`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from kimi_supervisor.config import Config
from kimi_supervisor.model import Mode, utcnow
from kimi_supervisor.ports import processes
from kimi_supervisor.vllm_guard import kimi_profile_guard

# What the launcher adds after an armed mode's argv: vLLM 0.16 loads the guard as middleware.
GUARD_ARGS = ["--middleware", "kimi_profile_guard.ProfileGuard"]
GUARD_DIR = Path(kimi_profile_guard.__file__).resolve().parent
TOKEN_BYTES = 256  # at most this much of the secret's file is read


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


def arms_profiler(argv: list[str]) -> bool:
    """Whether vLLM started with `argv` may serve the profiler's routes: an argument that vLLM's
    parser takes for --profiler-config, in any spelling (`=VALUE`, `.field`, underscores, and
    argparse's abbreviations such as `--profiler`: vLLM 0.16 allows them), or a `--config` file
    (which may name it). Guarding a vLLM that has no such routes costs one check per request."""
    for a in argv:
        name = _flag(a)
        if name == "--config" or (len(name) > 4 and PROFILER_FLAG.startswith(name)):
            return True
    return False


PROFILER_FLAG = "--profiler-config"
# vLLM 0.16's development routes (/collective_rpc reaches the workers' profiler, /sleep,
# /reset_prefix_cache, ...): on with this in its environment, and no guard covers them.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def _dev_mode(value: str) -> bool:
    """As vLLM 0.16 reads it (vllm/envs.py: `bool(int(os.getenv(...)))`)."""
    try:
        return int(value) != 0
    except ValueError:
        return False  # vLLM itself would not start


def unguarded(cmdline: list[str]) -> bool:
    """A vLLM started with `cmdline` serves its profiler's routes with no profile guard."""
    guarded = any(cmdline[i : i + len(GUARD_ARGS)] == GUARD_ARGS for i in range(len(cmdline)))
    return arms_profiler(cmdline) and not guarded


def open_routes(cmdline: list[str], environ: dict[str, str]) -> str:
    """Why a running vLLM's own clients can order it about ("" when they cannot, as far as its
    command line and environment tell): its profiler armed with no profile guard (a vLLM started
    by hand, or by a version before the guard), or its development routes on. A process that
    rewrote its command line (setproctitle) tells nothing here."""
    said = []
    if unguarded(cmdline):
        config_only = not arms_profiler([a for a in cmdline if _flag(a) != "--config"])
        said.append(
            "its profiler may be armed (its --config file can name one) with no profile guard"
            if config_only
            else "its profiler is armed with no profile guard: any client of its port can start "
            "a capture (a vLLM not started by this kimi-supervisor)"
        )
    if _dev_mode(value := environ.get(DEV_MODE_ENV, "0")):
        shown = value.strip()[:12] + ("..." if len(value.strip()) > 12 else "")
        said.append(
            f"it runs with {DEV_MODE_ENV}={shown}: its development routes (/collective_rpc, "
            "/sleep, ...) are open to any client of its port, and no guard covers them"
        )
    return "; and ".join(said)


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def token_path(argv_file: Path) -> Path:
    return argv_file.with_name("vllm-profile-token")


def write_token(argv_file: Path, vllm_uid: int | None) -> None:
    """A fresh secret for the next start of an armed vLLM, readable by root and by `vllm_uid`'s
    group (its primary group, the unit's Group=): root:group 0440, created anew (O_EXCL, no link
    followed) and renamed over the last one. `vllm_uid` None (not known): root's alone, and the
    guard refuses every capture (fail closed)."""
    path = token_path(argv_file)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    gid = -1
    if vllm_uid is not None and vllm_uid != os.geteuid():
        with contextlib.suppress(KeyError):
            gid = pwd.getpwuid(vllm_uid).pw_gid
    with_group = gid >= 0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o400)
    try:
        if with_group:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o440 if with_group else 0o400)
        os.write(fd, secrets.token_urlsafe(32).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_token(argv_file: Path) -> str | None:
    """The secret of this start (None: missing or unreadable); its file no link."""
    try:  # O_NONBLOCK: a FIFO planted there is refused below, never waited on
        fd = os.open(
            token_path(argv_file), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        )
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        value = os.read(fd, TOKEN_BYTES).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return value or None


def write_argv_file(config: Config, mode: Mode, vllm_uid: int | None = None) -> Path:
    """The argv file for the next start in `mode`, and for an armed one a fresh secret (its
    previous one removed otherwise); `vllm_uid`: the unit's user, who may read the secret."""
    path = config.vllm.argv_file
    path.parent.mkdir(parents=True, exist_ok=True)
    if arms_profiler(config.launch_argv(mode)):
        write_token(path, vllm_uid)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(token_path(path))
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
    # Judged from the launcher before its exec: what runs after it is still to be read (its
    # environment above all); not to be kept for this MainPID.
    provisional: bool = False
    # Why its own clients can order it about (open_routes), and whether a start by this daemon
    # would close that (its profiler armed with no guard: the daemon's start adds the guard).
    open_routes: str = ""
    unguarded: bool = False


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
    if arms_profiler(argv):
        argv = guarded_argv(argv, path)
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        raise LaunchError(f"cannot execute {argv[0]}: {e}") from None


def guarded_argv(argv: list[str], argv_file: Path) -> list[str]:
    """`argv` with the profile guard, which vLLM imports from the guard's folder, and this
    start's secret in the environment (never in the argv nor a log line). No secret: vLLM starts
    all the same and its guard refuses every capture."""
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(GUARD_DIR), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    token = read_token(argv_file)
    if token is None:
        os.environ.pop(kimi_profile_guard.ENV, None)
        print(
            f"kimi-supervisor launch-vllm: no secret in {token_path(argv_file)}: vLLM's profile "
            "guard will refuse every capture (restart the mode with kimi-mode)",
            file=sys.stderr,
        )
    else:
        os.environ[kimi_profile_guard.ENV] = token
    return [*argv, *GUARD_ARGS]


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
    its shebang option, come before it), the launcher's profile guard (GUARD_ARGS) after it or
    not."""
    return _ends_with(cmdline, argv) or _ends_with(cmdline, [*argv, *GUARD_ARGS])


def _ends_with(cmdline: list[str], argv: list[str]) -> bool:
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
        routes = open_routes(cmdline, processes.environ_of(main_pid))
        return Running(mode, open_routes=routes, unguarded=unguarded(cmdline))
    if cmdline[-3:] == ["launch-vllm", "--argv-file", str(config.vllm.argv_file)]:
        # The unit's ExecStart before its exec (its first tenth of a second): it runs what the
        # argv file says, which the daemon wrote before starting the unit.
        try:
            mode = mode_of_argv(config, read_argv_file(config.vllm.argv_file))
        except LaunchError:
            return None
        return Running(mode, provisional=True) if mode is not None else None
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
