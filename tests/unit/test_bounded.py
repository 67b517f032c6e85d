"""Calls with a deadline (ports/bounded.py) and the GPU port over them: a call stuck in the
kernel is abandoned, never joined; while it is stuck nothing queues behind it; and once it
returns, the port answers again."""

from __future__ import annotations

import threading
import time

import pytest

from kimi_supervisor.ports.bounded import Worker
from kimi_supervisor.ports.gpu import BoundedGpu, DeviceSample, GpuUnavailable


def test_a_call_stuck_past_its_deadline_is_abandoned_and_the_others_fail_at_once() -> None:
    w, gate, ran = Worker("test", 0.2), threading.Event(), []
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"stuck read: no answer in 0\.2 s; the call is aband"):
        w.call(gate.wait, "stuck read")
    assert time.monotonic() - t0 < 1.0
    assert w.stuck() is not None and w.stuck()[0] == "stuck read"  # type: ignore[index]
    t1 = time.monotonic()
    with pytest.raises(TimeoutError, match="next: not tried, since stuck read has had no ans"):
        w.call(lambda: ran.append(1), "next")
    assert time.monotonic() - t1 < 0.1 and not ran, "nothing waits, nothing queues"
    gate.set()  # the kernel lets it go
    deadline = time.monotonic() + 5
    while w.stuck() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.call(lambda: 42, "after") == 42 and w.abandoned == 1


def test_a_call_given_up_before_it_began_never_runs() -> None:
    w, gate, began, ran = Worker("test", 5), threading.Event(), threading.Event(), []

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
        Worker("test", 1).call(fails, "a read")


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
    gpu = BoundedGpu(driver, 0.2)  # type: ignore[arg-type]
    assert [s.used_mib for s in gpu.sample([0, 1])] == [500, 500]
    driver.answers.clear()
    t0 = time.monotonic()
    with pytest.raises(GpuUnavailable, match=r"NVML: reading GPU\(s\) 0, 1: no answer in 0.2 s"):
        gpu.sample([0, 1])
    with pytest.raises(GpuUnavailable, match="not tried, since reading GPU"):
        gpu.device_count()
    assert time.monotonic() - t0 < 1.0, "neither call held its caller past the deadline"
    driver.answers.set()
    deadline = time.monotonic() + 5
    while gpu.worker.stuck() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gpu.device_count() == 2
