"""The daemon's log lines, in the form each reader wants: the journal gets syslog priorities,
a terminal a readable line, a file or a pipe plain JSON."""

from __future__ import annotations

import json
import os
import pty
import tempfile

from kimi_supervisor import log


def lines_written(env: dict[str, str] | None, journal: bool = False) -> list[str]:
    with tempfile.TemporaryFile("w+") as f:
        if journal:
            st = os.fstat(f.fileno())
            env = {**(env or {}), "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        log.configure(stream=f, env=env or {})
        logger = log.get()
        logger.info("vllm_progress", phase="loading", percent=50)
        logger.warning("vllm_main_exited", main_pid=42)
        logger.error("stuck", message="GPU 0: 5615 MiB used")
        f.seek(0)
        return f.read().splitlines()


def test_under_systemd_each_line_carries_its_syslog_priority_before_the_json() -> None:
    lines = lines_written({}, journal=True)
    assert [x[:3] for x in lines] == ["<6>", "<4>", "<3>"]
    warning = json.loads(lines[1][3:])
    assert warning["event"] == "vllm_main_exited" and warning["main_pid"] == 42


def test_a_file_that_is_not_the_journal_gets_plain_json_lines() -> None:
    # A JOURNAL_STREAM inherited from a parent names another stream: no prefixes here.
    lines = lines_written({"JOURNAL_STREAM": "1:2"})
    assert [json.loads(x)["level"] for x in lines] == ["info", "warning", "error"]


def test_a_terminal_gets_a_readable_line_without_colour_when_no_color_is_set() -> None:
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            log.configure(stream=tty, env={"NO_COLOR": "1", "TERM": "xterm"})
            log.get().warning("vllm_main_exited", main_pid=42)
            tty.flush()
        out = os.read(leader, 4096).decode()
    finally:
        os.close(leader)
        os.close(follower)
        log.configure()
    assert "vllm_main_exited" in out and "main_pid=42" in out and "[warning" in out
    assert "\x1b[" not in out and not out.lstrip().startswith("{")
