"""The stacks of a process tree, as text, for the incident bundle of a hang: what an operator
and vLLM's developers need to find the cause, and what the restart loses.

Each thread's state, its `wchan` (where in the kernel it sleeps) and its kernel stack
(`/proc/PID/task/TID/stack`, root's to read), of every process first; then each process's Python
stacks from `py-spy dump` where py-spy is installed (it stops the process for the moment of the
read), the processes at once. Bounded in time and size: py-spy gets PY_SPY_S a process and is
killed past it; each /proc read runs on a thread of its own (ports/bounded.py), waited for
PROC_READ_S, and after one is stuck none is tried again; no read is started past the whole
`deadline`; each process's text is cut at PROCESS_MAX_BYTES. What was not read is said where it
would have been.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kimi_supervisor.model import printable
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.bounded import Worker

PY_SPY_S = 5.0
PY_SPY_PARALLEL = 8  # py-spy processes at a time (each some tens of MB)
PROC_READ_S = 1.0
PROCESS_MAX_BYTES = 48 << 10
THREADS_MAX = 256  # threads of one process read from /proc; the rest counted


def py_spy() -> str | None:
    """py-spy's path: on PATH, or beside this interpreter (a virtualenv's bin)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if os.access(beside, os.X_OK) else None)


_proc: Worker | None = None


def _worker() -> Worker:
    global _proc
    if _proc is None:
        _proc = Worker("stacks-proc", PROC_READ_S)
    return _proc


def _read(path: str, cap: int = 16 << 10) -> str:
    with open(path, "rb", buffering=0) as f:
        return f.read(cap).decode(errors="backslashreplace").strip()


def _proc_read(path: str) -> str:
    """A /proc file's text, or why not, within PROC_READ_S."""
    try:
        return _worker().call(functools.partial(_read, path), f"reading {path}")
    except FileNotFoundError:
        return "(gone)"
    except OSError as e:  # TimeoutError too: the read stuck in the kernel, or one before it
        return f"(not read: {e.strerror or e})"


def _threads(pid: int, deadline: float) -> list[str]:
    """Each thread's name, state, wchan and kernel stack, from /proc."""
    base = f"{processes.PROC}/{pid}/task"
    try:
        tids = sorted(int(t) for t in os.listdir(base) if t.isdigit())
    except OSError as e:
        return [f"  threads not listed: {e.strerror or e}"]
    out: list[str] = []
    for tid in tids[:THREADS_MAX]:
        if time.monotonic() >= deadline:
            out.append(
                f"  (the time for stacks ran out: {len(tids) - len(out)} thread(s) not read)"
            )
            break
        t = f"{base}/{tid}"
        comm, wchan = _proc_read(f"{t}/comm"), _proc_read(f"{t}/wchan")
        state = processes.state_of(tid) or "?"
        # A thread's name is its process's to choose: escaped (a newline in it forged whole
        # "-- PID" blocks among root's reading, an outside review).
        out.append(
            f"  thread {tid} ({printable(comm)}), state {state}, wchan {printable(wchan) or '0'}"
        )
        stack = _proc_read(f"{t}/stack")
        out += [f"    {printable(line)}" for line in stack.splitlines()]
    if len(tids) > THREADS_MAX:
        out.append(f"  ({len(tids) - THREADS_MAX} more thread(s) not read)")
    return out


def _py_spy(spy: str, pid: int, timeout_s: float) -> str | None:
    """py-spy's dump of `pid` (at most PROCESS_MAX_BYTES of it: a process of many threads is
    its owner's to make), or None where py-spy could not start."""
    try:
        proc = subprocess.Popen(
            [spy, "dump", "--pid", str(pid)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, close_fds=True,
        )  # fmt: skip
    except OSError:
        return None
    assert proc.stdout is not None
    out, fd = bytearray(), proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    ended = False
    try:
        while len(out) <= PROCESS_MAX_BYTES:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                ended = True
                break
            out += chunk
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # our own child, by its handle: done, cut short or out of time
        proc.stdout.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1)
    text = out.decode(errors="backslashreplace").strip()
    if not ended:
        why = "out of time" if len(out) <= PROCESS_MAX_BYTES else "too long"
        return f"{text}\n(py-spy's dump cut short: {why})" if text else f"(py-spy: {why})"
    return text if proc.returncode == 0 else f"(py-spy failed: {text[-500:]})"


def _py_spy_of(spy: str, pid: int, deadline: float, *, ref: processes.ProcessRef | None) -> str:
    """py-spy's dump of `pid` within PY_SPY_S and `deadline`, if it is still the process
    listed (`ref`), or why not."""
    left = min(PY_SPY_S, deadline - time.monotonic())
    if left <= 0:
        return "(py-spy: not run, the time for stacks ran out)"
    if ref is None or processes.ref_of(pid) != ref:
        return "(py-spy: not run, it exited, or its PID names another process now)"
    return _py_spy(spy, pid, left) or "(py-spy could not start)"


def dump(pids: Sequence[int], deadline: float) -> str:
    """The stacks of `pids` (vLLM's processes, parents first), read until `deadline`
    (time.monotonic()), each process's text at most PROCESS_MAX_BYTES. A PID that names another
    process by the time its turn comes (its start time) is not read: never a stranger's.

    Every process's kernel side (/proc: each thread's state, wchan and stack) first: cheap,
    bounded, and what a hang in the driver shows. Then py-spy, every process at once (at most
    PY_SPY_PARALLEL at a time) within what is left: a py-spy that stalls (its ptrace interrupt
    waits on a process stuck in D) costs no other process its stacks (one after another, PY_SPY_S
    each, three processes got any of the 15 s, an outside review)."""
    spy = py_spy()
    out = [
        "Python stacks by "
        + (f"py-spy ({spy})" if spy else "nobody (py-spy is not installed)")
        + "; each thread's state, wchan and kernel stack from /proc"
    ]
    listed = {pid: processes.ref_of(pid) for pid in pids}  # each as it was when listed
    heads: dict[int, str] = {}
    kernel: dict[int, list[str]] = {}
    for n, pid in enumerate(pids):
        if time.monotonic() >= deadline:
            out.append(f"(the time for stacks ran out: {len(pids) - n} process(es) not read: "
                       f"{', '.join(map(str, pids[n:]))})")  # fmt: skip
            break
        comm = processes.comm_of(pid)
        heads[pid] = f"-- PID {pid} ({comm or 'gone'}), state {processes.state_of(pid) or 'gone'}"
        if listed[pid] is None or processes.ref_of(pid) != listed[pid]:
            continue
        kernel[pid] = _threads(pid, deadline)
    python: dict[int, str] = {}
    if spy is not None and kernel:
        with ThreadPoolExecutor(PY_SPY_PARALLEL, thread_name_prefix="stacks-py-spy") as pool:
            done = {
                pid: pool.submit(_py_spy_of, spy, pid, deadline, ref=listed[pid]) for pid in kernel
            }
        python = {pid: f.result() for pid, f in done.items()}
    for pid, head in heads.items():
        if pid not in kernel:
            out.append(f"{head}\n  (not read: it exited, or its PID names another process now)")
            continue
        # py-spy's lines name Python threads as the process chose them: each indented and
        # escaped, so that only the daemon's own headers start a line with "-- PID".
        spied = [f"  {printable(x)}" for x in (python.get(pid) or "").splitlines()]
        text = "\n".join([head, *spied, *kernel[pid]])
        if len(text.encode()) > PROCESS_MAX_BYTES:
            text = text.encode()[:PROCESS_MAX_BYTES].decode(errors="ignore")
            text += f"\n[cut: this process's stacks passed {PROCESS_MAX_BYTES >> 10} KiB]"
        out.append(text)
    return "\n\n".join(out)
