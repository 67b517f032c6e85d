"""sd_notify through libsystemd (pystemd.daemon.notify): what the service manager receives, at
a path and at an abstract socket, and nothing without $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kimi_supervisor.ports.notify import Notifier


def listen(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(60)
    return s


def test_the_manager_receives_ready_status_and_the_main_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with listen(str(tmp_path / "notify")) as s:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
        n = Notifier()
        n.ready("production: serving (vLLM PID 42)")
        assert s.recv(4096).decode().split("\n") == [
            "READY=1", "STATUS=production: serving (vLLM PID 42)", f"MAINPID={os.getpid()}"
        ]  # fmt: skip
        n.extend_timeout(2.5)
        assert s.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000"
    assert os.environ["NOTIFY_SOCKET"]  # left for the re-executed daemon


def test_an_abstract_notify_socket_is_reached_too(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"kimi-notify-test-{os.getpid()}"
    with listen("\0" + name) as s:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        Notifier().status("switching to profile: teardown")
        assert s.recv(4096) == b"STATUS=switching to profile: teardown"


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    n.ready("x")  # no error, no socket
