"""The profiling workflow: timed profile mode and captures, against the daemon in the sandbox
and the fake vLLM's profiler endpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.capture.retention import oldest_first
from kimi_supervisor.control.client import exchange
from kimi_supervisor.ports import launcher, processes
from kimi_supervisor.ports.http import request
from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT

from ..conftest import (
    KIMI_MODE,
    DaemonHelper,
    SandboxHelper,
    assert_clients_get_403_on_the_profiler_routes,
    flat,
    like_a_terminal,
    wait_until,
)
from ..vllm_0_16 import assert_traces_like_vllm_0_16

pytestmark = pytest.mark.systemd


def captures(sandbox: SandboxHelper) -> list[Path]:
    return oldest_first(sandbox.config.profiling.captures_dir)


def state_file(sandbox: SandboxHelper) -> dict[str, Any]:
    return json.loads((sandbox.config.state.dir / "state.json").read_text())  # type: ignore[no-any-return]


def test_timed_profile_mode_goes_back_to_production_by_itself(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    # The time counts from the request, and the switch's load takes part of it: 4 s left 0 s
    # by the time a loaded CI machine read the status.
    r = daemon.kimi_mode("profile", "--for", "12s")
    assert r.returncode == 0, r.stderr
    assert "back to production at" in flat(r.stdout)
    status = daemon.status()
    assert status["mode"] == "profile" and 0 < status["profile_left_s"] <= 12
    assert "profile ends:" in daemon.kimi_mode("status").stdout
    daemon.wait_serving("production", 30)
    assert any("profile mode expired" in e.get("what", "") for e in daemon.history())
    assert state_file(sandbox)["profile_until"] is None


def test_the_expiry_holds_across_a_daemon_restart_and_asking_again_extends_it(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    assert daemon.kimi_mode("profile", "--for", "1h").returncode == 0
    first = state_file(sandbox)["profile_until"]
    r = daemon.kimi_mode("profile", "--for", "2h")
    assert "already running" in flat(r.stdout) and "back to production at" in flat(r.stdout)
    second = state_file(sandbox)["profile_until"]
    assert datetime.fromisoformat(second) - datetime.fromisoformat(first) > timedelta(minutes=59)
    pid = daemon.pid()
    sandbox.systemd.kill(DAEMON_UNIT, "main", signal.SIGKILL)
    wait_until(lambda: daemon.pid() not in (0, pid), 20, "the daemon to be restarted")
    status = daemon.wait_serving("profile")
    assert status["profile_until"] == datetime.fromisoformat(second).isoformat()
    assert status["profile_left_s"] > 3600


def test_a_profile_mode_that_expired_while_the_daemon_was_down_is_production_at_start(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.reset_state(desired="profile")
    path = sandbox.config.state.dir / "state.json"
    st = json.loads(path.read_text())
    st["profile_until"] = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    path.write_text(json.dumps(st))
    daemon.start()
    status = daemon.wait_serving("production")
    assert status["desired_mode"] == "production" and status["profile_until"] is None


def test_a_capture_lists_the_traces_per_rank_in_its_own_folder_and_returns_to_production(
    sandbox: SandboxHelper, profiling: DaemonHelper
) -> None:
    sandbox.fake(profile_flush_s=1.0)
    r = profiling.kimi_mode("capture", "--seconds", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no restart: vLLM serves on" in flat(r.stdout)  # what it costs, said as it begins
    (folder,) = captures(sandbox)
    names = sorted(f.name for f in folder.iterdir())
    assert_traces_like_vllm_0_16(names, 4)
    assert f"traces in {folder}:" in flat(r.stdout)
    for rank in range(4):
        assert f"rank   {rank}" in r.stdout
    assert_summary_of_the_fakes_traces(folder, r.stdout, 4)
    # The host's fabric, read from the GPU port at capture time, beside the traces and named.
    fabric = json.loads((folder / "fabric.json").read_text())
    assert [g["index"] for g in fabric["gpus"]] == [0, 1, 2, 3], fabric
    assert "GPU 0 NVIDIA H200: PCIe Gen5 x16 (max Gen5 x16), NVLink 4: 18 of 18 active" in flat(
        r.stdout)  # fmt: skip
    assert "flushing:" in flat(r.stdout)  # progress while the files grew
    assert "going back to production" in flat(r.stdout)
    profiling.wait_serving("production")
    (rec,) = [e for e in profiling.history() if e["kind"] == "capture"]
    assert rec["ok"] and rec["folder"] == str(folder)


def test_a_client_of_vllms_port_cannot_start_a_capture_while_the_daemon_can(
    sandbox: SandboxHelper, profiling: DaemonHelper
) -> None:
    """The fake vLLM, started by the launcher as real vLLM is (the profile guard named by
    --middleware and imported from PYTHONPATH, the secret in its environment), refuses the
    profiler's routes to a client as the guard does in real vLLM; the daemon's capture
    records."""
    sandbox.fake(profile_flush_s=0.2)
    cmdline = processes.cmdline_of(profiling.vllm_pid())
    assert cmdline[-2:] == launcher.GUARD_ARGS, cmdline
    assert profiling.status()["mode"] == "profile"  # the guard's arguments are not the mode's
    base = f"http://{sandbox.config.vllm.host}:{sandbox.config.vllm.port}"
    assert_clients_get_403_on_the_profiler_routes(base, 5)
    assert request(f"{base}/health", "GET", 5).status == 200
    r = profiling.kimi_mode("capture", "--seconds", "0.5", "--then", "stay")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(captures(sandbox)) == 1
    token = launcher.read_token(sandbox.config.vllm.argv_file)
    assert token
    said = [" ".join(cmdline), sandbox.config.vllm.argv_file.read_text(), r.stdout,
            json.dumps(profiling.status())]  # fmt: skip
    assert not [s for s in said if token in s]


def assert_summary_of_the_fakes_traces(folder: Path, stdout: str, tp: int) -> None:
    """The fake's traces hold 1 prefill and 5 decode steps, each with a GEMM of 650 us own time
    (aten::linear 50 around _C::onednn_mm 600: not counted twice), an attention of 200 us and
    an all-reduce of 300 + 100 x rank us, ending together on every rank (tests/vllm_0_16.py
    copies these from real vLLM)."""
    summary = json.loads((folder / "summary.json").read_text())
    assert [r["rank"] for r in summary["ranks"]] == list(range(tp)) and not summary["errors"]
    for r in summary["ranks"]:
        assert r["steps"] == {"prefill": 1, "decode": 5} and r["scope"] == "decode steps"
        ms = {c: v["ms_per_step"] for c, v in r["classes"].items()}
        assert ms == pytest.approx(
            {"communication": 0.3 + 0.1 * r["rank"], "gemm": 0.65, "attention": 0.2, "other": 0}
        )
        assert sum(v["share"] for v in r["classes"].values()) == pytest.approx(1, abs=1e-3)
        assert r["top"][0]["name"] in ("_C::onednn_mm", "_C::shm_allreduce")
    assert (
        "rank 0 (VLLM::Worker_TP0): 5 decode, 1 prefill; decode steps: 1.50 ms per step" in stdout
    )
    assert "communication   26.1 %" in stdout  # rank 0: 0.3 of 1.15 ms
    # Across the ranks: every all-reduce ends together, rank r arriving 100 x r us before rank 0.
    split = summary["across_ranks"]["kinds"]["decode"]["collectives"]["all_reduce"]
    assert {k: split["last_to_arrive"][k] for k in ("rank", "share")} == {"rank": 0, "share": 1.0}
    assert split["last_to_arrive"]["by_ms"] == 0.1  # 100 us before the next latest
    assert [p["wait_ms"] for p in split["per_rank"]] == pytest.approx([0.1 * r for r in range(tp)])
    assert [p["transfer_ms"] for p in split["per_rank"]] == pytest.approx([0.3] * tp)
    assert "all-reduce" in stdout and "last to arrive: rank 0 in 100 % of calls" in stdout


def test_a_capture_with_vllm_0_32s_trace_names_is_listed_by_rank_and_summarized(
    sandbox: SandboxHelper, profiling: DaemonHelper
) -> None:
    sandbox.fake(trace_naming="0.32")
    r = profiling.kimi_mode("capture", "--seconds", "0.5", "--then", "stay")
    assert r.returncode == 0, r.stdout + r.stderr
    (folder,) = captures(sandbox)
    ranks = sorted(n for n in os.listdir(folder) if n.startswith("rank"))
    assert [n.split(".")[0] for n in ranks] == ["rank0", "rank1", "rank2", "rank3"]
    for rank in range(4):
        assert f"rank   {rank}" in r.stdout
    assert_summary_of_the_fakes_traces(folder, r.stdout, 4)


def test_a_capture_in_production_mode_is_refused_with_the_hint_to_switch_first(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    daemon.start()
    daemon.wait_serving("production")
    before = len(captures(sandbox))
    r = daemon.kimi_mode("capture", "--seconds", "1")
    assert r.returncode == 5  # refused as the host stands
    assert "not serving with its profiler armed" in r.stderr and "kimi-mode profile" in r.stderr
    r = daemon.kimi_mode("capture", "--switch", "--seconds", "1", "--then", "stay")
    assert r.returncode == 0, r.stdout + r.stderr
    # What it costs, said before the first switch: two restarts.
    assert flat(r.stdout).startswith("this capture stops serving"), r.stdout
    assert "no restart" not in r.stdout
    assert daemon.status()["mode"] == "profile"
    assert len(captures(sandbox)) == before + 1


def capture_until_flushing(
    daemon: DaemonHelper,
) -> tuple[dict[str, subprocess.CompletedProcess[str]], threading.Thread]:
    """A capture (0.5 s, then stay) followed in a thread; returns once it is flushing."""
    done: dict[str, subprocess.CompletedProcess[str]] = {}
    t = threading.Thread(
        target=lambda: done.__setitem__(
            "c", daemon.kimi_mode("capture", "--seconds", "0.5", "--then", "stay")
        )
    )
    t.start()
    daemon.wait_status(
        lambda s: (s.get("capture") or {}).get("phase") == "flushing", 10, "the flush"
    )
    return done, t


def test_a_switch_asked_for_during_a_flush_waits_for_it_and_force_cuts_it_short(
    sandbox: SandboxHelper, profiling: DaemonHelper
) -> None:
    sandbox.fake(profile_flush_s=3.0)
    done, t = capture_until_flushing(profiling)
    r = profiling.kimi_mode("production")
    t.join(30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "waits for capture" in flat(r.stdout)
    assert done["c"].returncode == 0, done["c"].stdout + done["c"].stderr
    capture = next(e for e in profiling.history() if e["kind"] == "capture")
    switch = next(e for e in profiling.transitions() if e["target"] == "production")
    # It waited for the flush, not for the summary (which holds no switch).
    assert capture["ok"] and switch["started_at"] >= capture["released_at"]

    # Now with --force: the flush is cut short and the capture says so. The flush is long, so
    # that a loaded host's slow --force still finds it under way.
    sandbox.fake(profile_flush_s=120.0)
    profiling.kimi_mode("profile")
    done, t = capture_until_flushing(profiling)
    assert profiling.kimi_mode("production", "--force").returncode == 0
    t.join(60)
    assert done["c"].returncode == 1
    assert "FAILED: no answer from vLLM to /stop_profile" in done["c"].stdout


def test_retention_keeps_the_newest_captures_and_logs_what_it_removed(
    sandbox: SandboxHelper, profiling: DaemonHelper
) -> None:
    sandbox.fake(profile_flush_s=0.1)
    # Two captures taken while the clock was a century ahead: their names sort after every
    # capture taken now, and yet they are the oldest, and go first.
    ahead = sandbox.config.profiling.captures_dir
    ahead.mkdir(parents=True, exist_ok=True)
    for name in ("21261201T100000.000Z", "21261201T110000.000Z"):
        (ahead / name).mkdir()
    (ahead / "notes.txt").write_text("an operator's file")
    made = [ahead / "21261201T100000.000Z", ahead / "21261201T110000.000Z"]
    for _ in range(4):  # profiling.keep_captures = 3 in the sandbox
        r = profiling.kimi_mode("capture", "--seconds", "0.2", "--then", "stay")
        assert r.returncode == 0, r.stdout + r.stderr
        made.append(captures(sandbox)[-1])
        assert f"traces in {made[-1]}" in flat(r.stdout), r.stdout  # the one just taken is kept
    assert captures(sandbox) == made[-3:]  # the newest three, by when they were made
    assert (ahead / "notes.txt").exists()
    assert f"removed by retention: {made[2]}" in flat(r.stdout)  # the last one took the first taken
    assert '"capture_removed"' in profiling.log()


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("404", "its profiler is not configured"),
        ("500", "HTTP 500: "),
        ("hang", "no answer from vLLM to /start_profile within 2 s"),
    ],
)
def test_profiler_endpoint_failures_give_clear_errors(
    sandbox: SandboxHelper, profiling: DaemonHelper, fault: str, says: str
) -> None:
    sandbox.fake(profiler_fault=fault)
    r = profiling.kimi_mode("capture", "--seconds", "0.2", "--then", "stay")
    assert r.returncode == 1
    assert says in flat(r.stdout)
    sandbox.fake()
    assert profiling.status()["state"] == "serving"


def test_ctrl_c_while_recording_stops_the_recording_and_the_flush_completes(
    sandbox: SandboxHelper, profiling: DaemonHelper
) -> None:
    proc = subprocess.Popen(
        [KIMI_MODE, "capture", "--then", "stay"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **profiling.sb.env},
        preexec_fn=like_a_terminal,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("recording"):
            break
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert "recording stopped; the flush goes on" in err
    wait_until(
        lambda: len(captures(sandbox)) == 1 and not profiling.status()["capture"], 20, "flush"
    )


def test_a_capture_with_out_goes_into_its_own_folder_there_and_bad_out_paths_are_refused(
    sandbox: SandboxHelper, profiling: DaemonHelper, tmp_path: Path
) -> None:
    sandbox.fake(profile_flush_s=0.1)
    missing = profiling.kimi_mode("capture", "--seconds", "0.2", "--out", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    (tmp_path / "file").write_text("")
    a_file = profiling.kimi_mode("capture", "--seconds", "0.2", "--out", str(tmp_path / "file"))
    assert a_file.returncode == 2 and "not a directory" in a_file.stderr
    assert profiling.status()["capture"] is None  # refused before anything was asked
    # A raw client that names a directory without passing it is told how.
    req = {"cmd": "capture", "seconds": 0.2, "then": "stay", "out": str(tmp_path)}
    ((_raw, answer),) = list(exchange(profiling.socket, req, timeout_s=10))
    assert answer["code"] == "bad_request" and "SCM_RIGHTS" in answer["message"]
    out = tmp_path / "traces"
    out.mkdir()
    (tmp_path / "link").symlink_to(out)  # the asker's own link is theirs to follow
    r = profiling.kimi_mode(
        "capture", "--seconds", "0.2", "--then", "stay", "--out", str(tmp_path / "link")
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (folder,) = out.iterdir()
    assert len(list(folder.glob("*rank*"))) == 4
