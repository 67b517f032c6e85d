"""An I/O process of the daemon (`ports/bounded.ProcessWorker`): it runs the calls it is handed,
one at a time, and answers each. Started as `python -m kimi_supervisor.ports.iochild NAME`.

On its input, a frame per call: its length (8 bytes), then a pickle of (id, the call pickled);
on its output, a frame per answer: (id, True, what the call returned) or (id, False, the
exception it raised). Both ends are the daemon's own pipes, so a pickle is read only from the
process that started this one. It ends at the end of its input: when the daemon closes it, or
exits (a stop, a crash, a re-exec, whose pipes close on exec). A call stuck in the kernel keeps
it until the kernel lets go; it is in a scope of its own by then, so no stop waits for it.
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import sys
from typing import Any, BinaryIO

from kimi_supervisor.ports.bounded import HEADER, MAX_FRAME, NAME


def _read_exactly(f: BinaryIO, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _answer(rid: int, request: bytes) -> bytes:
    try:
        value: Any = pickle.loads(request)()
        reply: tuple[int, bool, Any] = (rid, True, value)
    except BaseException as e:  # the caller's to decide: handed back as it was raised
        reply = (rid, False, e)
    try:
        out = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(out)  # an exception whose arguments do not come back whole is said so
    except Exception as e:
        what = reply[2] if not reply[1] else "its result"
        out = pickle.dumps(
            (rid, False, OSError(errno.EIO, f"the answer cannot be handed back ({e!r}): {what!r}"))
        )
    return out


def main(_argv: list[str]) -> int:
    # Its own name, as ps shows it; the signals the daemon blocks are its to take again, and a
    # terminal's Ctrl-C is the daemon's to handle (this one ends at the end of its input).
    try:
        with open("/proc/self/comm", "wb") as f:
            f.write(NAME)
    except OSError:
        pass
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Answers go to a descriptor of their own; anything a library prints goes to stderr (the
    # daemon's journal), never into a frame.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    while True:
        head = _read_exactly(inp, HEADER.size)
        if head is None:
            return 0
        (size,) = HEADER.unpack(head)
        if size > MAX_FRAME:
            return 2
        frame = _read_exactly(inp, size)
        if frame is None:
            return 0
        rid, request = pickle.loads(frame)
        data = _answer(rid, request)
        view = memoryview(HEADER.pack(len(data)) + data)
        try:
            while view:
                view = view[out.write(view) or 0 :]
        except BrokenPipeError:
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
