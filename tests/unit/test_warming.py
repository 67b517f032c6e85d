"""Warming against a model folder whose reads never return (loop/warming.py, ports/pagecache.py):
a FUSE file system of the tests' own (tests/hungfs.py) stands in for a hung NFS or object-store
mount, in both ways the kernel keeps a reader: a server that stopped reading requests, and one
that took the read and never answers. The warming must give up at its deadline or at a stop,
leave the stuck reader (never wait for it), say so, and start no other reader while it is left.
Needs root and /dev/fuse (skipped with the reason otherwise); the loop's side, in the sandbox:
tests/sandbox/test_warming.py."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kimi_supervisor.config import WarmConfig
from kimi_supervisor.loop import warming
from kimi_supervisor.ports import pagecache
from kimi_supervisor.ports.clock import SystemClock
from kimi_supervisor.status import WarmStatus
from tests import hungfs

pytestmark = pytest.mark.skipif(bool(hungfs.unavailable()), reason=hungfs.unavailable() or "-")

TREE: dict[str, object] = {
    "m/config.json": "{}",
    "m/model-00001-of-00002.safetensors": {"hang": 1 << 30},
    "m/model-00002-of-00002.safetensors": {"hang": 1 << 30},
}


# A warming starts no reader while one is stuck anywhere on the machine (a sandbox test's daemon
# leaves one in its scope until its hung mount goes): these tests wait for none to be left.
NOT_ALONE = "a warming's reader of another test is still stuck on this machine"


def readers_gone(timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while pagecache.stuck_readers():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def in_fuse(pid: int) -> bool:
    """A thread of `pid` waits for a FUSE server's answer."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "wchan").read_text() == "request_wait_answer":
                return True
        except OSError:
            continue
    return False


class FromStuck(SystemClock):
    """The real clock, held still until a thread of the warming's reader (the first adopted)
    waits in the hung mount: the deadline counts from there, however long a busy host took to
    start the reader and bring it that far."""

    def __init__(self, adopted: list[int]) -> None:
        self.adopted, self.t0, self.held = adopted, time.monotonic(), -1.0

    def monotonic(self) -> float:
        now = time.monotonic()
        if self.held < 0:
            with contextlib.suppress(OSError):
                if self.adopted and in_fuse(self.adopted[0]):
                    self.held = now - self.t0
            if self.held < 0:
                return self.t0
        return now - self.held


def warm_now(
    folder: Path,
    stop: threading.Event,
    adopted: list[int],
    report: Callable[[WarmStatus], None] = lambda _w: None,
    *,
    timeout_s: float = 2,
    clock: SystemClock | None = None,
) -> tuple[WarmStatus, float]:
    """One warming of `folder` (warm.timeout_s 2 s, 2 threads): its end and how long it took."""
    t0 = time.monotonic()

    def adopt(pid: int) -> str:
        adopted.append(pid)
        return f"kimi-supervisor-warm-{pid}.scope"

    end = warming.warm(
        WarmConfig(timeout_s=timeout_s, threads=2),
        ["vllm", "serve", str(folder)],
        stop,
        clock=clock or SystemClock(),
        report=report,
        adopt=adopt,
        why=lambda: "the daemon is stopping",
    )
    return end, time.monotonic() - t0


@pytest.mark.parametrize("hang", ["stalled", "taken"])
def test_a_warming_whose_reads_never_return_gives_up_at_its_deadline_and_leaves_its_reader(
    tmp_path: Path, hang: str
) -> None:
    adopted: list[int] = []
    assert readers_gone(), NOT_ALONE
    with hungfs.mounted(tmp_path / "mnt", TREE, hang=hang):
        # Its deadline counted from the reads stuck: it gives up on reads, not on a slow start.
        end, took = warm_now(
            tmp_path / "mnt" / "m", threading.Event(), adopted, clock=FromStuck(adopted)
        )
        # Not before its deadline; and at it, since no read ever returns: that it ended at all
        # is that it did not wait for them.
        assert took >= 2.0, (took, end.text, end.stopped)
        assert (end.under_way, end.stopped) == (False, "timeout")
        assert end.read_bytes <= 2  # config.json at most: no shard's read ever returned
        assert end.abandoned >= 1 and end.reader_pid == adopted[0]
        assert end.left_in == f"kimi-supervisor-warm-{adopted[0]}.scope"
        assert "stopped at warm.timeout_s (2 s)" in end.text
        assert "read(s) stuck in the kernel abandoned" in end.text
        assert adopted[0] in pagecache.stuck_readers()  # it is left, and known to be
        # A second warming while it is left starts no reader: skipped at once, and said.
        again, took = warm_now(tmp_path / "mnt" / "m", threading.Event(), adopted)
        assert len(adopted) == 1
        assert f"the reader an earlier warming left (PID {adopted[0]}) is still stuck" in again.text
    # The mount gone, its requests fail: the reader ends and is reaped; warming may run again.
    assert readers_gone(), "the stuck reader did not end once its mount went"


def test_a_stop_during_a_warming_stuck_in_the_kernel_is_not_held_by_it(tmp_path: Path) -> None:
    adopted: list[int] = []
    stop = threading.Event()
    asked: list[float] = []
    assert readers_gone(), NOT_ALONE

    def reading(w: WarmStatus) -> None:
        """The stop comes once a thread of the reader waits in the FUSE request (its wchan)."""
        if w.files and not asked and in_fuse(adopted[0]):
            asked.append(time.monotonic())
            stop.set()

    with hungfs.mounted(tmp_path / "mnt", TREE):
        # Its deadline far off, no read ever returning: only the stop, not held by them, ends it.
        end, took = warm_now(tmp_path / "mnt" / "m", stop, adopted, reading, timeout_s=600)
        assert asked and took < 600, took
        assert (end.stopped, end.abandoned >= 1) == ("aborted", True)
        assert "stopped: the daemon is stopping" in end.text
    assert readers_gone()
