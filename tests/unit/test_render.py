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

from kimi_supervisor.cli.render import Follower, redraws

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
    assert seen == [30, 20, 10, 0]  # full, two thirds, one third, empty: it drains


def test_redrawn_lines_are_cut_to_the_terminals_width() -> None:
    out = io.StringIO()
    f = Follower(out, tty=True, width=lambda: 80)
    for e in events():
        f.on_event(e)
        f._draw(force=True)
    drawn = out.getvalue().replace("\x1b[J", "").split("\n")
    assert max(len(x.split("F", 1)[-1] if "\x1b[" in x else x) for x in drawn) <= 79


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
from kimi_supervisor.cli.render import Follower, redraws
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
        assert len(gpu) == 1 and bar(gpu[0]) == 0, screen  # drained, drawn once
        if columns == 80:
            assert any(x.endswith("...") for x in lines), screen  # the long title was cut
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, env=env)
