"""vLLM's profiler routes for the daemon only: the profile guard vLLM loads by --middleware
(vllm_guard/kimi_profile_guard.py), the secret of each armed start (ports/launcher.py), and the
launcher's argv, which still names its mode."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.capture.job import explain
from kimi_supervisor.model import Mode
from kimi_supervisor.ports import launcher
from kimi_supervisor.ports.http import HttpResult
from kimi_supervisor.vllm_guard import kimi_profile_guard as guard
from kimi_supervisor.vllm_guard.kimi_profile_guard import ProfileGuard

from .loophost import config_for

SECRET = "s3cret-of-this-start-0123456789abcdef"


def call(
    path: str,
    token: str | None = None,
    secret: str | None = SECRET,
    method: str = "POST",
    root_path: str = "",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> tuple[int, dict[str, Any] | None]:
    """What the guard in front of an app that answers 200 to everything says to one request:
    the status, and the guard's JSON body (None when the app answered)."""
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    env = {guard.ENV: secret} if secret is not None else {}
    old = os.environ.pop(guard.ENV, None)
    os.environ.update(env)
    try:
        mw = ProfileGuard(app)
    finally:
        os.environ.pop(guard.ENV, None)
        if old is not None:
            os.environ[guard.ENV] = old
    headers = [(b"host", b"127.0.0.1")] + (extra or [])
    if token is not None:
        headers.append((guard.HEADER.lower().encode(), token.encode()))
    scope = {"type": "http", "method": method, "path": path, "root_path": root_path,
             "headers": headers}  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    status = sent[0]["status"]
    if reached:
        return status, None
    return status, json.loads(sent[1]["body"])


def test_the_guard_refuses_start_profile_without_the_header() -> None:
    status, body = call("/start_profile")
    assert status == 403 and body is not None
    assert "kimi-mode capture" in body["error"]["message"]


# "/start_profile\n": uvicorn's decoding of /start_profile%0A, which Starlette's route pattern
# still takes (an outside review started a capture with it past the first guard).
SPELLINGS = ["//start_profile", "/start_profile/", "/start_profile/x", "/api/start_profile",
             "/api//stop_profile/", "/a/b/stop_profile", "/start_profile\n", "/stop_profile\n",
             "/api/start_profile\n", "/start_profile\r\n"]  # fmt: skip
OTHER_PATHS = ["/health", "/metrics", "/v1/completions", "/v1/models", "/start", "/"]
TOKEN = guard.HEADER.lower().encode()

# One request (the guard's `call` arguments) and the status it gets: 403 from the guard, 200
# from vLLM's app behind it.
GUARD = [
    *[pytest.param({"path": path, "token": token}, 403,
                   id=f"{path} with a wrong header ({token!r}) is refused")
      for path in ("/start_profile", "/stop_profile")
      for token in ("not-the-secret", SECRET + "x", "")],
    *[pytest.param({"path": path, "token": SECRET}, 200,
                   id=f"the daemon's {path} with the right header goes through")
      for path in ("/start_profile", "/stop_profile")],
    *[pytest.param({"path": path, "secret": secret}, 200,
                   id=f"{path} without a header is untouched, secret {secret is not None}")
      for path in OTHER_PATHS for secret in (SECRET, None)],
    *[pytest.param({"path": path, "token": token, "secret": secret}, 403,
                   id=f"{path} with token {token!r} is refused when the secret is {secret!r}")
      for secret in (None, "", "  ")
      for path, token in (("/start_profile", ""), ("/start_profile", " "),
                          ("/stop_profile", None))],
    *[pytest.param({"path": path}, 403, id=f"the spelling {path!r} is refused")
      for path in SPELLINGS],
    *[pytest.param({"path": path, "root_path": "/api"}, 403,
                   id=f"the spelling {path!r} under a root path is refused") for path in SPELLINGS],
    *[pytest.param({"path": path, "token": SECRET, "root_path": "/api"}, 200,
                   id=f"the daemon's {path!r} under a root path goes through")
      for path in SPELLINGS],
    *[pytest.param({"path": "/start_profile", "method": method}, 403,
                   id=f"{method} /start_profile is refused as POST is")
      for method in ("GET", "HEAD", "PUT", "OPTIONS")],
    pytest.param({"path": "/start_profile", "token": SECRET, "extra": [(TOKEN, b"wrong")]}, 403,
                 id="two headers are refused even when one holds the secret"),
    pytest.param({"path": "/start_profile", "extra": [(TOKEN.upper(), SECRET.encode())]}, 200,
                 id="the header's name in capitals is the same header"),
]  # fmt: skip


@pytest.mark.parametrize(("request_", "status"), GUARD)
def test_the_guard_answers_the_profiler_routes_only_with_this_starts_secret(
    request_: dict[str, Any], status: int
) -> None:
    got, body = call(**request_)
    assert got == status, body
    assert (body is None) == (status == 200)


def test_the_guard_passes_websockets_and_lifespan_through() -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    mw = ProfileGuard(app)
    for kind in ("lifespan", "websocket"):
        asyncio.run(mw({"type": kind, "path": "/start_profile"}, None, None))  # type: ignore[arg-type]
    assert seen == ["lifespan", "websocket"]


def test_the_guard_imports_nothing_but_the_standard_library(tmp_path: Path) -> None:
    """vLLM's Python imports it from the guard's folder alone, with no kimi_supervisor."""
    code = (
        "import sys, kimi_profile_guard as g; "
        "assert not [m for m in sys.modules if m.startswith('kimi_supervisor')]; "
        "print(g.ProfileGuard.__name__)"
    )
    first = f"import sys; sys.path.insert(0, {str(launcher.GUARD_DIR)!r}); "
    r = subprocess.run(
        [sys.executable, "-I", "-c", first + code],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ProfileGuard", r.stderr
    assert sorted(p.name for p in launcher.GUARD_DIR.glob("*.py")) == [
        "__init__.py",
        "kimi_profile_guard.py",
    ]


def test_an_armed_mode_gets_a_fresh_secret_readable_by_root_and_vllms_group_only(
    tmp_path: Path,
) -> None:
    config = config_for(tmp_path)
    nobody = pwd.getpwnam("nobody")
    launcher.write_argv_file(config, Mode.PROFILE, nobody.pw_uid)
    path = launcher.token_path(config.vllm.argv_file)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o440
    assert (st.st_uid, st.st_gid) == (0, nobody.pw_gid)
    first = launcher.read_token(config.vllm.argv_file)
    assert first and len(first) >= 32
    # Not in the argv file, which all may read.
    assert first not in config.vllm.argv_file.read_text()
    launcher.write_argv_file(config, Mode.PROFILE, None)  # vLLM's user unknown: root's alone
    st = os.lstat(path)
    assert stat.S_IMODE(st.st_mode) == 0o400 and (st.st_uid, st.st_gid) == (0, 0)
    second = launcher.read_token(config.vllm.argv_file)
    assert second and second != first  # fresh at each start
    launcher.write_argv_file(config, Mode.PRODUCTION, nobody.pw_uid)  # not armed: none left
    assert not path.exists() and launcher.read_token(config.vllm.argv_file) is None
    assert grp.getgrgid(0).gr_name == "root"


def test_a_link_at_the_secrets_path_is_never_followed_nor_read(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    path = launcher.token_path(config.vllm.argv_file)
    target = tmp_path / "elsewhere"
    target.write_text("planted")
    path.symlink_to(target)
    assert launcher.read_token(config.vllm.argv_file) is None  # a link: no secret
    launcher.write_argv_file(config, Mode.PROFILE, None)
    assert target.read_text() == "planted" and not path.is_symlink()
    # A link at the temporary name is replaced, never written through.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.symlink_to(target)
    launcher.write_argv_file(config, Mode.PROFILE, None)
    assert target.read_text() == "planted" and not tmp.exists()


def test_a_profiler_config_in_any_spelling_arms_the_profiler() -> None:
    for args in (["--profiler-config", "{}"], ['--profiler-config={"profiler": "torch"}'],
                 ["--profiler-config.profiler", "torch"], ["--profiler_config", "{}"],
                 # argparse's abbreviations, which vLLM 0.16's parser takes; a --config file
                 ["--profiler", "{}"], ["--profiler-conf={}"], ["--config", "x.yaml"]):  # fmt: skip
        assert launcher.arms_profiler(["vllm", "serve", "m", *args]), args
    assert not launcher.arms_profiler(["vllm", "serve", "m", "--max-model-len", "256"])


def test_the_mode_is_still_read_from_a_command_line_with_the_guards_arguments(
    tmp_path: Path,
) -> None:
    config = config_for(tmp_path, armed=True)
    for mode in Mode:
        argv = config.launch_argv(mode)
        guarded = [*argv, *launcher.GUARD_ARGS]
        assert launcher.mode_of_argv(config, argv) == mode
        assert launcher.mode_of_argv(config, guarded) == mode
        assert launcher.mode_of_argv(config, ["/usr/bin/python3", *guarded]) == mode
    # Only the guard's two arguments, and only after the argv, are not the mode's.
    argv = config.launch_argv(Mode.PROFILE)
    assert launcher.mode_of_argv(config, [*argv, "--middleware", "other.Guard"]) is None
    assert launcher.mode_of_argv(config, [*argv, *launcher.GUARD_ARGS, "x"]) is None
    assert launcher.mode_of_argv(config, [*launcher.GUARD_ARGS, *argv]) == Mode.PROFILE


def test_the_launcher_execs_an_armed_argv_with_the_guard_its_folder_and_the_secret(
    tmp_path: Path,
) -> None:
    """As the unit's ExecStart runs it: vLLM (here a script that says what it got) imports the
    guard from PYTHONPATH, finds the secret in its environment and not in its argv."""
    script = tmp_path / "vllm.py"
    script.write_text(
        "import json, os, sys\n"
        "if '--middleware' in sys.argv: import kimi_profile_guard\n"
        "print(json.dumps({'argv': sys.argv[1:], 'path': os.environ['PYTHONPATH'],"
        " 'secret': os.environ.get('KIMI_PROFILE_TOKEN')}))\n"
    )
    argv_file = tmp_path / "vllm-argv.json"
    config = config_for(tmp_path)

    def launch(argv: list[str]) -> dict[str, Any]:
        argv_file.write_text(json.dumps({"mode": "profile", "argv": argv}))
        env = {k: v for k, v in os.environ.items() if k != guard.ENV} | {"PYTHONPATH": "/keep"}
        r = subprocess.run(
            [sys.executable, "-m", "kimi_supervisor.cli.admin", "launch-vllm", "--argv-file",
             str(argv_file)], capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        out: dict[str, Any] = json.loads(r.stdout)
        out["stderr"] = r.stderr
        return out

    armed = [sys.executable, str(script), "--profiler-config", "{}"]
    assert config.vllm.argv_file != argv_file
    launcher.write_token(argv_file, None)
    token = launcher.read_token(argv_file)
    got = launch(armed)
    assert got["argv"] == [*armed[2:], *launcher.GUARD_ARGS]
    assert got["path"].split(os.pathsep) == [str(launcher.GUARD_DIR), "/keep"]
    assert got["secret"] == token and token not in got["stderr"]
    # The secret's file gone: vLLM starts all the same, its guard refusing every capture.
    launcher.token_path(argv_file).unlink()
    got = launch(armed)
    assert got["secret"] is None and "will refuse every capture" in got["stderr"]
    # Not armed: the argv byte for byte, no guard nor secret.
    launcher.write_token(argv_file, None)
    plain = [sys.executable, str(script), "--max-model-len", "256"]
    got = launch(plain)
    assert got["argv"] == plain[2:] and got["path"] == "/keep" and got["secret"] is None


def test_a_refusal_by_the_guard_is_explained_to_the_operator() -> None:
    said = explain(HttpResult(403, "{}", "HTTP 403"), "/start_profile", 10)
    assert "profile guard refused /start_profile" in said and "kimi-mode" in said


@pytest.mark.parametrize("with_token", [True, False])
def test_the_fake_vllm_asks_the_guard_as_real_vllm_does(with_token: bool) -> None:
    from argparse import Namespace

    from kimi_supervisor.sandbox.fake_api import Server
    from kimi_supervisor.sandbox.fake_options import FakeOptions

    sys.path.insert(0, str(launcher.GUARD_DIR))
    os.environ[guard.ENV] = SECRET
    try:
        args = Namespace(profiler_config=None, middleware=["kimi_profile_guard.ProfileGuard"])
        server = Server(args, FakeOptions())
    finally:
        os.environ.pop(guard.ENV)
        sys.path.remove(str(launcher.GUARD_DIR))
    tokens = [SECRET] if with_token else []
    assert server.refused("/start_profile", tokens) is not with_token
    assert server.refused("//stop_profile/", tokens) is not with_token
    assert server.refused("/start_profile", [SECRET, SECRET])
    assert not server.refused("/health", [])
    assert server.guard_header == guard.HEADER


def test_a_fifo_at_the_secrets_path_is_refused_at_once_never_waited_on(tmp_path: Path) -> None:
    argv_file = tmp_path / "vllm-argv.json"
    os.mkfifo(launcher.token_path(argv_file), 0o600)
    assert launcher.read_token(argv_file) is None  # no writer: a blocking open would hang


def test_an_armed_vllm_running_without_the_guard_is_told_and_apply_would_restart_it(
    tmp_path: Path,
) -> None:
    """A vLLM the daemon adopts but did not start with the guard (by hand, or by a version
    before it) serves the profiler's routes to anyone: the observation says so, and marks it
    one that `--apply` restarts (the daemon's start adds the guard). Its development routes
    (VLLM_SERVER_DEV_MODE, as vLLM 0.16 reads it: an int) are said too; no guard covers them."""
    armed, plain = config_for(tmp_path / "a", armed=True), config_for(tmp_path / "p")
    cases = [
        (armed, armed.launch_argv(Mode.PRODUCTION), {}, "no profile guard", True),
        (armed, [*armed.launch_argv(Mode.PRODUCTION), *launcher.GUARD_ARGS], {}, "", False),
        (plain, plain.launch_argv(Mode.PRODUCTION), {"VLLM_SERVER_DEV_MODE": "1"},
         "VLLM_SERVER_DEV_MODE=1: its development routes", False),
        (plain, plain.launch_argv(Mode.PRODUCTION), {"VLLM_SERVER_DEV_MODE": "0"}, "", False),
    ]  # fmt: skip
    for config, argv, env, says, unguarded in cases:
        # The fake vLLM itself, as someone started it by hand (it listens on the config's port).
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not launcher.running_mode(config, proc.pid) and time.monotonic() < deadline:
                time.sleep(0.01)  # the exec: until then the cmdline is this test's
            running = launcher.running_mode(config, proc.pid)
        finally:
            proc.kill()
            proc.wait()
        assert running is not None and running.mode is Mode.PRODUCTION, argv
        assert (says in running.open_routes) and (bool(says) == bool(running.open_routes)), (
            running.open_routes
        )
        assert running.unguarded is unguarded


def test_what_vllm_runs_after_the_launchers_exec_is_read_again_and_its_environment_as_getenv(
    tmp_path: Path,
) -> None:
    """An outside review: the launcher's moment before its exec (`launch-vllm --argv-file`) was
    judged from the argv file and kept for that MainPID, so a dev-mode vLLM the daemon started
    itself was never said. That judgement is provisional now. And a name set twice in the
    environment is read as getenv and Python read it: the first."""
    config = config_for(tmp_path)
    launching = [sys.executable, "-c", "import time; time.sleep(30)", "launch-vllm",
                 "--argv-file", str(config.vllm.argv_file)]  # fmt: skip
    config.vllm.argv_file.parent.mkdir(parents=True, exist_ok=True)
    config.vllm.argv_file.write_text(
        json.dumps({"mode": "production", "argv": config.launch_argv(Mode.PRODUCTION)})
    )
    proc = subprocess.Popen(launching, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while launcher.running_mode(config, proc.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        running = launcher.running_mode(config, proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert running is not None and running.mode is Mode.PRODUCTION and running.provisional
    assert "VLLM_SERVER_DEV_MODE=1" in launcher.open_routes([], {"VLLM_SERVER_DEV_MODE": "1"})
    # --config alone may arm it: said as a may, not as a fact.
    said = launcher.open_routes(["vllm", "serve", "m", "--config", "c.yaml"], {})
    assert said.startswith("its profiler may be armed (its --config file can name one)"), said


def test_a_name_twice_in_a_processes_environment_reads_as_its_first() -> None:
    """execve may pass a name twice; getenv and Python keep the first (an outside review: the
    daemon kept the last, and read VLLM_SERVER_DEV_MODE=1 then =0 as off)."""
    from kimi_supervisor.ports import processes

    exec_twice = (
        "import ctypes; libc = ctypes.CDLL(None); "
        "argv = (ctypes.c_char_p * 3)(b'/bin/sleep', b'30', None); "
        "envp = (ctypes.c_char_p * 3)(b'VLLM_SERVER_DEV_MODE=1', b'VLLM_SERVER_DEV_MODE=0', None); "
        "libc.execve(b'/bin/sleep', argv, envp)"
    )
    proc = subprocess.Popen([sys.executable, "-c", exec_twice])
    try:
        deadline = time.monotonic() + 60
        while processes.cmdline_of(proc.pid)[:1] != ["/bin/sleep"] and time.monotonic() < deadline:
            time.sleep(0.01)
        raw = (Path("/proc") / str(proc.pid) / "environ").read_bytes()
        got = processes.environ_of(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert raw.count(b"VLLM_SERVER_DEV_MODE=") == 2, raw  # both are there
    assert got["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_SERVER_DEV_MODE=1" in launcher.open_routes([], got)
