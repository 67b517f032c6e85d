"""The live switch display as an operator sees it: the drain bar, the redraw at any terminal
width (in a real terminal, tmux), and plain lines where a redraw cannot work."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.cli.follower import Follower, redraws

LONG = "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server " + "--flag value " * 20


def events() -> list[dict[str, Any]]:
    """A switch: a teardown that kills a long-titled holder while two GPUs drain."""
    out: list[dict[str, Any]] = [
        {"event": "transition_started", "data": {"id": "t1", "previous": "profile",
         "target": "production", "kind": "switch", "reason": "asked by alice"}},
        {"event": "step_started", "data": {"step": "stop_unit"}},
    ]  # fmt: skip
    for used in (90_615, 60_615, 30_615, 615):
        out.append({"event": "gpus", "data": {"devices": [
            {"index": i, "used_mib": used, "baseline_mib": 615} for i in (0, 1)]}})  # fmt: skip
        out.append({"event": "kill", "data": {"signal": "SIGKILL", "step": "kill_strays",
                    "evidence": "vllm_signature", "process": {"pid": 4242 + used,
                    "cmdline": LONG.split()}}})  # fmt: skip
    for step in ("stop_unit", "kill_cgroup", "kill_strays", "kill_gpu_holders", "wait_driver"):
        out.append({"event": "step_finished", "data": {"step": step, "duration_s": 0.21}})
    out.append({"event": "teardown_finished", "data": {"outcome": "clean", "duration_s": 1.19}})
    out.append({"event": "starting", "data": {"mode": "production"}})
    for used in (615, 45_615, 90_615):  # the load fills the GPUs towards their total
        out.append({"event": "gpus", "data": {"phase": "load", "devices": [
            {"index": i, "used_mib": used, "baseline_mib": 615, "total_mib": 143_771}
            for i in (0, 1)]}})  # fmt: skip
    return out


def bar(line: str) -> int:
    return line.split("[", 1)[1].split("]", 1)[0].count("#")


def test_the_drain_bar_is_scaled_to_the_memory_at_the_start_of_the_teardown() -> None:
    out = io.StringIO()
    f = Follower(out, tty=False)
    seen = []
    for e in events():
        f.on_event(e)
        if e["event"] == "gpus":
            seen.append(next(bar(x) for x in f._lines() if x.startswith("  GPU 0 [")))
    assert seen[:4] == [24, 16, 8, 0]  # full, two thirds, one third, empty: it drains


def test_after_the_teardown_the_bars_follow_the_load_filling_the_gpus() -> None:
    f = Follower(io.StringIO(), tty=False)
    seen = []
    for e in events():
        f.on_event(e)
        if e["event"] == "gpus":
            seen.append(next(bar(x) for x in f._lines() if x.startswith("  GPU 0 [")))
    assert seen[4:] == [0, 8, 15]  # 0, 45 and 90 GB of an H200's 140: it fills
    assert "  GPU memory, filling as vLLM loads:" in f._lines()


def test_redrawn_lines_wrap_at_the_terminals_width_and_keep_the_verdict_and_the_evidence() -> None:
    out = io.StringIO()
    f = Follower(out, tty=True, width=lambda: 80)
    for e in events():
        f.on_event(e)
        f._draw(force=True)
    drawn = out.getvalue().replace("\x1b[J", "").split("\n")
    rows = [x.split("F", 1)[-1] if "\x1b[" in x else x for x in drawn]
    assert max(len(x) for x in rows) <= 79
    last = rows[-f._drawn - 1 :]
    assert any("=> CLEAN in 1.19 s" in x for x in last), last  # the verdict, on one row
    assert sum("(kill_strays: vllm_signature)" in x for x in last) == 4, last  # every kill's


def test_a_rejoined_switch_shows_its_real_target_and_the_time_since_it_began() -> None:
    from datetime import UTC, datetime, timedelta

    f = Follower(io.StringIO(), tty=False)
    began = datetime.now(UTC) - timedelta(minutes=3, seconds=5)
    f.join({"target": "profile", "started_at": began.isoformat(), "step": "starting"})
    head = f._lines()[0]
    assert head.startswith("kimi-mode: switching to profile  (3m ") and head.endswith("s)"), head


def test_term_dumb_or_no_terminal_gets_plain_lines() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert redraws(Tty(), {"TERM": "xterm-256color"})
    assert not redraws(Tty(), {"TERM": "dumb"})
    assert not redraws(io.StringIO(), {"TERM": "xterm-256color"})


SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from tests.unit.test_render import events
from kimi_supervisor.cli.follower import Follower, redraws
import os
f = Follower(sys.stdout, redraws(sys.stdout, os.environ))
for e in events():
    f.on_event(e)
    f._draw(force=True)
    time.sleep(0.05)
f.finish()
print("DONE")
time.sleep(60)
"""


@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (setup installs it)"
)
@pytest.mark.parametrize("columns", [80, 200])
def test_in_a_real_terminal_the_redraw_leaves_one_header_at_any_width(
    columns: int, tmp_path: Path
) -> None:
    script = tmp_path / "follow.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).resolve().parents[2])))
    server = f"kimi-display-{os.getpid()}-{columns}"
    tmux = ["tmux", "-L", server, "-f", "/dev/null"]
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("TMUX", None)
    subprocess.run([*tmux, "new-session", "-d", "-x", str(columns), "-y", "50",
                    f"{sys.executable} {script}"], check=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        screen = ""
        while "DONE" not in screen:
            assert time.monotonic() < deadline, screen
            time.sleep(0.2)
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-J"], capture_output=True,
                                    text=True, env=env).stdout  # fmt: skip
        lines = screen.splitlines()
        assert sum("kimi-mode: switching to production" in x for x in lines) == 1, screen
        assert all(len(x) <= columns for x in lines)
        gpu = [x for x in lines if x.startswith("  GPU 0 [")]
        assert len(gpu) == 1 and bar(gpu[0]) == 15, screen  # loaded to 90 GB, drawn once
        assert sum("=> CLEAN in 1.19 s" in x for x in lines) == 1, screen  # the verdict
        evidence = sum("(kill_strays: vllm_signature)" in x for x in lines)
        assert evidence == 4, screen  # each kill's evidence, whole, at 80 columns too
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, env=env)
