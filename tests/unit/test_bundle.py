"""The incident bundle (store/bundle.py, loop/bundles.py): what goes in, its caps, where and how
it is written, what pruning keeps, and that no failure of it changes what the daemon does."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.cli.render import format_status
from kimi_supervisor.loop.inbox import BundleDone, Switch
from kimi_supervisor.model import Mode, State
from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.store import bundle
from kimi_supervisor.store.bundle import Bundle, Holder
from kimi_supervisor.store.state import StateError, older_than_newest

from .loophost import LoopHost
from .test_loop import booted


def a_bundle(state_dir: Path, stamp: str = "20260101T000000.000000Z", **kw: object) -> Bundle:
    base: dict[str, object] = dict(
        trigger="stuck", at="2026-01-01T00:00:00+00:00", stamp=stamp, reason="a test",
        unit="vllm-kimi-k25.service", state_dir=state_dir, keep=3,
    )  # fmt: skip
    return Bundle(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture
def mapper(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process that maps a file named like a device file (dev/nvidia0), and waits."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_bytes(b"\0" * 4096)
    code = (
        "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 4096); "
        "print('ready', flush=True); sys.stdin.read()"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(dev / "nvidia0")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    yield p
    p.kill()
    p.wait()


def test_each_part_stays_under_its_cap_the_file_under_its_own_and_every_cut_is_said(
    tmp_path: Path,
) -> None:
    huge = "\n".join(f"line {n} " + "x" * 100 for n in range(100_000))  # about 10 MiB
    parts = {k: huge for k in bundle.PART_CAPS}
    data = bundle.render(a_bundle(tmp_path), parts)
    assert len(data) <= bundle.MAX_BYTES
    text = data.decode()
    assert set(bundle.cut_parts(data)) == set(bundle.PART_CAPS)
    assert text.count("[cut: the") == len(bundle.PART_CAPS)
    # A log keeps its newest lines, a report its head; the file says where it ends.
    assert "line 99999 " in text and "line 0 " in text
    assert text.endswith("== end of the bundle ==\n")
    for part in text.split("\n== ")[1:]:
        assert len(part.encode()) <= max(bundle.PART_CAPS.values()) + 200
    small = bundle.render(a_bundle(tmp_path), {"report": "{}"})
    assert bundle.cut_parts(small) == () and b"[cut:" not in small


def test_pruning_keeps_the_newest_by_the_time_in_their_names_and_always_the_one_just_written(
    tmp_path: Path,
) -> None:
    names = [f"incident-2026010{d}T000000.000000Z-stuck.txt" for d in range(1, 8)]
    # The newest three; the one just written is kept even when a clock stepped back named it
    # the oldest, and then only two others.
    assert older_than_newest(names, names[-1], 3) == names[:4][::-1]
    assert set(older_than_newest(names, names[0], 3)) == set(names[1:5])
    for n in range(6):
        bundle.write(
            tmp_path, a_bundle(tmp_path, f"2026010{n + 1}T000000.000000Z").name, b"x", keep=3
        )
    kept = sorted(os.listdir(tmp_path / bundle.DIR))
    assert kept == [f"incident-2026010{d}T000000.000000Z-stuck.txt" for d in (4, 5, 6)]


def test_after_the_clock_steps_back_the_bundles_written_since_are_the_ones_kept(
    tmp_path: Path,
) -> None:
    # Three bundles stamped in December, then the clock steps back to January: each new one
    # used to remove the one written just before it, and keep the December ones.
    for h in (0, 1, 2):
        bundle.write(
            tmp_path, a_bundle(tmp_path, f"2026120{h + 1}T000000.000000Z").name, b"x", keep=3
        )
    written: list[str] = []
    for h in (1, 2, 3):
        name = a_bundle(tmp_path, f"2026010{h}T000000.000000Z").name
        bundle.write(tmp_path, name, b"x", keep=3, recent=tuple(written))
        written.append(name)
    assert sorted(os.listdir(tmp_path / bundle.DIR)) == sorted(written)


def test_a_holders_escape_codes_reach_the_file_escaped_never_as_control_characters(
    tmp_path: Path,
) -> None:
    """A process names itself (its comm, a cgroup, a mapped file's name) as it likes; an
    operator who runs `cat` on the bundle gets no escape sequence from it."""
    evil = "\x1b]0;PWNED\x07\x1b[2J\x9b31m\r"
    data = bundle.render(a_bundle(tmp_path), {"holders": f"-- PID 1: Name:\t{evil}\nnext line"})
    text = data.decode()
    assert "\\x1b]0;PWNED\\x07\\x1b[2J\\x9b31m\\x0d" in text
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text)
    assert "Name:\t" in text and "\nnext line" in text  # tabs and newlines stay


def test_only_a_regular_file_of_roots_is_named_as_the_newest_bundle(tmp_path: Path) -> None:
    path, _ = bundle.write(tmp_path, a_bundle(tmp_path).name, b"evidence", keep=3)
    os.mkfifo(tmp_path / bundle.DIR / a_bundle(tmp_path, "20991231T000000.000000Z").name, 0o600)
    assert bundle.newest(tmp_path) == (str(path), 8)  # a FIFO would block a `cat`


def test_a_bundle_is_root_only_and_never_written_through_a_link_planted_for_its_folder(
    tmp_path: Path,
) -> None:
    path, _ = bundle.write(tmp_path, a_bundle(tmp_path).name, b"evidence", keep=3)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / bundle.DIR).st_mode) == 0o700
    assert bundle.newest(tmp_path) == (str(path), 8)
    # A link where the folder should be (a path swapped between check and use): refused,
    # and the place it points to gets nothing.
    other = tmp_path / "other"
    other.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (other / bundle.DIR).symlink_to(elsewhere)
    with pytest.raises(StateError, match="is a symlink"):
        bundle.write(other, a_bundle(other).name, b"evidence", keep=3)
    assert os.listdir(elsewhere) == []
    # A folder others may write is refused too; a folder others may only read is made root's.
    loose = tmp_path / "loose"
    (loose / bundle.DIR).mkdir(parents=True)
    os.chmod(loose / bundle.DIR, 0o777)
    with pytest.raises(StateError, match="writable by its group or by others"):
        bundle.write(loose, a_bundle(loose).name, b"evidence", keep=3)
    os.chmod(loose / bundle.DIR, 0o755)
    bundle.write(loose, a_bundle(loose).name, b"evidence", keep=3)
    assert stat.S_IMODE(os.stat(loose / bundle.DIR).st_mode) == 0o700


def test_a_holder_is_read_with_its_device_maps_and_one_gone_or_recycled_is_said_so(
    tmp_path: Path, mapper: subprocess.Popen[bytes]
) -> None:
    ref = processes.ref_of(mapper.pid)
    assert ref is not None
    start = processes.start_time_epoch(ref)
    text = bundle.holder_part(Holder(mapper.pid, start, "suspect: protected"))
    assert f"-- PID {mapper.pid}: suspect: protected" in text
    assert "status:\n  Name:" in text and re.search(r"cgroup:\n  \d+:", text)
    assert "maps of device files (1 lines):" in text and "/dev/nvidia0" in text
    recycled = bundle.holder_part(Holder(mapper.pid, start - 1, "suspect"))
    assert "now names another process" in recycled and "maps" not in recycled
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert "gone: exited before it was read" in bundle.holder_part(Holder(dead.pid, None, "x"))
    # A maps file larger than what is read, and more device lines than are kept: both said.
    lines, dropped, rest = openfiles.device_maps_lines(mapper.pid, 200, 10) or ([], 0, 0)
    assert rest > 0
    lines, dropped, rest = openfiles.device_maps_lines(mapper.pid, 1 << 24, 10) or ([], 0, 0)
    assert lines == [] and dropped > 0 and rest == 0


def test_a_proc_read_that_never_answers_is_said_and_the_bundle_is_written_all_the_same(
    tmp_path: Path, mapper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = bundle._read_head

    def hangs(path: str, cap: int) -> bytes:
        if path.endswith("/status"):
            release.wait(30)  # a read stuck in the kernel
        return real(path, cap)

    monkeypatch.setattr(bundle, "_read_head", hangs)
    monkeypatch.setattr(bundle, "PROC_READ_S", 0.3)
    monkeypatch.setattr(bundle, "_proc", None)
    try:
        began = time.monotonic()
        made = bundle.make(
            a_bundle(tmp_path, holders=(Holder(mapper.pid, None, "listed by NVML on GPU 0"),))
        )
        took = time.monotonic() - began
        text = Path(made.path).read_text()
    finally:
        release.set()
        monkeypatch.setattr(bundle, "_proc", None)
    assert took < 5, took
    assert "status: not read: reading /proc/" in text and "no answer in 0.3 s" in text
    # The reads after it wait for none: not tried, said.
    assert "cgroup: not read:" in text and "not tried" in text
    assert text.endswith("== end of the bundle ==\n")


def test_a_stuck_leaves_one_bundle_named_in_status_and_its_retries_add_none(
    host: LoopHost,
) -> None:
    booted(host)
    host.gpu.extra[1] = 20_000  # memory no teardown can free
    host.daemon.ask(Switch(Mode.PROFILE, "op"))
    host.until(lambda: host.state is State.STUCK, "STUCK")
    host.until(lambda: bool((host.status()["incident_bundle"] or {}).get("path")), "a bundle")
    b = host.status()["incident_bundle"]
    path = Path(b["path"])
    assert b["trigger"] == "stuck" and path.parent == host.config.state.dir / "incidents"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert "trigger:   stuck" in text and "teardown STUCK" in text
    assert '"outcome": "stuck"' in text  # the report, and the history around it
    assert "GPU 1: 20500 of" in text  # NVML's view, read by the bundle's thread
    host.until(lambda: host.daemon.s.stuck_retries >= 3, "three retries")
    assert len(list(path.parent.iterdir())) == 1
    said = format_status(host.status(), 80)
    assert "incident:      the newest bundle (stuck at " in said
    assert str(path) in re.sub(r"\n +", "", said)  # a long path takes two rows at 80
    host.gpu.extra[1] = 0
    host.serving(Mode.PROFILE)


def test_a_bundle_that_cannot_be_written_changes_nothing_the_daemon_does(
    host: LoopHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full or read-only state folder, one that never answers: the STUCK and its retries go
    on exactly as without a bundle; status and the log say why there is none."""

    def full(*_a: object, **_k: object) -> None:
        raise StateError("cannot write /x/incidents/incident-...: [Errno 28] No space left")

    monkeypatch.setattr(bundle, "write", full)
    booted(host)
    host.gpu.extra[1] = 20_000
    host.daemon.ask(Switch(Mode.PROFILE, "op"))
    host.until(lambda: bool((host.status()["incident_bundle"] or {}).get("error")), "the error")
    st = host.status()
    assert st["state"] == "stuck" and "No space left" in st["incident_bundle"]["error"]
    assert st["incident_bundle"]["path"] is None
    assert [e for e in host.lines if e["event"] == "incident_bundle_failed"]
    host.until(lambda: host.daemon.s.stuck_retries >= 2, "the retries, as ever")
    # A bundle's thread that never comes back holds nothing either: the loop goes on.
    host.daemon.life.bundles.done(BundleDone("stuck", error="no answer in 30 s"))
    host.gpu.extra[1] = 0
    host.serving(Mode.PROFILE)
    assert json.dumps(host.status())  # status stays whole
