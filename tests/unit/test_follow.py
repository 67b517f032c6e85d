"""The one loop that follows the daemon (cli/follow.py), as a switch, `wait` and a capture use
it, against a scripted daemon on a real Unix socket: the lines printed in json mode, a refusal,
a connection closed before the end, and `wait MODE` asking again under one deadline."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.cli import watch
from kimi_supervisor.cli.capture import CaptureFollow
from kimi_supervisor.cli.exits import Exit
from kimi_supervisor.cli.output import Output
from kimi_supervisor.cli.switch import SwitchFollow
from kimi_supervisor.cli.watch import WaitFollow

Lines = list[Any]  # the messages, or bytes sent as they are
TRANSITION = {
    "id": "t-1",
    "previous": "production",
    "target": "profile",
    "started_at": "2026-01-01T12:00:00+00:00",
    "step": "stop_unit",
    "step_changed_at": "2026-01-01T12:00:00+00:00",
    "kind": "switch",
}
# What every status has beside what a test sets (kimi_supervisor/status.py's Status).
STATUS = {
    "state_since": "2026-01-01T12:00:00+00:00",
    "unit": {"name": "vllm.service"},
    "daemon": {"pid": 1, "started_at": "2026-01-01T12:00:00+00:00"},
}


def reply(ok: bool = True, code: str = "accepted", message: str = "", **data: Any) -> dict:
    if "state" in data:  # a status
        data = {**STATUS, **data}
    return {"v": 1, "type": "reply", "ok": ok, "code": code, "message": message, "data": data}


def event(name: str, **data: Any) -> dict:
    return {"v": 1, "type": "event", "event": name, "at": "2026-01-01T12:00:01+00:00", "data": data}


def end(ok: bool, outcome: str, message: str) -> dict:
    return {"v": 1, "type": "end", "ok": ok, "outcome": outcome, "message": message, "data": {}}


@contextmanager
def daemon(*conversations: tuple[Lines, bool]) -> Iterator[tuple[Path, list[dict]]]:
    """A daemon that answers each connection in turn with its lines (bytes: sent as they are),
    then closes it, or holds it open (True) until the test ends; a connection past them is
    never answered. Yields the socket and the requests it was sent."""
    d = Path(tempfile.mkdtemp(prefix="kimi-follow-"))  # short: a socket's path is at most 107
    path = d / "control.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    requests: list[dict] = []
    held: list[socket.socket] = []

    def serve() -> None:
        for lines, hold in conversations:
            try:
                conn, _ = server.accept()
            except OSError:  # closed at the test's end: the conversations left are not had
                return
            requests.append(json.loads(conn.makefile("rb").readline()))
            conn.sendall(b"".join(x if isinstance(x, bytes) else json.dumps(x).encode() + b"\n"
                                  for x in lines))  # fmt: skip
            (held.append if hold else lambda c: c.close())(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield path, requests
    finally:
        for conn in held:
            conn.close()
        server.close()
        shutil.rmtree(d, ignore_errors=True)


def output(fmt: str) -> tuple[Output, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Output(fmt, out, err), out, err


def switch_args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"mode": "profile", "no_wait": False, "timeout": None, **kw})


def test_a_followed_switch_in_json_prints_each_line_as_sent_and_exits_with_its_end() -> None:
    lines = [
        reply(message="switching", transition=TRANSITION),
        event("step_started", step="stop_unit"),
        end(False, "stuck", "the GPUs are not clean"),
    ]
    with daemon((lines, False)) as (sock, requests):
        o, out, err = output("json")
        code = SwitchFollow(switch_args(), sock, o).run({"cmd": "switch", "mode": "profile"})
    assert code == Exit.STUCK
    assert [json.loads(x) for x in out.getvalue().splitlines()] == lines
    assert err.getvalue() == "" and requests[0]["cmd"] == "switch"


def test_a_followed_switch_in_text_says_the_reply_and_ends_with_its_outcome() -> None:
    lines = [reply(message="switching to profile"), end(True, "ready", "profile is ready")]
    with daemon((lines, False)) as (sock, _):
        o, out, _err = output("text")
        code = SwitchFollow(switch_args(), sock, o).run({"cmd": "switch"})
    assert code == Exit.OK
    assert out.getvalue().splitlines() == ["switching to profile", "done: profile is ready"]


def test_a_refused_switch_says_why_on_stderr_and_its_reply_line_is_the_json_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    busy = reply(ok=False, code="busy", message="a switch to production is in progress")
    with daemon(([busy], False)) as (sock, _):
        o, out, _err = output("json")
        code = SwitchFollow(switch_args(), sock, o).run({"cmd": "switch"})
    assert code == Exit.REFUSED
    assert [json.loads(x) for x in out.getvalue().splitlines()] == [busy]
    assert capsys.readouterr().err == "kimi-mode: a switch to production is in progress\n"


def test_a_refused_wait_prints_an_error_line_instead_of_the_reply() -> None:
    denied = reply(ok=False, code="forbidden", message="not in the control group")
    with daemon(([denied], False)) as (sock, _):
        o, out, err = output("json")
        code = WaitFollow(argparse.Namespace(mode=None), sock, o).run({"cmd": "subscribe"})
    assert code == Exit.UNREACHABLE
    (line,) = [json.loads(x) for x in out.getvalue().splitlines()]
    assert line == {
        "v": 1, "type": "error", "exit": 3, "code": "unreachable",
        "message": "not in the control group",
    }  # fmt: skip
    assert err.getvalue() == "kimi-mode: not in the control group\n"


def test_a_connection_closed_before_the_end_exits_unreachable_and_says_what_was_followed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with daemon(([reply(message="switching")], False)) as (sock, _):
        o, _out, err = output("text")
        assert SwitchFollow(switch_args(), sock, o).run({"cmd": "switch"}) == Exit.UNREACHABLE
    assert "closed the connection before the switch ended" in err.getvalue()
    with daemon(([reply(message="capturing")], False)) as (sock, _):
        o, _out, _err = output("text")
        assert CaptureFollow(o, sock).run({"cmd": "capture"}) == Exit.UNREACHABLE
    said = capsys.readouterr()
    assert said.out == "capturing\n"
    assert said.err == "kimi-mode: the daemon closed the connection before the capture ended\n"


def test_wait_for_a_mode_asks_again_after_an_end_and_its_timeout_spans_both_asks() -> None:
    tearing_down = reply(
        code="status", state="tearing_down", mode=None, desired_mode="production",
        transition={**TRANSITION, "target": "production"}, status_line="tearing down",
    )  # fmt: skip
    starting = reply(
        code="status", state="starting", mode=None, desired_mode="production",
        transition=None, status_line="starting production",
    )  # fmt: skip
    with daemon(
        ([tearing_down, end(False, "failed", "rolled back")], False), ([starting], True),
        ([starting], False),
    ) as (sock, requests):  # fmt: skip
        o, out, err = output("text")
        began = time.monotonic()
        code = WaitFollow(argparse.Namespace(mode="production"), sock, o).run(
            {"cmd": "subscribe"}, timeout_s=0.5
        )
        took = time.monotonic() - began
    assert code == Exit.TIMEOUT
    assert 0.5 <= took < 3.0
    # The second subscription's end, then one more before the deadline: the status it names.
    assert [r["cmd"] for r in requests] == ["subscribe", "subscribe", "subscribe"]
    assert "following t-1: production -> production" in out.getvalue()
    assert "FAILED: rolled back" in out.getvalue()
    last = out.getvalue().splitlines()[-1]
    assert last == "timed out: production does not serve after 0.5 s: starting production"
    assert err.getvalue() == ""


def test_wait_for_a_mode_returns_in_50_of_50_switches_whatever_order_end_and_status_come() -> None:
    """Before, the end of a switch came before the status that no longer shows it; asked
    again, the daemon answered the old status, and `wait MODE` waited forever. Here each switch
    reaches the real client in one order: the status first (serving already), or the end first
    and then 0 to 2 answers that still show the ended transition, each held open as a
    subscription that never says more, before the new status."""
    import random

    rng = random.Random(44)
    took = []
    for i in range(50):
        target = ("profile", "production")[i % 2]
        tr = {**TRANSITION, "id": f"t-{i}", "target": target}
        loading = reply(code="subscribed", state="starting", mode=None, desired_mode=target,
                        transition=tr, status_line=f"starting {target}")  # fmt: skip
        serving = reply(code="subscribed", state="serving", mode=target, desired_mode=target,
                        transition=None, status_line=f"serving {target}")  # fmt: skip
        ready = {**end(True, "ready", f"{target} is ready"), "data": {"transition": tr["id"]}}
        stale = rng.choice([None, 0, 1, 2])  # None: the status comes first
        if stale is None:
            talks = [([serving], True)]
        else:
            talks = [([loading, event("progress", text="loading"), ready], False)]
            talks += [([loading], True)] * stale + [([serving], True)]
        with daemon(*talks) as (sock, requests):
            o, out, _err = output(rng.choice(["text", "json"]))
            began = time.monotonic()
            code = WaitFollow(argparse.Namespace(mode=target), sock, o).run(
                {"cmd": "subscribe"},
                timeout_s=60,  # returns at the verdict: 60 s never passes
            )
            took.append(time.monotonic() - began)
        assert code == Exit.OK, (i, stale, out.getvalue())
        assert len(requests) == len(talks)
        if o.json:  # only JSON lines: the status that serves, then the verdict
            lines = [json.loads(x) for x in out.getvalue().splitlines()]
            assert lines[-2]["type"] == "status" and lines[-2]["mode"] == target, lines
            assert lines[-1] == {"v": 1, "type": "verdict", "mode": target, "ok": True,
                                 "verdict": "serving", "exit": 0,
                                 "message": f"{target} serves"}, lines  # fmt: skip
    assert max(took) < 1.0, took


def test_a_capture_by_switching_says_before_it_begins_that_it_costs_two_restarts() -> None:
    from kimi_supervisor.cli.capture import plan_line

    assert plan_line({"window_s": 95.0, "target": "production"}) == (
        "this capture stops serving for about 3m 10s: two restarts, a switch to profile mode "
        "and one back (the last switch here took 1m 35s)"
    )
    assert "none measured on this host yet" in plan_line(None)
    assert "none measured on this host yet" in plan_line({"window_s": None})


# ------------------------------------------------------------------------------ wait MODE
def status(state: str, mode: str | None, desired: str, tr: dict | None = None, **more: Any) -> dict:
    return reply(code="subscribed", state=state, mode=mode, desired_mode=desired, transition=tr,
                 status_line=f"{state} {mode or ''}".strip(), **more)  # fmt: skip


TO_PROFILE = {**TRANSITION, "id": "t-2", "target": "profile"}
BACK = {**TRANSITION, "id": "t-3", "target": "production", "previous": "profile"}
RETRY = {**TRANSITION, "id": "t-4", "target": "profile", "previous": None}
FAILURE = {"mode": "profile", "at": "2026-01-01T12:00:00+00:00", "reason": "vLLM exited 1"}
ROLLED_BACK = {
    "mode": "profile",
    "at": "2026-01-01T12:00:09+00:00",
    "transition": "t-2",
    "reason": "profile did not become ready (vLLM exited 1); rolling back to production",
}


FULL = reply(ok=False, code="too_many_clients", message="control.max_clients connections are open")


def ended(tr: dict, ok: bool, outcome: str, message: str) -> dict:
    return {**end(ok, outcome, message), "data": {"transition": tr["id"]}}


def started(tr: dict) -> dict:
    return event("transition_started", id=tr["id"], target=tr["target"],
                 previous=tr["previous"], kind="switch", reason="asked")  # fmt: skip


@pytest.mark.parametrize(
    ("talks", "code", "verdict", "said"),
    [
        pytest.param(
            [([status("tearing_down", None, "profile", TO_PROFILE),
               ended(TO_PROFILE, True, "ready", "profile is ready")], False),
             ([status("serving", "profile", "profile")], True)],
            Exit.OK, "serving", "profile serves",
            id="profile reached: 0, and its verdict is the last line",
        ),
        pytest.param(
            [([status("starting", None, "profile", TO_PROFILE),
               ended(TO_PROFILE, False, "rolled_back", "vLLM exited 1; rolling back"),
               started(BACK)], False),
             ([status("tearing_down", None, "production", BACK),
               ended(BACK, True, "ready", "production is ready")], False),
             ([status("serving", "production", "production")], True)],
            Exit.FAILED, "rolled_back",
            "the switch to profile failed: vLLM exited 1; rolling back; now: serving production",
            id="profile failed and rolled back: 1, not the rollback's done",
        ),
        pytest.param(
            [([status("tearing_down", None, "production", BACK, last_failure=FAILURE),
               ended(BACK, True, "ready", "production is ready")], False),
             ([status("serving", "production", "production")], True)],
            Exit.FAILED, "rolled_back",
            "the switch to profile failed: vLLM exited 1; now: serving production",
            id="joined while profile rolls back: 1, the failure it rolls back named",
        ),
        pytest.param(
            [([status("serving", "production", "production", rolled_back=ROLLED_BACK)], True)],
            Exit.FAILED, "rolled_back",
            "the switch to profile failed: profile did not become ready (vLLM exited 1); "
            "rolling back to production; now: serving production",
            id="joined after the rollback: 1 at once, from the status, nobody asked since",
        ),
        pytest.param(
            [([status("tearing_down", None, "profile", TO_PROFILE),
               ended(TO_PROFILE, False, "stuck", "teardown STUCK: retrying in 1 s")], False),
             ([status("stuck", None, "profile"), started(RETRY),
               ended(RETRY, True, "ready", "profile is ready")], False),
             ([status("serving", "profile", "profile")], True)],
            Exit.OK, "serving", "profile serves (after 1 STUCK teardown(s), retried until clean)",
            id="a STUCK retried then cleared: waited through, 0",
        ),
        pytest.param(
            [([status("serving", "production", "production")], True),
             ([status("serving", "production", "production")], False)],
            Exit.TIMEOUT, "not_asked",
            "profile does not serve after 0.5 s: nobody asked for profile; now: serving production",
            id="nobody asked for profile before the timeout: 4, and it says so",
        ),
        pytest.param(
            [([status("stuck", None, "profile")], True),
             ([status("stuck", None, "profile")], False)],
            Exit.STUCK, "stuck",
            "profile does not serve after 0.5 s: the GPUs are STUCK (0 teardown(s) heard): stuck",
            id="still STUCK at the timeout: 6",
        ),
        pytest.param(
            [([status("failed", None, "profile")], True)],
            Exit.FAILED, "failed", "profile does not serve, and the daemon gave up: failed",
            id="FAILED: 1 at once, the daemon waits for a person",
        ),
        pytest.param(
            [([status("tearing_down", None, "profile", TO_PROFILE),
               ended(TO_PROFILE, False, "preempted", "preempted by a switch to production"),
               started(BACK)], False),
             ([status("tearing_down", None, "production", BACK),
               ended(BACK, True, "ready", "production is ready")], False),
             ([status("serving", "production", "production")], True),
             ([status("serving", "production", "production")], False)],
            Exit.TIMEOUT, "not_asked",
            "profile does not serve after 0.5 s: nobody asked for profile; now: serving production",
            id="someone else's switch preempted it: waited on to the timeout",
        ),
        pytest.param(
            [([status("starting", None, "profile", TO_PROFILE)], False),  # gone: a restart
             ([status("serving", "profile", "profile")], True)],
            Exit.OK, "serving", "profile serves",
            id="a daemon that restarts mid-switch is asked again: 0",
        ),
        pytest.param(
            [([status("starting", None, "profile", TO_PROFILE)], False),
             ([FULL], False), ([FULL], False),  # other clients hold every slot for a while
             ([status("serving", "profile", "profile")], True)],
            Exit.OK, "serving", "profile serves",
            id="asked again while the daemon's client list is full: waited through, 0",
        ),
        pytest.param(
            [([status("starting", None, "profile", TO_PROFILE)], False),
             *[([FULL], False)] * 400],
            Exit.UNREACHABLE, "unreachable",
            "no answer from the daemon for 0.2 s while waiting for profile (the daemon refused "
            "to answer again (control.max_clients connections are open)); the switch may go on; "
            "last known: starting",
            id="refused for longer than a restart takes: 3, a verdict with the last status",
        ),
        pytest.param(
            [([status("starting", None, "profile", TO_PROFILE)], False),
             *[([], False)] * 400],  # each connection closed unanswered: a daemon going down
            Exit.UNREACHABLE, "unreachable",
            "no answer from the daemon for 0.2 s while waiting for profile (the daemon closed "
            "the connection); the switch may go on; last known: starting",
            id="a daemon gone for longer than a restart takes: 3, a verdict with the last status",
        ),
    ],
)  # fmt: skip
def test_wait_for_a_mode_ends_with_one_verdict_about_it_and_the_exit_to_match(
    talks: list[tuple[Lines, bool]],
    code: Exit,
    verdict: str,
    said: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A daemon gone or refusing is asked again for this long (60 s shipped), every 10 ms.
    monkeypatch.setattr(watch, "RECONNECT_S", 0.2)
    monkeypatch.setattr(watch, "RECONNECT_PAUSE_S", 0.01)
    for fmt in ("json", "text"):
        with daemon(*talks) as (sock, _requests):
            o, out, err = output(fmt)
            # A row that ends in its verdict gets a deadline a loaded host cannot miss (it
            # returns the moment the verdict is in); one whose verdict is the deadline, 0.5 s.
            wait_s = 0.5 if code in (Exit.TIMEOUT, Exit.STUCK) else 60.0
            got = WaitFollow(argparse.Namespace(mode="profile"), sock, o).run(
                {"cmd": "subscribe"}, timeout_s=wait_s
            )
        assert got == code, (fmt, out.getvalue())
        last = out.getvalue().splitlines()[-1]
        if fmt == "json":
            assert json.loads(last) == {"v": 1, "type": "verdict", "mode": "profile",
                                        "ok": code == Exit.OK, "verdict": verdict, "exit": code,
                                        "message": said}, last  # fmt: skip
        else:
            head = {Exit.OK: "done", Exit.TIMEOUT: "timed out"}.get(code, code.label.upper())
            assert " ".join(out.getvalue().split()).endswith(f"{head}: {said}"), out.getvalue()
        json_failed = fmt == "json" and code != Exit.OK  # said on stderr too, as an error is
        assert err.getvalue() == (f"kimi-mode: {said}\n" if json_failed else ""), err.getvalue()


# ------------------------------------------------------------------------------ not understood
OLD_STATUS = {"v": 1, "type": "reply", "ok": True, "code": "status", "message": "",
              "data": {"state": "serving", "mode": "production"}}  # fmt: skip
BOTH = ("json", "text")


@pytest.mark.parametrize(
    ("argv", "lines", "said", "fmts"),
    [
        pytest.param(["status"], [b"not json at all\n"], "(not JSON: Expecting value", BOTH,
                     id="a line that is not JSON"),
        pytest.param(["history"], [{"v": 1, "type": "reply", "code": "history", "data": {}}],
                     "(a reply without `ok`)", BOTH, id="a reply without ok"),
        pytest.param(["wait"], [[1, 2]], "(a message of type 'list')", BOTH,
                     id="a message that is no object"),
        pytest.param(["status"], [OLD_STATUS], "(its status: daemon, desired_mode, state_since, "
                     "status_line, unit missing or of another kind)", BOTH,
                     id="an older daemon's status, to status"),
        pytest.param(["wait", "profile"], [OLD_STATUS], "(its status: daemon, desired_mode, ",
                     BOTH, id="an older daemon's status, to wait MODE"),
        pytest.param(["is-serving"], [OLD_STATUS], "(its status: ", BOTH,
                     id="an older daemon's status, to is-serving"),
        pytest.param(["history"], [reply(code="history", records=[])],
                     "(its history: KeyError: 'entries')", BOTH, id="a history without entries"),
        pytest.param(["history"], [reply(code="history", entries=[{"at": "x"}])],
                     "(its history: KeyError: 'kind')", BOTH, id="a record without a kind"),
        pytest.param(["profile"], [reply(message="switching"), event("step_finished")],
                     "(its step_finished: KeyError: 'duration_s')",
                     ("text",),  # json mode passes the daemon's events on as they are
                     id="an event of another shape while a switch is followed"),
        pytest.param(["status"], [reply(code="status", pad="x" * 4096)],
                     "(an answer line of more than 1024 bytes)", BOTH,
                     id="a line past the bound"),
    ],
)  # fmt: skip
def test_an_answer_kimi_mode_cannot_read_is_one_line_saying_so_and_what_to_do_exit_3(
    argv: list[str], lines: Lines, said: str, fmts: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Before, a daemon of another version (or anything else on the socket) gave a Python
    traceback and exit 1."""
    from kimi_supervisor.cli import kimi_mode
    from kimi_supervisor.control import client

    monkeypatch.setattr(client, "MAX_ANSWER_BYTES", 1024)
    for fmt in fmts:
        with daemon((lines, False)) as (sock, _):
            rc = kimi_mode.main(["-o", fmt, "--socket", str(sock), *argv])
        out, err = capsys.readouterr()
        assert rc == Exit.UNREACHABLE, (fmt, out, err)
        (line,) = err.splitlines()  # one line, no traceback
        assert line.startswith("kimi-mode: the daemon's answer was not understood " + said), line
        assert "After an upgrade restart it (`systemctl restart kimi-supervisor`)" in line
        if fmt == "json":
            (error,) = [json.loads(x) for x in out.splitlines()]  # JSON only on stdout
            assert (error["type"], error["exit"], error["code"]) == ("error", 3, "unreachable")
            assert f"kimi-mode: {error['message']}" == line
        else:
            assert out == ("switching\n" if argv == ["profile"] else ""), out


@pytest.mark.parametrize(
    "conversations",
    [
        pytest.param([([status("tearing_down", "production", "profile", TO_PROFILE),
                        b"not json\n"], False)],
                     id="a line that is not JSON after a good reply"),
        pytest.param([([status("tearing_down", "production", "profile", TO_PROFILE)], False),
                      ([b"<html>upgraded</html>\n"], False)],
                     id="a daemon restarted into another version"),
    ],
)  # fmt: skip
def test_an_unreadable_answer_after_a_good_one_ends_a_wait_at_once_exit_3_in_one_line(
    conversations: list[tuple[Lines, bool]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An outside review: after one good reply, an answer kimi-mode cannot read was taken for a
    daemon's restart and asked again, for ever without --timeout (159 connections in 40 s), or
    ended at --timeout as 4 `timeout`; asking again reads the same."""
    from kimi_supervisor.cli import kimi_mode

    for fmt in ("text", "json"):
        with daemon(*conversations) as (sock, requests):
            argv = ["-o", fmt, "--socket", str(sock), "wait", "profile", "--timeout", "30"]
            rc = kimi_mode.main(argv)  # (the timeout: a regression ends, as 4)
        out, err = capsys.readouterr()
        assert rc == Exit.UNREACHABLE, (fmt, out, err)
        (line,) = err.splitlines()
        assert line.startswith("kimi-mode: the daemon's answer was not understood"), line
        assert len(requests) == len(conversations), requests  # never asked again after it
        if fmt == "json":
            last = json.loads(out.splitlines()[-1])
            assert (last["type"], last["exit"]) == ("error", 3), last


def test_a_wait_whose_output_is_closed_never_exits_as_done() -> None:
    """An outside review: `kimi-mode wait profile | head -c1` exited 0 ("profile serves")
    while the switch went on: a closed pipe ended it as done. Now 141, as a shell reports a
    writer whose reader left."""
    lines = [status("tearing_down", "production", "profile", TO_PROFILE),
             event("step_started", step="stop_unit")]  # fmt: skip
    read, write = os.pipe()
    os.close(read)  # the reader left before kimi-mode wrote
    try:
        with daemon((lines, True)) as (sock, _):
            r = subprocess.run(
                [sys.executable, "-m", "kimi_supervisor.cli.kimi_mode", "--socket", str(sock),
                 "-o", "json", "wait", "profile", "--timeout", "60"],
                stdout=write, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=120,
            )  # fmt: skip
    finally:
        os.close(write)
    assert r.returncode == Exit.OUTPUT_CLOSED == 141, (r.returncode, r.stderr)
    assert b"Traceback" not in r.stderr and b"Exception ignored" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------ the deadline
def test_wait_for_a_mode_reads_nothing_past_its_timeout_however_slow_the_daemon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, at --timeout it asked for the status once more, for up to 2 s: a script's
    `--timeout 120` returned at 122 s. Now every read is bounded by what is left, and the
    status the verdict names was asked for before the deadline (here, never answered)."""
    from kimi_supervisor.cli import follow

    real, reads = follow.exchange, []

    def exchange(*args: Any, **kw: Any) -> Iterator[tuple[bytes, dict]]:
        reads.append((time.monotonic(), kw["timeout_s"]))
        return real(*args, **kw)

    monkeypatch.setattr(follow, "exchange", exchange)
    with daemon(([status("serving", "production", "production")], True)) as (sock, requests):
        o, out, _err = output("json")
        w = WaitFollow(argparse.Namespace(mode="profile"), sock, o)
        code = w.run({"cmd": "subscribe"}, timeout_s=1.0)
    assert code == Exit.TIMEOUT
    assert json.loads(out.getvalue().splitlines()[-1])["verdict"] == "not_asked"
    assert len(reads) == 2 and len(requests) == 1  # the second subscription: no answer
    assert w.deadline is not None
    # (each read measured from a moment just after the loop's own: a hair later)
    assert all(at + limit <= w.deadline + 0.01 for at, limit in reads), (reads, w.deadline)


# ------------------------------------------------------------------------------ Ctrl-C
def ctrl_c_in(monkeypatch: pytest.MonkeyPatch, call: int, after: int) -> None:
    """Ctrl-C in the `call`-th exchange with the daemon, once `after` of its lines were read
    (0: before any)."""
    from kimi_supervisor.cli import follow

    real, calls = follow.exchange, iter(range(1, 100))

    def exchange(*args: Any, **kw: Any) -> Iterator[tuple[bytes, dict]]:
        n = next(calls)
        if n == call and after == 0:
            raise KeyboardInterrupt
        for i, line in enumerate(real(*args, **kw), 1):
            yield line
            if n == call and i == after:
                raise KeyboardInterrupt
        raise AssertionError("the daemon closed a conversation the test holds open")

    monkeypatch.setattr(follow, "exchange", exchange)


@pytest.mark.parametrize(
    ("argv", "talks", "call", "after", "said"),
    [
        pytest.param(["wait", "profile"],
                     [([status("starting", None, "profile", TO_PROFILE)], True)], 1, 1,
                     "stopped waiting for profile; last known: starting",
                     id="wait MODE: its verdict, interrupted, with the status last known"),
        pytest.param(["wait", "profile", "--timeout", "0.4"],
                     [([status("serving", "production", "production")], True)], 2, 0,
                     "stopped waiting for profile; last known: serving production",
                     id="wait MODE asking again before its timeout: the same"),
        pytest.param(["wait", "profile"], [([], True)], 1, 0,
                     "stopped waiting for profile; last known: no status yet",
                     id="wait MODE before any answer: no status yet, said"),
        pytest.param(["wait"], [([status("starting", None, "profile", TO_PROFILE)], True)], 1, 1,
                     "stopped waiting; last known: starting",
                     id="wait: the status last known"),
        pytest.param(["profile"], [([reply(message="switching", transition=TO_PROFILE),
                                     event("step_started", step="kill_strays")], True)], 1, 2,
                     "stopped following; the switch to profile goes on (`kimi-mode wait` "
                     "follows it again; `kimi-mode status` shows where it is)",
                     id="a followed switch: what the display showed last"),
    ],
)  # fmt: skip
def test_ctrl_c_anywhere_in_a_wait_or_a_switch_says_what_it_knew_last_and_exits_130(
    argv: list[str], talks: list[tuple[Lines, bool]], call: int, after: int, said: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Before, a Ctrl-C in the status read after --timeout printed nothing at all."""
    from kimi_supervisor.cli import kimi_mode

    for fmt in ("json", "text"):
        ctrl_c_in(monkeypatch, call, after)
        with daemon(*talks) as (sock, _):
            rc = kimi_mode.main(["-o", fmt, "--socket", str(sock), *argv])
        out, err = capsys.readouterr()
        assert rc == Exit.INTERRUPTED, (fmt, out, err)
        last = out.splitlines()[-1] if out else ""
        if "profile" in argv[:2] and argv[0] == "wait":  # the verdict, as its last line
            if fmt == "json":
                verdict = json.loads(last)
                assert (verdict["type"], verdict["verdict"], verdict["exit"]) == (
                    "verdict", "interrupted", 130)  # fmt: skip
                assert verdict["message"].startswith(said), verdict
            else:
                assert " ".join(out.split()).endswith(f"INTERRUPTED: {said}"), out
        else:
            assert f"kimi-mode: {said}" in err, err
            if argv == ["profile"] and fmt == "text":  # the display's own last words
                assert re.search(r"; last seen: switching to profile \(.+\): teardown "
                                 r"kill_strays$", err.strip()), err  # fmt: skip
            if fmt == "json":
                assert json.loads(last)["type"] == "error" and json.loads(last)["exit"] == 130


def test_a_daemon_that_takes_the_connection_and_says_nothing_ends_a_wait_with_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside review: `kimi-mode wait` without --timeout waited for ever on a daemon that
    accepted the connection and never answered (a wedged daemon); its first answer is bounded."""
    from kimi_supervisor.cli import kimi_mode
    from kimi_supervisor.control import client

    monkeypatch.setattr(client, "FIRST_ANSWER_S", 0.5)
    with daemon(([], True)) as (sock, requests):
        rc = kimi_mode.main(["--socket", str(sock), "wait"])
    _out, err = capsys.readouterr()
    assert rc == Exit.UNREACHABLE, err
    assert "the daemon took the connection but answered nothing in 0.5 s" in err, err
    assert len(requests) == 1, requests
