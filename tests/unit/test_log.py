"""The daemon's log lines, in the form each reader wants: the journal gets syslog priorities,
a terminal a readable line, a file or a pipe plain JSON."""

from __future__ import annotations

import json
import os
import pty
import tempfile

from kimi_supervisor import log


def lines_written(env: dict[str, str] | None) -> list[str]:
    with tempfile.TemporaryFile("w+") as f:
        log.configure(stream=f, env=env or {})
        logger = log.get()
        logger.info("vllm_progress", phase="loading", percent=50)
        logger.warning("vllm_main_exited", main_pid=42)
        logger.error("stuck", message="GPU 0: 5615 MiB used")
        f.seek(0)
        return f.read().splitlines()


def journal_entries() -> list[dict[str, str]]:
    """What the daemon sends the journal when its stdout is the unit's journal stream."""
    sent: list[dict[str, str]] = []
    with tempfile.TemporaryFile("w+") as f:
        st = os.fstat(f.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        log.configure(stream=f, env=env, send=lambda fields: sent.append(dict(fields)))
        logger = log.get()
        logger.info("state_changed", previous="booting", state="serving", why="ready")
        logger.warning("vllm_main_exited", main_pid=42)
        logger.error("stuck", message="GPU 0: 5615 MiB used", transition="t-1", mode="profile")
        logger.info("kill", process={"pid": 4242, "comm": "python"}, signal="SIGKILL",
                    step="kill_strays", evidence="vllm_signature")  # fmt: skip
        f.seek(0)
        assert f.read() == ""  # nothing on the stream: the entries went by the native protocol
    log.configure()
    return sent


def test_under_systemd_each_event_is_a_journal_entry_with_its_priority_and_fields() -> None:
    state, exited, stuck, kill = journal_entries()
    assert [e["PRIORITY"] for e in (state, exited, stuck, kill)] == ["6", "4", "3", "6"]
    assert {e["SYSLOG_IDENTIFIER"] for e in (state, exited, stuck, kill)} == {"kimi-supervisor"}
    # `journalctl KIMI_EVENT=stuck`, KIMI_TRANSITION=..., KIMI_MODE=..., KIMI_STATE=...
    assert stuck["KIMI_EVENT"] == "stuck" and stuck["KIMI_TRANSITION"] == "t-1"
    assert stuck["KIMI_MODE"] == "profile" and state["KIMI_STATE"] == "serving"
    assert exited["KIMI_PID"] == "42" and kill["KIMI_PID"] == "4242"
    assert kill["KIMI_EVIDENCE"] == "vllm_signature"


def test_a_journal_message_is_readable_without_braces() -> None:
    state, exited, stuck, kill = journal_entries()
    assert stuck["MESSAGE"] == "stuck: GPU 0: 5615 MiB used"
    assert state["MESSAGE"] == "state_changed previous=booting state=serving why=ready"
    assert kill["MESSAGE"].startswith("kill PID 4242 (python) signal=SIGKILL step=kill_strays")
    assert not any("{" in e["MESSAGE"] for e in (state, exited, stuck, kill))


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
