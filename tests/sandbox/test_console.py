"""The operator's console against the daemon in the sandbox: every command's JSON checked
against the documented schema, `wait` rejoining a switch, `logs`, `doctor` passing on a healthy
host and failing on each broken precondition, and a reload that changes vLLM's argv without
tearing it down."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kimi_supervisor.cli.completion import _subparsers
from kimi_supervisor.cli.kimi_mode import build_parser
from kimi_supervisor.config import Config
from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT

from ..conftest import (
    KIMI_MODE,
    DaemonHelper,
    SandboxHelper,
    flat,
    like_a_terminal,
    too_wide,
    wait_until,
)

pytestmark = pytest.mark.systemd

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gpu-allreduce-2xh200"
SCHEMA = json.loads(
    (Path(__file__).resolve().parents[2] / "docs" / "kimi-mode-output.schema.json").read_text()
)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def json_lines(r: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """stdout as the contract has it: JSON lines, each valid against the schema."""
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines, r.stderr
    for line in lines:
        errors = sorted(VALIDATOR.iter_errors(line), key=str)
        assert not errors, (line.get("type"), [e.message for e in errors[:3]])
        assert line["v"] == 1
    return lines


@pytest.fixture
def serving(sandbox: SandboxHelper, daemon: DaemonHelper) -> DaemonHelper:
    daemon.start()
    daemon.wait_serving("production")
    return daemon


def watch_once(daemon: DaemonHelper, *args: str) -> subprocess.CompletedProcess[str]:
    """`status --watch`, stopped with Ctrl-C once it has printed its first status."""
    proc = subprocess.Popen(
        [KIMI_MODE, "status", "--watch", "--interval", "0.2", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **daemon.sb.env},
        preexec_fn=like_a_terminal,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, first + rest, err)


def test_every_command_with_o_json_prints_lines_that_match_the_documented_schema(
    sandbox: SandboxHelper, serving: DaemonHelper, tmp_path: Path
) -> None:
    km = serving.kimi_mode
    seen: dict[str, list[dict[str, Any]]] = {}
    r = km("-o", "json", "status")  # before the command
    assert r.returncode == 0
    seen["status"] = json_lines(r)
    assert seen["status"][0]["type"] == "status" and seen["status"][0]["state"] == "serving"
    assert json_lines(km("status", "--json"))[0]["type"] == "status"  # after it, short form
    assert json_lines(watch_once(serving, "-o", "json"))[0]["type"] == "status"
    seen["is-serving"] = json_lines(km("is-serving", "-o", "json"))
    assert seen["is-serving"][0]["serving"] is True
    seen["history"] = json_lines(km("history", "-o", "json"))
    assert {x["type"] for x in seen["history"]} == {"record"}
    r = km("profile", "-o", "json")
    assert r.returncode == 0, r.stderr
    seen["profile"] = json_lines(r)
    assert seen["profile"][-1]["type"] == "end"
    seen["wait"] = json_lines(km("wait", "-o", "json"))
    seen["logs"] = json_lines(km("logs", "-o", "json", "-n", "5"))
    assert len(seen["logs"]) == 5 and seen["logs"][0]["unit"] == sandbox.config.service.unit
    r = km("doctor", "-o", "json")
    seen["doctor"] = json_lines(r)
    assert r.returncode == 0 and seen["doctor"][0]["ok"], r.stdout
    traces = tmp_path / "capture"
    shutil.copytree(FIXTURE, traces)
    seen["capture"] = json_lines(km("capture", "--summarize", str(traces), "-o", "json"))
    assert seen["capture"][0]["type"] == "summary"
    empty = tmp_path / "empty"
    empty.mkdir()
    (nothing,) = json_lines(km("capture", "--summarize", str(empty), "-o", "json"))
    assert nothing["type"] == "error" and nothing["exit"] == 1  # and no summary.json written
    assert not (empty / "summary.json").exists()
    # A wrong command line in json mode: one error line, nothing else on stdout.
    (usage,) = json_lines(km("-o", "json", "prod"))
    assert usage["type"] == "error" and "did you mean production?" in usage["message"]
    seen["production"] = json_lines(km("-o", "json", "production"))
    # A command that fails says so in one `error` line, with its exit code.
    r = km("status", "-o", "json", "--socket", str(tmp_path / "no.sock"))
    (error,) = json_lines(r)
    assert r.returncode == 3 and error["type"] == "error" and error["exit"] == 3
    assert error["code"] == "unreachable" and "not running" in error["message"]
    commands = set(_subparsers(build_parser()))
    assert commands == set(seen), f"add the new commands to this test: {commands - set(seen)}"


def test_a_live_capture_with_o_json_prints_protocol_lines_that_match_the_schema(
    profiling: DaemonHelper,
) -> None:
    r = profiling.kimi_mode("capture", "--seconds", "0.5", "--then", "stay", "-o", "json")
    assert r.returncode == 0, r.stderr
    lines = json_lines(r)
    assert lines[0]["type"] == "reply" and lines[-1]["type"] == "end" and lines[-1]["ok"]
    assert "capture_recording" in {x.get("event") for x in lines}
    # The end carries the split without its per-step rows: those stay in summary.json.
    split = lines[-1]["data"]["summary"]["across_ranks"]
    assert split["kinds"]["decode"] and "per_step" not in split


def test_wait_rejoins_a_switch_under_way_with_its_real_target_and_ends_with_its_outcome(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    sandbox.fake(load_s=2.0)
    assert serving.kimi_mode("profile", "--no-wait").returncode == 0
    r = serving.kimi_mode("wait")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "following t-" in r.stdout and "-> profile (since " in r.stdout
    ending = flat(r.stdout[r.stdout.rindex("done: ") :])  # wrapped at 80 columns
    assert ending.startswith("done: profile is ready") and " unavailable " in ending, r.stdout
    assert not too_wide(r.stdout), r.stdout
    # Nothing to wait for: at once, with the status's exit; never a switch.
    transitions = len(serving.transitions())
    r = serving.kimi_mode("wait", "profile")
    assert r.returncode == 0 and r.stdout == "done: profile serves\n", r.stdout
    r = serving.kimi_mode("wait", "production", "--timeout", "2")
    assert r.returncode == 4, r.stdout  # profile serves and nobody asked for production
    assert flat(r.stdout).startswith("timed out: production does not serve after 2 s: nobody "
                                     "asked for production"), r.stdout  # fmt: skip
    assert len(serving.transitions()) == transitions
    sandbox.fake()


def test_logs_show_vllms_output_and_the_daemons_own(serving: DaemonHelper) -> None:
    r = serving.kimi_mode("logs", "-n", "3")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] in serving.sb.vllm_log.read_text().splitlines()
    d = serving.kimi_mode("logs", "--daemon", "-n", "200")
    assert d.returncode == 0 and '"event": "state_changed"' in d.stdout, d.stdout


# ------------------------------------------------------------------------------ doctor
def broken(config: Config, tmp_path: Path, **sections: dict[str, Any]) -> Path:
    """A copy of the sandbox's config with these keys changed (nothing else is touched)."""
    update = {
        name: getattr(config, name).model_copy(update=keys) for name, keys in sections.items()
    }
    path = tmp_path / f"{'-'.join(sections)}-{len(list(tmp_path.glob('*.toml')))}.toml"
    path.write_text(config.model_copy(update=update).effective_toml())
    return path


def doctor(daemon: DaemonHelper, config: Path, *more: str) -> dict[str, Any]:
    r = daemon.kimi_mode("doctor", "--config", str(config), "-o", "json", *more)
    (report,) = json_lines(r)
    assert r.returncode == (0 if report["ok"] else 1)
    return report


def failed(report: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["message"] for c in report["checks"] if c["ok"] is False}


def test_doctor_passes_on_a_healthy_host_and_says_what_it_could_not_check(
    serving: DaemonHelper,
) -> None:
    r = serving.kimi_mode("doctor")
    assert r.returncode == 0, r.stdout
    assert r.stdout.splitlines()[-1] == "every check passed, 1 could not be made here"
    assert "?     nvidia-persistenced  simulated GPUs" in r.stdout
    for name in ("config", "vllm executable", "control group", "system bus", "vLLM's unit"):
        assert f"ok    {name}" in r.stdout, r.stdout
    # The sandbox's vLLM runs as its manager's user, root, and doctor says what that costs.
    assert "ok    vLLM's user" in r.stdout and "runs vLLM as root: of root's files" in flat(
        r.stdout
    )
    assert not too_wide(r.stdout), r.stdout
    for name in ("GPU driver", "managed GPUs", "baseline", "daemon", "metrics"):
        assert f"ok    {name}" in r.stdout, r.stdout


def test_doctor_fails_on_each_broken_precondition_and_says_how_to_fix_it(
    sandbox: SandboxHelper, serving: DaemonHelper, tmp_path: Path
) -> None:
    c = sandbox.config
    cases: list[tuple[Path, list[str], str, str]] = [
        (broken(c, tmp_path, vllm={"command": [str(tmp_path / "no-vllm"), "serve"]}), [],
         "vllm executable", "does not exist"),
        (broken(c, tmp_path, control={"group": "no-such-group-kimi"}), [],
         "control group", "'no-such-group-kimi' does not exist"),
        (broken(c, tmp_path, gpus={"sim_dir": tmp_path / "no-gpus"}), [],
         "GPU driver", "NVML does not answer"),
        (broken(c, tmp_path, gpus={"managed": [0, 1, 2, 3, 9]}), [],
         "managed GPUs", "names GPU(s) [9]"),
        (broken(c, tmp_path, service={"unit": "no-such-vllm.service"}), [],
         "vLLM's unit", "no-such-vllm.service is not-found"),
        (broken(c, tmp_path, systemd={"bus_address": f"unix:path={tmp_path}/no-bus"}), [],
         "system bus", "does not answer on D-Bus"),
        (broken(c, tmp_path, state={"dir": tmp_path / "empty-state"}), [],
         "baseline", "no baseline stored"),
        (sandbox.sb.config_path, ["--socket", str(tmp_path / "no.sock")],
         "daemon", "not running"),
    ]  # fmt: skip
    for config, more, name, says in cases:
        report = doctor(serving, config, *more)
        bad = failed(report)
        assert name in bad and says in bad[name], (name, bad)
        assert not report["ok"]
        (check,) = [x for x in report["checks"] if x["name"] == name]
        assert check["fix"], check
    # The metrics port held by another process, with the daemon answering on its own port.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        report = doctor(serving, broken(c, tmp_path, metrics={"port": port}))
        assert "metrics" in failed(report) and f":{port}/metrics" in failed(report)["metrics"]
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text(sandbox.sb.config_path.read_text() + "\n[gpus]\nbackend = 'cuda'\n")
    assert "config" in failed(doctor(serving, bad_toml))
    assert serving.status()["state"] == "serving"  # looking changed nothing


# ------------------------------------------------------------------------------ reload
def metrics(sandbox: SandboxHelper) -> str:
    m = sandbox.config.metrics
    with urllib.request.urlopen(f"http://{m.address}:{m.port}/metrics", timeout=5) as r:
        return r.read().decode()  # type: ignore[no-any-return]


def test_a_reload_that_changes_vllms_argv_keeps_vllm_and_says_a_restart_is_needed(
    sandbox: SandboxHelper, serving: DaemonHelper
) -> None:
    """Before, after an edit of vllm.command and `systemctl reload`, the daemon tore the
    serving vLLM down at once (on the real host, a 30-minute load nobody asked for)."""
    path = sandbox.sb.config_path
    original = path.read_text()
    vllm, teardowns = serving.vllm_pid(), serving.teardown_count()
    try:
        path.write_text(
            original.replace(
                'args = ["--max-model-len", "131072", "--gpu-memory-utilization", "0.92"]',
                'args = ["--max-model-len", "65536", "--gpu-memory-utilization", "0.92"]',
                1,
            )
        )
        since = len(serving.log())
        sandbox.sb.manager.systemctl("reload", DAEMON_UNIT)
        wait_until(lambda: '"restart_needed"' in serving.log()[since:], 30, "the new image")
        status = serving.wait_serving("production")
        assert serving.vllm_pid() == vllm and serving.teardown_count() == teardowns
        assert status["restart_needed"].startswith(f"restart needed: vLLM (PID {vllm}) runs")
        text = serving.kimi_mode("status").stdout
        assert "kimi-mode production --apply" in text
        assert all(len(line) <= 80 for line in text.splitlines() if "restart" in line), text
        assert "kimi_supervisor_restart_needed 1.0" in metrics(sandbox)
        # The operator decides: --apply loads the config's argv.
        r = serving.kimi_mode("production", "--apply")
        assert r.returncode == 0, r.stdout + r.stderr
        status = serving.wait_serving("production")
        assert serving.vllm_pid() != vllm and status["restart_needed"] is None
        assert "kimi_supervisor_restart_needed 0.0" in metrics(sandbox)
        cmdline = Path(f"/proc/{serving.vllm_pid()}/cmdline").read_bytes().split(b"\0")
        assert b"65536" in cmdline
    finally:
        path.write_text(original)


def test_doctor_fails_while_stuck_naming_the_cause_and_the_incident_bundle_within_80_columns(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """It said "every check passed", rc 0, during a STUCK, without a word of the bundle."""
    with daemon.configured(daemon={"stuck_retry_s": 300.0}):
        daemon.start()
        daemon.wait_serving("production")
        sandbox.ghost(gpu="1", mib=20_000, title="nvidia-fabricmanager")  # protected: STUCK
        assert daemon.kimi_mode("profile", "--timeout", "60").returncode == 6
        st = daemon.wait_status(lambda s: (s.get("incident_bundle") or {}).get("path"), 60,
                                "the incident bundle")  # fmt: skip
        r = daemon.kimi_mode("doctor")
    assert r.returncode == 1, r.stdout
    said = flat(r.stdout)
    assert "FAIL daemon STUCK since " in said, r.stdout
    assert f"cause: {flat(st['last_teardown']['diagnosis'])}" in said, r.stdout
    assert f"its incident bundle: {st['incident_bundle']['path']} (root only)" in said, r.stdout
    assert not too_wide(r.stdout), r.stdout
    assert r.stdout.splitlines()[-1].startswith("1 check(s) failed"), r.stdout
