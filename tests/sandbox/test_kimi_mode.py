"""kimi-mode and the control socket, as operators (and misbehaving clients) use them, against
the daemon running in the sandbox."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT

from ..conftest import (
    KIMI_MODE,
    DaemonHelper,
    SandboxHelper,
    flat,
    like_a_terminal,
    loaded,
    too_wide,
    wait_until,
)

pytestmark = pytest.mark.systemd

NOBODY = ["--reuid=65534", "--regid=65534"]


@pytest.fixture
def serving(sandbox: SandboxHelper, daemon: DaemonHelper) -> DaemonHelper:
    daemon.start()
    daemon.wait_serving("production")
    return daemon


def raw_exchange(path: Path, payload: bytes, read_s: float = 5.0) -> list[dict[str, Any]]:
    """Send raw bytes and read what comes back until the daemon closes."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(read_s)
        s.connect(str(path))
        s.sendall(payload)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def test_status_json_has_modes_state_gpus_and_the_last_teardown(serving: DaemonHelper) -> None:
    r = serving.kimi_mode("status", "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["desired_mode"] == "production" and s["mode"] == "production"
    assert s["state"] == "serving"
    assert s["unit"]["main_pid"] == serving.vllm_pid()
    assert [g["index"] for g in s["gpus"]] == [0, 1, 2, 3]
    for g in s["gpus"]:
        assert g["used_mib"] == g["baseline_mib"] + 90_000
        assert g["holders"] and g["holders"][0]["name"].startswith("VLLM::Worker_TP")
    assert s["last_teardown"]["outcome"] == "clean"
    assert s["last_teardown"]["kills"] == []


def test_is_serving_answers_with_its_exit_code_like_systemctl_is_active(
    serving: DaemonHelper,
) -> None:
    r = serving.kimi_mode("is-serving")
    assert (r.returncode, r.stdout) == (0, "serving production\n")
    assert serving.kimi_mode("is-serving", "production", "-q").returncode == 0
    r = serving.kimi_mode("is-serving", "profile")
    assert (r.returncode, r.stdout) == (1, "serving production\n")  # serving, not that mode
    r = serving.kimi_mode("is-serving", "--socket", "/nonexistent/control.sock")
    assert r.returncode == 3 and "kimi-mode:" in r.stderr


def test_status_and_history_print_what_an_operator_reads(serving: DaemonHelper) -> None:
    r = serving.kimi_mode("status")
    assert r.returncode == 0, r.stderr
    assert "desired mode:  production" in r.stdout
    assert f"MainPID {serving.vllm_pid()}, /health 200" in r.stdout
    assert "last teardown: CLEAN" in r.stdout
    h = serving.kimi_mode("history", "-n", "5")
    assert h.returncode == 0, h.stderr
    assert "switch   - -> production (boot): READY" in h.stdout
    hj = serving.kimi_mode("history", "--json")
    kinds = [json.loads(line)["kind"] for line in hj.stdout.splitlines()]
    assert kinds == ["teardown", "transition"]


def test_a_switch_followed_through_a_pipe_prints_each_step_the_kill_and_the_loading(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    ghost = sandbox.ghost(gpu="0,1", mib=6000, title="python3 -m notebook")
    sandbox.fake(load_s=2.0)  # its shard bar in real vLLM 0.16's bytes (tests/vllm_0_16.py)
    r = serving.kimi_mode("profile")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "\x1b[" not in out  # plain lines when piped
    assert f"killed PID {ghost.pid} python3 -m notebook (kill_gpu_holders" in out
    assert "teardown stop_unit" in out and "teardown CLEAN in" in out
    # The load's progress arrived while it loaded, in steps.
    seen = [int(p) for p in re.findall(r"vLLM: loading safetensors shards (\d+)%", out)]
    assert len(seen) >= 3 and seen == sorted(seen) and seen[-1] >= 50, out
    ending = flat(out[out.rindex("done: ") :])  # wrapped at 80 columns
    assert ending.startswith("done: profile is ready"), out
    assert " unavailable " in ending and "engine init" in ending, out  # its window
    assert not too_wide(out), out
    serving.wait_serving("profile")


def test_a_switch_with_json_prints_one_parsable_message_per_line(serving: DaemonHelper) -> None:
    r = serving.kimi_mode("profile", "--json")
    assert r.returncode == 0, r.stderr
    msgs = [json.loads(line) for line in r.stdout.splitlines()]
    assert msgs[0]["type"] == "reply" and msgs[0]["code"] == "accepted"
    events = [m["event"] for m in msgs if m["type"] == "event"]
    assert events[0] == "transition_started"
    for name in ("teardown_started", "step_finished", "starting", "progress", "ready"):
        assert name in events
    assert msgs[-1]["type"] == "end" and msgs[-1]["ok"] and msgs[-1]["outcome"] == "ready"
    assert all(m["v"] == 1 for m in msgs)


def test_a_switch_followed_on_a_terminal_is_one_redrawn_display(serving: DaemonHelper) -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [KIMI_MODE, "profile"],
        stdout=slave,
        stderr=slave,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **serving.sb.env, "TERM": "xterm"},
    )
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 30)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        assert proc.wait(30) == 0, out.decode(errors="replace")
    text = out.decode(errors="replace")
    assert "\x1b[" in text  # cursor movement: the block is redrawn in place
    assert "GPU 0 [" in text and "kimi-mode: switching to profile" in text
    assert "done: profile is ready" in text


def test_asking_for_the_mode_that_already_serves_is_a_fast_no_op(serving: DaemonHelper) -> None:
    before = len(serving.history())
    r = serving.kimi_mode("production")
    assert r.returncode == 0
    assert "already running and healthy" in r.stdout
    assert len(serving.history()) == before


def test_a_user_outside_the_control_group_is_refused_and_a_member_is_let_in(
    serving: DaemonHelper,
) -> None:
    # No access to the 0660 socket at all: the kernel refuses, kimi-mode explains.
    r = serving.kimi_mode("status", user=[*NOBODY, "--clear-groups"])
    assert r.returncode == 3, r.stdout + r.stderr
    assert "permission denied" in r.stderr, r.stderr
    assert "a member of the group `users` (`sudo usermod -aG users $USER`" in r.stderr, r.stderr
    assert "kimi`" not in r.stderr  # the configured group, not the default
    # A process that gets past the file's mode (CAP_DAC_OVERRIDE) is refused by the daemon's
    # peer-credential check, and the attempt is logged.
    caps = ["--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
    r = serving.kimi_mode("profile", user=[*NOBODY, "--clear-groups", *caps])
    assert r.returncode == 3, r.stdout + r.stderr
    assert "uid 65534 may not control kimi-supervisor" in r.stderr
    assert '"control_refused"' in serving.log()
    assert serving.status()["desired_mode"] == "production"
    # A member of the control group ("users" in the sandbox) is served.
    r = serving.kimi_mode("status", "--json", user=[*NOBODY, "--groups=100"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["state"] == "serving"


def test_fifty_status_clients_and_ten_switch_clients_at_once_get_one_switch_and_all_answers(
    serving: DaemonHelper,
) -> None:
    before = len(serving.transitions())
    results: dict[str, list[Any]] = {"status": [], "switch": []}
    lock = threading.Lock()

    def status() -> None:
        msgs = serving.request({"cmd": "status"}, 30)
        with lock:
            results["status"].append(msgs[0]["ok"] and msgs[0]["data"]["state"])

    def switch() -> None:
        msgs = serving.request({"cmd": "switch", "mode": "profile", "follow": True}, 60)
        with lock:
            results["switch"].append((msgs[0]["code"], msgs[-1]))

    threads = [threading.Thread(target=status) for _ in range(50)]
    threads += [threading.Thread(target=switch) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert len(results["status"]) == 50 and all(results["status"])
    codes = sorted(code for code, _end in results["switch"])
    assert codes.count("accepted") == 1 and codes.count("joined") == 9, codes
    ends = {end["data"]["transition"] for _code, end in results["switch"]}
    assert len(ends) == 1  # everyone followed the same switch to its end
    assert all(end["ok"] and end["outcome"] == "ready" for _c, end in results["switch"])
    assert len(serving.transitions()) == before + 1


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"this is not json\n", "bad_json"),
        (b'{"v": 1, "cmd": "reboot"}\n', "bad_request"),
        (b'{"v": 1, "cmd": "switch", "mode": "turbo"}\n', "bad_request"),
        (b'{"v": 7, "cmd": "status"}\n', "unsupported_version"),
        (b"[1, 2, 3]\n", "bad_request"),
        (b'{"v": 1, "cmd": "status", "' + b"x" * 70_000 + b'": 1}\n', "too_long"),
        (b"", "idle"),
    ],
    ids=["malformed", "unknown-command", "unknown-mode", "version", "not-object", "long", "idle"],
)
def test_bad_input_gets_a_clear_error_and_the_daemon_keeps_serving(
    serving: DaemonHelper, payload: bytes, code: str
) -> None:
    # "idle" is answered once control.idle_timeout_s has passed; the others at once.
    idle_s = serving.config.control.idle_timeout_s
    (reply,) = raw_exchange(serving.socket, payload, read_s=loaded(idle_s + 5))
    assert reply["type"] == "reply" and not reply["ok"]
    assert reply["code"] == code and reply["message"]
    assert serving.status()["state"] == "serving"


def test_clients_that_vanish_mid_stream_harm_no_one(serving: DaemonHelper) -> None:
    # A subscriber and a switch follower hang up without a word; then a half-sent request.
    for req in (
        b'{"v": 1, "cmd": "subscribe"}\n',
        b'{"v": 1, "cmd": "switch", "mode": "profile"}\n',
    ):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(serving.socket))
        s.sendall(req)
        s.recv(65536)
        s.close()
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(serving.socket))
    s.sendall(b'{"v": 1, "cmd": "sta')
    s.close()
    serving.wait_serving("profile")
    wait_until(lambda: serving.status()["state"] == "serving", 10, "serving")
    assert serving.kimi_mode("status").returncode == 0


def test_ctrl_c_while_following_stops_following_and_the_switch_completes(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    sandbox.fake(load_s=3.0)
    proc = subprocess.Popen(
        [KIMI_MODE, "profile"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **serving.sb.env},
        preexec_fn=like_a_terminal,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "starting vLLM" in line:
            break
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130
    assert "the switch to profile goes on" in err
    assert "`kimi-mode wait` follows it again" in err  # how to rejoin
    serving.wait_serving("profile", 30)


def test_exit_codes_say_usage_unreachable_timeout_and_failure(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    assert serving.kimi_mode("turbo").returncode == 2
    assert serving.kimi_mode("profile", "--timeout", "-1").returncode == 2
    r = serving.kimi_mode("status", "--socket", "/nonexistent/control.sock")
    assert r.returncode == 3 and "not running" in r.stderr
    sandbox.fake(load_s=4.0)
    r = serving.kimi_mode("profile", "--timeout", "1")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "the switch to profile goes on" in r.stderr
    # `wait MODE` rejoins it and returns once profile serves (it waited forever), in
    # json mode with nothing but JSON lines: the status that serves, then the verdict.
    r = serving.kimi_mode("wait", "profile", "--timeout", "30", "-o", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[-2]["type"] == "status" and lines[-2]["mode"] == "profile", lines
    assert lines[-1]["type"] == "verdict" and lines[-1]["verdict"] == "serving", lines
    assert serving.kimi_mode("is-serving", "profile").returncode == 0
    r = serving.kimi_mode("wait", "profile", "--timeout", "5")
    assert r.returncode == 0 and r.stdout == "done: profile serves\n", r.stdout
    sandbox.fake(crash_during_load_at=50)
    r = serving.kimi_mode("production")
    assert r.returncode == 1 and "FAILED:" in r.stdout
    sandbox.fake()


def test_a_switch_to_the_other_mode_during_a_switch_is_refused_joined_or_forced(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    sandbox.fake(load_s=3.0)
    assert serving.kimi_mode("profile", "--no-wait").returncode == 0
    wait_until(lambda: serving.status()["state"] == "starting", 10, "profile to be loading")
    r = serving.kimi_mode("production")
    assert r.returncode == 5  # busy
    assert "a switch to profile is in progress since" in r.stderr and "--force" in r.stderr
    joined = serving.kimi_mode("profile", "--no-wait")
    assert "already switching to profile" in joined.stdout
    forced = serving.kimi_mode("production", "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    status = serving.wait_serving("production", 30)
    assert status["desired_mode"] == "production"
    outcomes = [t["outcome"] for t in serving.transitions()]
    assert outcomes[-2:] == ["preempted", "ready"]


def test_status_answers_while_a_teardown_is_running(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    sandbox.fake(ignore_sigterm=True)  # stop_unit waits term_grace_s (2 s)
    assert serving.kimi_mode("profile", "--no-wait").returncode == 0
    status = serving.wait_state("tearing_down", 10)
    assert status["transition"]["step"].startswith("teardown")
    assert status["daemon"]["loop_heartbeat_age_s"] < 1.0
    sandbox.fake()
    serving.wait_serving("profile", 30)


def test_a_second_daemon_refuses_to_start_while_one_runs(serving: DaemonHelper) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kimi_supervisor.cli.admin",
            "run",
            "--config",
            str(serving.sb.config_path),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **serving.sb.env},
    )
    assert r.returncode == 1
    assert "another kimi-supervisor is running" in r.stderr
    assert serving.status()["state"] == "serving"


def test_a_socket_left_by_a_killed_daemon_is_replaced(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    first = serving.pid()
    sandbox.systemd.kill(DAEMON_UNIT, "main", signal.SIGKILL)
    wait_until(lambda: serving.pid() not in (0, first), 20, "systemd to restart the daemon")
    serving.wait_serving("production")
    assert '"control_socket_stale_replaced"' in serving.log()


def test_kimi_mode_loads_neither_pystemd_nor_pynvml(serving: DaemonHelper) -> None:
    code = (
        "import sys\n"
        "from kimi_supervisor.cli.kimi_mode import main\n"
        "rc = main(['status', '--json'])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'pystemd', 'pynvml', 'psutil'})\n"
        "print('HEAVY', heavy, rc, file=sys.stderr)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **serving.sb.env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "HEAVY [] 0" in r.stderr, r.stderr


def test_a_load_says_when_it_will_be_ready_from_the_past_loads_of_that_mode_and_argv(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    sandbox.fake(load_s=2.0)
    r = serving.kimi_mode("profile")  # profile's first load: nothing to predict from
    assert r.returncode == 0 and "past loads" not in r.stdout, r.stdout
    r = serving.kimi_mode("production")  # production loaded when the daemon started
    assert r.returncode == 0, r.stdout + r.stderr
    said = flat(r.stdout)
    assert "past loads of this mode and argv took" in said and "(median of 1)" in said
    loads = [t for t in serving.transitions() if t["outcome"] == "ready" and "load_s" in t]
    assert {t["target"] for t in loads} == {"production", "profile"}
    assert all(t["load_s"] >= 2.0 and len(t["argv_key"]) == 16 for t in loads[-2:])
    # While profile loads again: status and its line say when it should be ready.
    assert serving.kimi_mode("profile", "--no-wait").returncode == 0
    s = serving.wait_status(lambda s: s.get("eta") is not None, 30, "a load with an eta")
    assert s["eta"]["past_loads"] == 1 and s["eta"]["expected_s"] >= 2.0
    assert "ready in about" in s["eta"]["text"] or "past the estimate" in s["eta"]["text"]
    assert s["eta"]["text"] in s["status_line"]
    assert "eta:" in serving.kimi_mode("status").stdout
    serving.wait_serving("profile")


@pytest.mark.parametrize(
    ("case", "code", "verdict"),
    [
        pytest.param("reached", 0, "serving", id="profile reached: 0, serving"),
        pytest.param("rolled back", 1, "rolled_back", id="profile failed and rolled back: 1"),
        pytest.param("joined after the rollback", 1, "rolled_back", id="joined after it: 1"),
        pytest.param("stuck then cleared", 0, "serving", id="a STUCK retried then cleared: 0"),
        pytest.param("nobody asked", 4, "not_asked", id="nobody asked for profile: 4 at timeout"),
        pytest.param("daemon restarted", 0, "serving", id="the daemon restarted meanwhile: 0"),
    ],
)
def test_a_script_waiting_for_profile_gets_the_verdict_about_profile_as_its_last_object(
    case: str, code: int, verdict: str, sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """kubectl wait's contract: `wait profile` ends when profile serves or --timeout runs out,
    through a rollback, a STUCK retry or nobody's asking, and its last JSON object says which
    (a rollback's last `end` said ok: true; a STUCK retried 1 s later ended it at once, rc 6)."""
    from kimi_supervisor.ports import processes

    with daemon.configured(daemon={"stuck_retry_s": 1.0}):
        daemon.start()
        daemon.wait_serving("production")
        holder = None
        if case in ("rolled back", "joined after the rollback"):
            sandbox.fake(crash_during_load_at=40, load_faults_only_when_profiling=True)
        elif case == "daemon restarted":
            sandbox.fake(load_s=4.0)
        elif case == "stuck then cleared":  # protected: never killed, so the teardown is STUCK
            holder = sandbox.ghost(gpu="1", mib=20_000, title="nvidia-fabricmanager")
        try:
            if case != "nobody asked":
                assert daemon.kimi_mode("profile", "--no-wait").returncode == 0
            if case == "joined after the rollback":  # production serves again, as before
                daemon.wait_status(lambda st: st["state"] == "serving" and (
                    st.get("rolled_back") or {}).get("mode") == "profile", 60,
                    "the rollback to end")  # fmt: skip
            timeout = "4" if case == "nobody asked" else "120"
            waiting = subprocess.Popen(
                [KIMI_MODE, "-o", "json", "wait", "profile", "--timeout", timeout],
                env={**os.environ, **sandbox.sb.env}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            if case == "daemon restarted":  # an upgrade or a reload, mid-load
                daemon.wait_state("starting")
                daemon.stop()
                daemon.start()
            if holder is not None:
                daemon.wait_state("stuck")
                handle = processes.PidHandle.open(holder)
                assert isinstance(handle, processes.PidHandle), handle
                with handle:
                    handle.send(signal.SIGKILL)  # gone: the next retry is clean
                sandbox.started.remove(holder)  # ended by the test, not by the daemon
            out, err = waiting.communicate(timeout=150)
        finally:
            sandbox.fake()
        last = json.loads(out.splitlines()[-1])
        assert waiting.returncode == code, out + err
        assert last["type"] == "verdict" and last["mode"] == "profile", last
        assert last["verdict"] == verdict and last["exit"] == code, last
        assert last["ok"] is (code == 0), last
        if case == "stuck then cleared":
            assert "STUCK teardown(s), retried until clean" in last["message"], last
        if case == "nobody asked":
            assert "nobody asked for profile" in last["message"], last
        if case in ("rolled back", "joined after the rollback"):
            assert "rolling back to production" in last["message"], last
