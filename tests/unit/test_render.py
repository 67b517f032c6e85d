"""The live switch display as an operator sees it: the drain bar, the redraw at any terminal
width (in a real terminal, tmux), and plain lines where a redraw cannot work."""

from __future__ import annotations

import io
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.cli.follower import Follower, redraws

LONG = "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server " + "--flag value " * 20
PYTHON_HOLDER = ["/opt/venvs/vllm-0.16/bin/python3.12", "-X", "dev", "-m",
                 "vllm.entrypoints.openai.api_server", "--model", "Kimi-K2.5"]  # fmt: skip
MAPPED = (
    "has a managed GPU's device file open and mapped, and no live listed process explains "
    "that GPU's memory"
)


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
    out.append({"event": "kill", "data": {"signal": "SIGKILL", "step": "kill_gpu_holders",
                "evidence": MAPPED, "process": {"pid": 7, "cmdline": PYTHON_HOLDER}}})  # fmt: skip
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
    f = Follower(out, tty=True, width=lambda: 80, height=lambda: 50)
    for e in events():
        f.on_event(e)
        f._draw(force=True)
    rows = re.sub(r"\x1b\[\d*[FJK]", "", out.getvalue()).split("\n")
    assert max(len(x) for x in rows) <= 79
    last = rows[-len(f.screen.drawn) - 1 :]
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


_SERVERS = itertools.count()


class Terminal:
    """A real terminal (tmux, a server of its own) of `columns` x `rows` running `script`; each
    `look()` is its screen, until the script prints DONE. Ended, and `cleanup` removed, after."""

    def __init__(self, script: Path, columns: int, rows: int, cleanup: str = "") -> None:
        # A server of its own each time: a name used again may still be the last one's,
        # shutting down, on a loaded host (new-session then fails).
        name = f"kimi-{os.getpid()}-{next(_SERVERS)}-{script.stem}-{columns}x{rows}"
        self.tmux = ["tmux", "-L", name, "-f", "/dev/null"]
        self.env = {**os.environ, "TERM": "xterm-256color"}
        self.env.pop("TMUX", None)
        self.cleanup = cleanup
        self.began = time.monotonic()
        self.screen = ""
        self.run("new-session", "-d", "-x", str(columns), "-y", str(rows),
                 f"{sys.executable} {script}")  # fmt: skip

    def run(self, *args: str) -> str:
        return subprocess.run([*self.tmux, *args], capture_output=True, text=True, env=self.env,
                              check=args[0] != "kill-server").stdout  # fmt: skip

    def looks(self, deadline_s: float = 40, *joined: str) -> Iterator[str]:
        """The screen every 0.2 s until DONE is on it (-J: rows the terminal wrapped, joined)."""
        while "DONE" not in self.screen:
            assert time.monotonic() - self.began < deadline_s, self.screen
            time.sleep(0.2)
            self.screen = self.run("capture-pane", "-p", *joined)
            yield self.screen

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.run("kill-server")
        if self.cleanup:
            shutil.rmtree(self.cleanup, ignore_errors=True)


@pytest.mark.terminal
@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (setup installs it)"
)
@pytest.mark.parametrize("columns", [80, 200])
def test_in_a_real_terminal_the_redraw_leaves_one_header_at_any_width(
    columns: int, tmp_path: Path
) -> None:
    script = tmp_path / "follow.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).resolve().parents[2])))
    with Terminal(script, columns, 50) as t:
        screen = [*t.looks(30, "-J")][-1]
    lines = screen.splitlines()
    assert sum("kimi-mode: switching to production" in x for x in lines) == 1, screen
    assert all(len(x) <= columns for x in lines)
    gpu = [x for x in lines if x.startswith("  GPU 0 [")]
    assert len(gpu) == 1 and bar(gpu[0]) == 15, screen  # loaded to 90 GB, drawn once
    assert sum("=> CLEAN in 1.19 s" in x for x in lines) == 1, screen  # the verdict
    evidence = sum("(kill_strays: vllm_signature)" in x for x in lines)
    assert evidence == 4, screen  # each kill's evidence, whole, at 80 columns too
    # A reason wider than a row wraps at its spaces; the kill names the program.
    assert words(screen) >= {"vllm.entrypoints.openai.api_server", "memory)"}, screen
    assert "/opt/venvs" not in screen


# ------------------------------------------------------------------------------ 80 columns
def words(text: str) -> set[str]:
    return set(text.split())


def assert_wrapped_whole(rows: list[str], source: list[str], columns: int) -> None:
    """Every row fits, and every word of the source is on one row: none is cut."""
    assert all(len(r) <= columns for r in rows), [r for r in rows if len(r) > columns]
    assert words("\n".join(rows)) <= words("\n".join(source)), words("\n".join(rows)) - words(
        "\n".join(source)
    )


def test_a_kill_line_names_the_program_not_the_interpreter() -> None:
    from kimi_supervisor.model import program

    assert program(PYTHON_HOLDER, "python3.12") == "vllm.entrypoints.openai.api_server"
    assert program(["/opt/vllm/bin/python", "/opt/vllm/bin/vllm", "serve", "m"], "") == "vllm serve"
    assert program("/usr/bin/python3 -u /tmp/x/ghost.py --title t", "") == "ghost.py"
    assert program(["VLLM::Worker_TP3"], "VLLM::Worker_TP") == "VLLM::Worker_TP3"
    assert program([], "kworker/0:1") == "kworker/0:1"
    # python -c: the code it runs, its start (a kill line said `python3 -c` and nothing more)
    assert program(["python3", "-c", "import torch\nx = torch.zeros(1)"], "") == (
        "python3 -c 'import torch x = torch.zeros(1)'"
    )
    assert program(["python3", "-c", "import a; " * 10], "") == (
        "python3 -c 'import a; import a; import a; import a;...'"
    )
    assert program(["python3", "-c"], "python3") == "python3"
    f = Follower(io.StringIO(), tty=False)
    f.on_event({"event": "kill", "data": {"signal": "SIGKILL", "step": "kill_gpu_holders",
                "evidence": MAPPED, "process": {"pid": 7, "cmdline": PYTHON_HOLDER}}})  # fmt: skip
    said = f.out.getvalue()  # type: ignore[attr-defined]
    assert said.startswith("  killed PID 7 vllm.entrypoints.openai.api_server (kill_gpu_holders:")
    assert "/opt/venvs" not in said


def test_at_80_columns_a_long_kill_reason_wraps_at_its_spaces_never_mid_word() -> None:
    """Before, the evidence was kept whole (one unbreakable unit) and, wider than a row, cut
    as `memor` / `y)`."""
    for tty in (True, False):
        out = io.StringIO()
        f = Follower(out, tty=tty, width=lambda: 80)
        kill = {"signal": "SIGKILL", "step": "kill_gpu_holders", "evidence": MAPPED,
                "process": {"pid": 7, "cmdline": PYTHON_HOLDER}}  # fmt: skip
        f.on_event({"event": "kill", "data": kill})
        f.finish()
        rows = re.sub(r"\x1b\[\d*[FJK]", "", out.getvalue()).splitlines()
        source = [*f._lines(), f"killed PID 7 {MAPPED}"]
        assert_wrapped_whole(rows, source, 80)
        assert any(r.rstrip().endswith("memory)") for r in rows), rows


def test_history_wraps_every_record_at_80_columns_at_word_boundaries() -> None:
    from kimi_supervisor.cli.render import format_history

    at = "2026-12-03T10:00:00+00:00"
    kill = {"signal": "SIGKILL", "step": "kill_gpu_holders", "evidence": MAPPED,
            "process": {"pid": 4242, "cmdline": PYTHON_HOLDER}}  # fmt: skip
    entries = [
        {"kind": "transition", "started_at": at, "previous": "production", "target": "profile",
         "trigger": "switch", "outcome": "ready", "duration_s": 1834.2, "id": "t-20261203T100000-"
         "abcdef", "requested_by": "alice (PID 123456)", "message": "profile is ready (1834.2 s)"
         ", after a teardown that took its time and a load of the whole model from the disk",
         "downtime": {"text": "unavailable for 30m 34s: old vLLM exit 2.1 s, teardown 1.2 s, "
                              "to weights 1201.0 s, engine init 600.4 s, to ready 29.5 s"}},
        {"kind": "teardown", "started_at": at, "outcome": "stuck", "duration_s": 12.5,
         "kills": [kill], "reason": "switch to profile asked by alice (PID 123456) from tmux",
         "diagnosis": "GPU 3 still holds 20,000 MiB above its baseline after every step; "
                      "nothing that holds it could be killed on the evidence there is",
         "remaining": []},
        {"kind": "capture", "started_at": at, "ok": True, "message": "capture c-1 wrote 8 "
         "trace files (2.1 GB) to /var/lib/kimi-supervisor/captures/2026-12-03T10-00-00"},
        {"kind": "incident", "at": at, "what": "vLLM hung: 3 requests running and no token for "
         "135 s, its processes using no CPU; restarted (1 of 3 in the window)"},
    ]  # fmt: skip
    text = format_history(entries, 80)
    rows = text.splitlines()
    assert_wrapped_whole(rows, [format_history(entries, 10_000)], 80)
    assert len(rows) > 12  # wrapped, not cut
    assert all(r[:21].strip() == "" for r in rows if not r.startswith("2026")), rows  # hung
    assert "vllm.entrypoints.openai.api_server" in text and "/opt/venvs" not in text


def test_a_captures_summary_wraps_at_80_columns() -> None:
    from kimi_supervisor.cli.render import format_capture

    data = {"folder": "/var/lib/kimi-supervisor/captures/2026-12-03T10-00-00-alice-" + "x" * 12,
            "files": [{"rank": 0, "bytes": 2e9, "name": "1796000000000000000-rank-0.1796080"
                       "794321189670.pt.trace.json.gz"}], "removed": ["/var/lib/kimi-super"
            "visor/captures/2026-11-01T10-00-00 (older than profiling.keep_days)"]}  # fmt: skip
    rows = format_capture(data, 80).splitlines()
    assert all(len(r) <= 80 for r in rows), rows
    assert words("\n".join(rows)) <= words(format_capture(data, 10_000))


# A daemon whose switch kills KILLS processes, then loads silently for LOAD_S while its
# published status moves on (GPUS filling, the ETA shrinking), then ends it; the real kimi-mode
# follows it in the terminal.
DAEMON = """
import json, os, socket, sys, threading, time
from datetime import UTC, datetime
sys.path.insert(0, {root!r})
from kimi_supervisor.cli import kimi_mode
LOAD_S, GPUS, KILLS = {load_s}, {gpus}, {kills}
path = os.path.join({sock_dir!r}, "s")
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(16)
began = time.monotonic()

def status():
    t = time.monotonic() - began
    gpus = [{{"index": i, "used_mib": 615 + int(t * 20_000), "baseline_mib": 615,
             "total_mib": 143_771, "tolerance_mib": 64, "holders": []}} for i in range(GPUS)]
    return {{"v": 1, "type": "reply", "ok": True, "code": "status", "message": "", "data": {{
        "state": "starting", "gpus": gpus, "desired_mode": "profile",
        "state_since": "2026-01-01T12:00:00+00:00", "status_line": "switching to profile",
        "unit": {{"name": "vllm.service"}}, "daemon": {{"pid": 1, "started_at": "2026-01-01"}},
        "progress": {{"phase": "weights", "text": "loading weights"}},
        "eta": {{"expected_s": 60, "remaining_s": 60 - t, "elapsed_s": t, "past_loads": 3,
                 "slower_than_past": False, "text": f"about {{60 - t:.0f}} s left"}}}}}}

def line(kind, **more):
    return json.dumps({{"v": 1, "type": kind, **more}}).encode() + b"\\n"

def event(name, **data):
    return line("event", event=name, at="", data=data)

def talk(conn):
    req = json.loads(conn.makefile("rb").readline())
    if req["cmd"] == "status":
        conn.sendall(json.dumps(status()).encode() + b"\\n")
        conn.close()
        return
    tr = {{"id": "t-1", "target": "profile", "previous": "production",
          "started_at": datetime.now(UTC).isoformat(), "step": "stop_unit"}}
    conn.sendall(line("reply", ok=True, code="accepted", message="switching to profile",
                      data={{"transition": tr}}))
    for i in range(KILLS):
        conn.sendall(event("kill", signal="SIGKILL", step="kill_strays",
                           evidence="vllm_signature", process={{"pid": 4000 + i,
                           "cmdline": ["python3", "-m", "vllm.entrypoints.openai.api_server"]}}))
        time.sleep(0.05)
    if KILLS:
        conn.sendall(event("teardown_finished", outcome="clean", duration_s=0.6))
    conn.sendall(event("starting", mode="profile"))
    time.sleep(LOAD_S)
    conn.sendall(line("end", ok=True, outcome="ready", message="profile is ready",
                      data={{"transition": "t-1"}}))
    conn.close()

def serve():
    while True:
        conn, _ = server.accept()
        threading.Thread(target=talk, args=(conn,), daemon=True).start()

threading.Thread(target=serve, daemon=True).start()
kimi_mode.main(["profile", "--socket", path])
print("DONE")
time.sleep(60)
"""


def scripted_switch(tmp_path: Path, *, load_s: float, gpus: int, kills: int) -> tuple[Path, str]:
    """The script (DAEMON) and its socket's folder: short (AF_UNIX paths end at 108 bytes;
    tmp_path is named after the test), removed after (each run used to leave one in /tmp)."""
    sock_dir = tempfile.mkdtemp(prefix="kimi-tty-")
    script = tmp_path / f"switch{gpus}x{kills}.py"
    root = str(Path(__file__).resolve().parents[2])
    script.write_text(
        DAEMON.format(root=root, load_s=load_s, gpus=gpus, kills=kills, sock_dir=sock_dir)
    )
    return script, sock_dir


@pytest.mark.terminal
@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (setup installs it)"
)
def test_in_a_real_terminal_the_clock_bars_and_eta_move_every_second_through_a_silent_load(
    tmp_path: Path,
) -> None:
    """Before, between the daemon's events the display stood still ("(2s)" for 8-9 s, the
    bars frozen), which during a 30-minute load with silent phases looks like a hang."""
    script, sock_dir = scripted_switch(tmp_path, load_s=4.5, gpus=2, kills=0)
    clocks: list[tuple[float, str]] = []
    bars, etas = set(), set()
    with Terminal(script, 80, 30, sock_dir) as t:
        for screen in t.looks(30, "-J"):
            for line in screen.splitlines():
                if line.startswith("kimi-mode: switching to profile  ("):
                    clocks.append((time.monotonic(), line.rsplit("(", 1)[1].rstrip(")")))
                elif line.startswith("  GPU 0 ["):
                    bars.add(bar(line))
                elif "s left" in line:
                    etas.add(line.strip())
    shown = [c for _, c in clocks]
    # The clock moved through the silent load and never stood for long (the bug: 8-9 s). A
    # loaded host (load 17 on 2 cores) may skip a second between two looks, or hold the
    # display's process for a second or two: neither is the bug, so the bound is loose.
    assert len({c for c in shown if c != "0s"}) >= 3, shown
    stood, last, since = 0.0, None, 0.0
    for at, c in clocks:
        if c != last:
            last, since = c, at
        if c != "0s":
            stood = max(stood, at - since)
    assert stood < 5.0, (stood, shown)  # the bug stood 8-9 s
    assert len(bars) >= 3, bars  # the bars followed the published readings
    assert len(etas) >= 3, etas  # and so did the ETA


def test_a_path_wider_than_the_row_is_kept_whole_on_a_row_of_its_own() -> None:
    from kimi_supervisor.cli.render import wrap

    path = (
        "/var/lib/a-much-longer-state-folder/kimi-supervisor/incidents/"
        "incident-20261204T180123.620132Z-stuck.txt"
    )
    rows = wrap([f"incident: the newest bundle is {path} (root only)"], 80)
    assert f"  {path}" in rows, rows  # copied as it is shown
    assert all(len(r) <= 80 for r in rows if path not in r)


# ------------------------------------------------------------------------------ the height
def switch_frame(kills: int, gpus: int, cmdline: list[str] | None = None) -> Follower:
    f = Follower(io.StringIO(), tty=False)
    f.on_event({"event": "transition_started", "data": {"id": "t1", "previous": "profile",
                "target": "production", "kind": "switch", "reason": "asked"}})  # fmt: skip
    for step in ("stop_unit", "kill_cgroup", "kill_strays"):
        f.on_event({"event": "step_finished", "data": {"step": step, "duration_s": 0.21}})
    for i in range(kills):
        f.on_event({"event": "kill", "data": {"signal": "SIGKILL", "step": "kill_strays",
                    "evidence": "vllm_signature", "process": {"pid": 1000 + i,
                    "cmdline": cmdline or PYTHON_HOLDER}}})  # fmt: skip
    f.on_event({"event": "gpus", "data": {"devices": [
        {"index": i, "used_mib": 80_615, "baseline_mib": 615} for i in range(gpus)]}})  # fmt: skip
    f.vllm = "loading weights 45%; ready in about 3 min (past loads: 5 min)"
    return f


@pytest.mark.parametrize(
    ("columns", "rows", "kills", "gpus", "kills_shown"),
    [
        pytest.param(80, 24, 11, 8, 5, id="at 80x24 eleven kills show as five and 6 more"),
        pytest.param(80, 15, 11, 8, 2, id="at 80x15 the kills fold further, GPUs two a row"),
        pytest.param(200, 50, 11, 8, 5, id="at 200x50 everything shows, kills to five"),
        pytest.param(80, 24, 2, 1, 2, id="a short switch shows every kill"),
        pytest.param(80, 8, 11, 8, 0, id="at 80x8 what does not fit is counted"),
        pytest.param(40, 5, 11, 8, 0, id="a tiny terminal keeps the clock and a count"),
        pytest.param(80, 2, 11, 8, 0, id="a terminal of two rows keeps the clock alone"),
    ],
)
def test_the_redrawn_frame_fits_the_terminal_and_counts_what_it_folds(
    columns: int, rows: int, kills: int, gpus: int, kills_shown: int
) -> None:
    frame = switch_frame(kills, gpus).frame(columns, rows)
    assert len(frame) <= rows - 1, frame  # the cursor's row below it: nothing scrolls
    assert all(len(r) <= columns - 1 for r in frame), frame
    assert frame[0].startswith("kimi-mode: switching to production"), frame  # the clock
    text = "\n".join(frame)
    shown = text.count("killed PID")
    assert shown == kills_shown, frame
    if shown < kills and rows > 2:  # two rows: the clock's, and the cursor's
        said = f"{kills - shown} more killed" in text
        assert said or "more rows" in text, frame
    if rows >= 15:
        assert frame[-1].startswith("  vLLM: loading weights 45%"), frame
        assert sum(x.count("GPU ") for x in frame if "[" in x) == gpus, frame  # every GPU


WIDE = ["/opt/\u8a13\u7df4/\u30b8\u30e7\u30d6/" + "\u5b66\u7fd2" * 30, "--\u8a2d\u5b9a"]
LONG_PATH = ["/srv/" + "a-very-long-folder-name/" * 8 + "train.py", "--epochs", "3"]


@pytest.mark.parametrize(
    ("columns", "rows", "cmdline"),
    [
        pytest.param(80, 15, WIDE, id="at 80x15 killed processes with CJK names"),
        pytest.param(80, 24, WIDE, id="at 80x24 killed processes with CJK names"),
        pytest.param(80, 15, LONG_PATH, id="at 80x15 killed processes run from a long path"),
        pytest.param(40, 5, WIDE, id="a tiny terminal with CJK names"),
    ],
)
def test_a_frame_with_wide_names_or_long_paths_takes_no_more_rows_than_the_terminal_has(
    columns: int, rows: int, cmdline: list[str]
) -> None:
    """An outside review: a kill's CJK name (two columns a character) or a path kept whole
    made rows the terminal wrapped onto more, uncounted: the scrollback grew by 45-54 rows a
    switch and the clock left the screen. The frame is counted in the terminal's rows."""
    from kimi_supervisor.cli.render import rows_of

    frame = switch_frame(11, 8, cmdline).frame(columns, rows)
    assert rows_of(frame, columns) <= rows - 1, frame
    assert frame[0].startswith("kimi-mode: switching to production"), frame  # the clock


def test_a_terminal_column_count_knows_wide_and_combining_characters() -> None:
    from kimi_supervisor.cli.render import cells, cut, rows_of

    assert cells("abc") == 3 and cells("\u5b66\u7fd2") == 4 and cells("e\u0301") == 1
    assert rows_of(["\u5b66" * 40, "x"], 80) == 2 and rows_of(["\u5b66" * 41], 80) == 2
    assert cells(cut("\u5b66" * 50, 79)) == 78


def test_a_storm_of_resizes_is_drawn_once_the_size_held_never_a_frame_per_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, each SIGWINCH drew a frame from the signal handler, at a size the terminal no
    longer had by the time it was shown (and into the middle of another write)."""
    import types

    from kimi_supervisor.cli import follower

    now = [100.0]
    monkeypatch.setattr(follower, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    out = io.StringIO()
    f = Follower(out, tty=True, width=lambda: 80, height=lambda: 15)
    f.on_event({"event": "starting", "data": {"mode": "profile"}})
    drawn = out.getvalue().count("\x1b[J")
    for i in range(200):  # a window dragged for 2 s: signals, events and ticks among them
        now[0] += 0.01
        f._resized(28, None)
        if i % 10 == 0:
            f.on_event({"event": "progress", "data": {"text": f"loading {i}"}})
        if i % 100 == 0:
            f.tick(None)
    assert out.getvalue().count("\x1b[J") == drawn  # nothing drawn while it moved
    now[0] += 1.0  # the next tick, the size held since
    f.tick(None)
    assert out.getvalue().count("\x1b[J") == drawn + 1  # once, at the size it has now
    f.finish()


@pytest.mark.terminal
@pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (setup installs it)"
)
@pytest.mark.parametrize(
    ("columns", "rows", "shrunk"),
    [
        pytest.param(80, 15, None, id="80x15"),
        pytest.param(80, 24, None, id="80x24"),
        pytest.param(200, 50, None, id="200x50"),
        pytest.param(200, 50, (80, 15), id="200x50 shrunk to 80x15 mid-switch"),
        pytest.param(80, 15, "storm", id="80x15 through storms of resizes (a window dragged)"),
    ],
)
def test_in_a_real_terminal_the_clock_is_on_screen_every_second_and_no_frame_piles_up(
    columns: int, rows: int, shrunk: tuple[int, int] | str | None, tmp_path: Path
) -> None:
    """A frame taller than the screen could not be moved back over: at 80x15 the clock's row
    was never on screen, and every redraw left a copy in the scrollback (18 for one switch).
    A storm of SIGWINCHs drew a frame per signal, each at a size the terminal no longer had:
    58 rows of copies in the scrollback for one switch."""
    script, sock_dir = scripted_switch(tmp_path, load_s=5, gpus=8, kills=11)
    looks, with_clock, seconds, most = 0, 0, set(), ""
    with Terminal(script, columns, rows, sock_dir) as t:
        for screen in t.looks():
            if shrunk == "storm" and time.monotonic() - t.began < 2:
                for i in range(20):  # wider and taller, then back, as a dragged window goes
                    t.run("resize-window", "-x", str(columns + i % 7 * 10),
                          "-y", str(rows + i % 5))  # fmt: skip
                t.run("resize-window", "-x", str(columns), "-y", str(rows))
                continue
            if isinstance(shrunk, tuple) and time.monotonic() - t.began > 3:
                t.run("resize-window", "-x", str(shrunk[0]), "-y", str(shrunk[1]))
                columns, rows, shrunk = *shrunk, None
                continue
            heads = [x for x in screen.splitlines() if x.startswith("kimi-mode: switching to")]
            if "DONE" not in screen and ("kill" in screen or heads):
                looks += 1
                assert len(heads) <= 1, screen  # never two clocks: no frame piled up
                if heads:  # a look may fall in the middle of a redraw (row over row)
                    with_clock += 1
                    seconds.add(heads[0].rsplit("(", 1)[1])
                if "killed PID" in screen:
                    most = screen
        history = t.run("display", "-p", "#{history_size}")
    # The clock's row on screen, moving, and never twice (the bug: never on screen at all,
    # and a copy of each frame in the scrollback). A loaded host (-n 2 beside other work)
    # draws seldom and a look may fall mid-redraw, so how often is not asserted, only that.
    assert looks >= 10 and with_clock >= 3, (looks, with_clock, seconds)
    assert len(seconds) >= 2, (looks, seconds)
    assert int(history) <= rows, history  # at most one frame went into the scrollback
    if rows == 24:
        assert most.count("killed PID") == 5 and "6 more killed" in most, most


# ------------------------------------------------------------------------------ GPU health
GPU3 = {"index": 3, "remap_pending": True, "remap_failed": False, "retired_pending": None,
        "ecc_uncorrected": 0, "nvlink_errors": None, "xids": [79], "unread": []}  # fmt: skip
HEALTHY = {**GPU3, "index": 0, "remap_pending": False, "xids": []}


@pytest.mark.parametrize(
    ("policy", "refused", "gpus", "said"),
    [
        pytest.param("warn", False, [HEALTHY, GPU3], [
            "warning: GPU 3: rows remapped, waiting for a GPU reset to take effect "
            "(gpus.health_check = warn: loading all the same)",
            "warning: GPU 3: the kernel logged Xid 79 (the GPU fell off the bus) since boot "
            "(gpus.health_check = warn: loading all the same)",
        ], id="warn names each failing GPU and signal and says the load goes on"),
        pytest.param("refuse", True, [{**GPU3, "xids": []}], [
            "warning: GPU 3: rows remapped, waiting for a GPU reset to take effect "
            "(gpus.health_check = refuse: the load is refused)",
        ], id="refuse says the load is refused"),
    ],
)  # fmt: skip
def test_a_followed_switch_says_each_gpu_health_finding_with_the_policy(
    policy: str, refused: bool, gpus: list[dict[str, Any]], said: list[str]
) -> None:
    for tty in (False, True):
        out = io.StringIO()
        f = Follower(out, tty=tty, width=lambda: 200, height=lambda: 50)
        text = "; ".join(said) or "healthy"
        f.on_event({"event": "gpu_health", "data": {"checked_at": "", "verdict": "failing",
                    "text": text, "policy": policy, "refused": refused, "gpus": gpus}})  # fmt: skip
        printed = re.sub(r"\x1b\[\d*[FJK]", "", out.getvalue())
        assert all(len(r) < (200 if tty else 80) for r in printed.splitlines()), printed
        for line in said:
            assert line in " ".join(printed.split()), printed
        assert printed.count("warning:") == len(said), printed


# ------------------------------------------------------------------------------ doctor
@pytest.mark.parametrize(
    ("findings", "folded"),
    [
        pytest.param([f"GPU {i}: page retirement: not supported by this GPU" for i in range(8)],
                     ["GPUs 0-7: page retirement: not supported by this GPU"],
                     id="eight GPUs saying the same are one line"),
        pytest.param(["GPU 1: rows remapped", "GPU 3: rows remapped", "GPU 3: Xid 79"],
                     ["GPUs 1, 3: rows remapped", "GPU 3: Xid 79"],
                     id="what differs stays apart, in the order first seen"),
        pytest.param(["GPU 0: x", "GPU 1: x", "GPU 2: x", "GPU 5: x", "no GPU at all"],
                     ["GPUs 0-2, 5: x", "no GPU at all"],
                     id="runs are ranges and a finding of no GPU stays as it is"),
    ],
)  # fmt: skip
def test_doctor_says_a_finding_true_of_several_gpus_once(
    findings: list[str], folded: list[str]
) -> None:
    from kimi_supervisor.cli.render import fold_gpus, fold_health

    assert fold_gpus(findings) == folded
    # status says the health text the daemon made, folded the same way
    assert fold_health("; ".join(findings)) == "; ".join(folded)
    assert fold_health(f"GPU 3: Xid 79; not read: {'; '.join(findings)}") == (
        f"GPU 3: Xid 79; not read: {'; '.join(folded)}"
    )


def test_doctor_wraps_every_line_at_80_columns_with_its_message_hung_under_the_message() -> None:
    from kimi_supervisor.cli.checks import bad, ok
    from kimi_supervisor.cli.doctor import _report
    from kimi_supervisor.cli.output import Output

    out = io.StringIO()
    path = "/var/lib/kimi-supervisor/incidents/incident-20261204T180123.620132Z-stuck.txt"
    results = [
        ok("config", "/etc/kimi-supervisor/kimi-supervisor.toml is valid"),
        bad("daemon", f"STUCK: teardown STUCK: GPU 3 still holds 20000 MiB above its baseline "
            f"after every step; its incident bundle: {path} (root only)",
            "kimi-mode status names what holds the GPUs; a teardown is retried on its own"),
        ok("GPU health", "no failing signal and no warning among those read (not read: GPUs "
           "0-7: page retirement: not supported by this GPU)"),
    ]  # fmt: skip
    assert _report(Output("text", out), results) == 1
    rows = out.getvalue().splitlines()
    assert all(len(r) <= 80 for r in rows if path not in r), rows
    assert any(r.strip() == path or r.rstrip().endswith(path) for r in rows), rows  # whole
    assert rows[-1] == "1 check(s) failed"
    assert words(out.getvalue()) >= {"STUCK:", "(root", "only)", "retried"}


def test_status_watch_folds_a_status_of_wide_names_and_long_paths_to_the_terminals_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An outside review: `status --watch` counted lines, not the rows the terminal wraps a
    long path or wide characters onto: 8 rows more of scrollback at every redraw (80x24)."""
    import argparse
    import re
    from pathlib import Path

    from kimi_supervisor.cli import watch as watch_mod
    from kimi_supervisor.cli.output import Output
    from kimi_supervisor.cli.render import rows_of

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    holders = [f"  GPU {i}: PID {100 + i} {'/srv/' + 'deep-folder/' * 9}train.py" for i in range(8)]
    wide = "\u5b66\u7fd2" * 30
    holders += [f"  GPU {i}: PID {200 + i} {wide}" for i in range(8)]
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setattr(watch_mod, "_columns", lambda: 80)
    monkeypatch.setattr(watch_mod, "_lines", lambda: 15)
    monkeypatch.setattr(watch_mod, "_status", lambda _sock: {"status_line": "serving"})
    monkeypatch.setattr(watch_mod, "format_status", lambda _d, _w: "\n".join(holders))

    def sleep(_s: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(watch_mod.time, "sleep", sleep)
    out = Tty()
    args = argparse.Namespace(interval=1.0)
    assert watch_mod.watch(args, Path("/nonexistent"), Output("text", out, io.StringIO())) == 0
    shown = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", out.getvalue()).split("\n")
    shown = [r for r in shown if r]
    assert rows_of(shown, 80) <= 14, shown
    assert "more rows (a taller terminal shows them" in shown[-1], shown
