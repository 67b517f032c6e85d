"""Calls with a deadline (ports/bounded.py) and the GPU port over them: a call stuck in the
kernel is abandoned, never joined; while it is stuck nothing queues behind it; and once it
returns, the port answers again."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kimi_supervisor.ports.bounded import ProcessGone, ProcessWorker, Worker
from kimi_supervisor.ports.gpu import BoundedGpu, DeviceSample, GpuUnavailable


def test_a_call_stuck_past_its_deadline_is_abandoned_and_the_others_fail_at_once() -> None:
    w, gate, ran = Worker("test", 0.2), threading.Event(), []
    # The gate stays shut until after both calls: that they return at all is that neither
    # waited for it; the second's "not tried" is that it was not queued behind the first.
    with pytest.raises(TimeoutError, match=r"stuck read: no answer in 0\.2 s; the call is aband"):
        w.call(gate.wait, "stuck read")
    assert w.stuck() is not None and w.stuck()[0] == "stuck read"  # type: ignore[index]
    with pytest.raises(TimeoutError, match="next: not tried, since stuck read has had no ans"):
        w.call(lambda: ran.append(1), "next", timeout_s=3600)
    assert not ran, "nothing waits, nothing queues"
    gate.set()  # the kernel lets it go
    wait_for(lambda: w.stuck() is None)
    assert w.call(lambda: 42, "after", timeout_s=60) == 42 and w.abandoned == 1


def test_a_call_given_up_before_it_began_never_runs() -> None:
    w, gate, began, ran = Worker("test", 60), threading.Event(), threading.Event(), []

    def first() -> None:
        began.set()
        gate.wait()

    holder = threading.Thread(target=lambda: w.call(first, "first"))
    holder.start()
    assert began.wait(5)
    with pytest.raises(TimeoutError):
        w.call(lambda: ran.append(1), "queued", timeout_s=0.1)  # behind the first, in time
    gate.set()
    holder.join(5)
    assert w.call(lambda: "ok", "last") == "ok"
    assert not ran, "the call its caller gave up on was skipped"
    assert w.abandoned == 0, "the first returned in its time"


def test_an_error_of_the_call_reaches_its_caller_as_it_was() -> None:
    def fails() -> None:
        raise PermissionError("denied")

    with pytest.raises(PermissionError, match="denied"):
        Worker("test", 60).call(fails, "a read")


class HungDriver:
    """A GpuPort whose calls wait while `hung` is clear (a driver in state D)."""

    def __init__(self) -> None:
        self.answers = threading.Event()
        self.answers.set()

    def sample(self, indices: list[int]) -> list[DeviceSample]:
        self.answers.wait()
        return [DeviceSample(i, 500, 1000) for i in indices]

    def device_count(self) -> int:
        self.answers.wait()
        return 2


def test_a_driver_that_does_not_answer_is_gpu_unavailable_in_time_and_read_again_after() -> None:
    driver = HungDriver()
    worker = Worker("nvml", 60)  # a deadline a busy host's answers meet; 0.2 s while it hangs
    gpu = BoundedGpu(driver, 60, worker)  # type: ignore[arg-type]
    assert [s.used_mib for s in gpu.sample([0, 1])] == [500, 500]
    worker.timeout_s = 0.2
    driver.answers.clear()  # until after both calls: neither held its caller waiting for it
    with pytest.raises(GpuUnavailable, match=r"NVML: reading GPU\(s\) 0, 1: no answer in 0.2 s"):
        gpu.sample([0, 1])
    with pytest.raises(GpuUnavailable, match="not tried, since reading GPU"):
        gpu.device_count()
    driver.answers.set()
    wait_for(lambda: gpu.worker.stuck() is None)
    worker.timeout_s = 60
    assert gpu.device_count() == 2


# -- the daemon's workers: a process of its own, whose stuck call holds no exit ------------------


def _open_fifo(path: str) -> bytes:
    """Blocks in the kernel until a writer opens the FIFO (the child's stand-in for a hung read)."""
    with open(path, "rb") as f:
        return f.read()


def _exit_now() -> None:
    os._exit(3)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "hung"
    os.mkfifo(path)
    yield path
    # Whatever the test did, no reader of ours is left blocked on it.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)


def test_a_process_worker_runs_each_call_in_its_own_process_and_hands_back_errors_as_raised() -> (
    None
):
    w = ProcessWorker("test", 60)
    try:
        child = w.call(functools.partial(os.getpid), "its pid")
        assert child != os.getpid() and child == w.pid
        assert Path(f"/proc/{child}/comm").read_text().strip() == "kimi-io"
        with pytest.raises(FileNotFoundError) as e:
            w.call(functools.partial(os.stat, "/no/such/file"), "a stat")
        assert e.value.errno == errno.ENOENT
        assert w.call(functools.partial(sum, [1, 2, 3]), "a sum") == 6 and w.started == 1
    finally:
        w.close()
    assert not _alive(child), "an idle process ends when the worker closes its input"


def test_a_call_that_cannot_cross_to_the_process_is_refused_before_anything_is_sent() -> None:
    for w in (ProcessWorker("test", 60), Worker("test", 60, copy=True)):
        with pytest.raises(TypeError, match="a write: the call cannot be handed to another pro"):
            w.call(lambda: 1, "a write")
        w.close()


def test_a_process_stuck_in_the_kernel_fails_calls_at_once_and_its_late_answer_is_heard(
    fifo: Path,
) -> None:
    w, heard = ProcessWorker("test", 0.3), []
    try:  # nothing writes to the FIFO until after both calls: they returned without it
        with pytest.raises(TimeoutError, match=r"a read: no answer in 0\.3 s"):
            w.call(functools.partial(_open_fifo, str(fifo)), "a read", on_late=heard.append)
        with pytest.raises(TimeoutError, match="next: not tried, since a read has had no answ"):
            w.call(functools.partial(os.getpid), "next", timeout_s=3600)
        assert w.abandoned == 1 and w.stuck() is not None
        with open(fifo, "wb") as f:  # the kernel lets the read go
            f.write(b"late")
        wait_for(lambda: w.stuck() is None)
        assert heard == [b"late"], "the answer of the call given up on reached its on_late"
        assert w.call(functools.partial(sum, [2, 2]), "after", 60) == 4 and w.started == 1
    finally:
        w.close()


def test_closing_never_waits_for_a_stuck_process_which_ends_once_the_kernel_lets_it_go(
    fifo: Path,
) -> None:
    w = ProcessWorker("test", 0.2)
    with pytest.raises(TimeoutError):
        w.call(functools.partial(_open_fifo, str(fifo)), "a read")
    stuck = w.pid
    assert stuck is not None
    w.close()  # returns while nothing has written to the FIFO: it did not wait for the read
    assert _alive(stuck), "close left the stuck process as it is, and did not kill it"
    with open(fifo, "wb"):
        pass  # the read returns; the process finds its input closed and exits
    wait_for(lambda: not _alive(stuck))


def test_a_process_that_dies_fails_its_call_and_the_next_call_starts_another() -> None:
    w = ProcessWorker("test", 60)
    try:
        first = w.call(functools.partial(os.getpid), "its pid")
        with pytest.raises(ProcessGone, match=r"an exit: its I/O process ended \(exit 3\)"):
            w.call(functools.partial(_exit_now), "an exit")
        second = w.call(functools.partial(os.getpid), "its pid")
        assert second != first and w.started == 2
    finally:
        w.close()


def test_the_gpu_port_made_in_the_process_keeps_its_object_there_between_calls() -> None:
    w = ProcessWorker("test", 60)
    try:
        gpu = BoundedGpu(Counter(), 60, w, made_by=(Counter, ()))  # type: ignore[arg-type]
        assert [gpu.device_count() for _ in range(3)] == [1, 2, 3]
    finally:
        w.close()


class Counter:
    """A GpuPort's stand-in whose answer counts the calls made on the one object."""

    def __init__(self) -> None:
        self.n = 0

    def device_count(self) -> int:
        self.n += 1
        return self.n


def wait_for(cond: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def _bytes(n: int) -> bytes:
    return b"x" * n


def test_a_large_answer_still_coming_at_the_deadline_is_not_waited_for_and_arrives_later() -> None:
    """An answer that keeps coming (a history of 114 MiB) held the caller past its deadline,
    read after read; taken in by a byte string grown by copying, it took 30 s. The call ends
    at its deadline; what came is kept, and the rest is taken in by later looks."""
    w = ProcessWorker("test", 60)
    try:
        w.start()
        heard: list[int] = []
        # A TimeoutError, not the answer: the deadline held, whatever kept coming.
        with pytest.raises(TimeoutError):
            w.call(functools.partial(_bytes, 128 << 20), "a big read", 0.05,
                   on_late=lambda b: heard.append(len(b)))  # fmt: skip
        wait_for(lambda: w.stuck() is None, 120)  # 50 ms looks: long on a loaded machine
        assert heard == [128 << 20], "the whole answer was heard once it all came"
        assert w.call(functools.partial(sum, [1, 1]), "after") == 2 and w.started == 1
    finally:
        w.close()


def test_a_closed_worker_starts_no_process_again() -> None:
    """The daemon closes its workers before it re-executes; a second close or a call after
    (the exec failed, the `finally` that follows) starts nothing that would outlive it."""
    w = ProcessWorker("test", 60)
    w.start()
    child = w.pid
    w.close()
    with pytest.raises(ProcessGone, match="closed"):
        w.call(functools.partial(os.getpid), "after the close")
    w.close()
    assert w.pid is None and w.started == 1 and child is not None


def test_closing_the_gpu_port_after_its_process_died_starts_none_to_close_it() -> None:
    """At system shutdown the I/O scopes may stop before the daemon: its NVML process gone, the
    close started a new one (in a scope the stopping manager refused) only to shut NVML down."""
    w = ProcessWorker("test", 60)
    w.start()
    assert w.pid is not None
    os.kill(w.pid, 9)  # the process this test started
    wait_for(lambda: not w.alive)
    BoundedGpu(HungDriver(), 60, w, made_by=(HungDriver, ())).close()  # type: ignore[arg-type]
    assert w.started == 1
