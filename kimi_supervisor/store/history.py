"""The history file: one JSON line per record (teardown, transition, incident, capture), appended
and fsynced, kept across restarts. Appends are all or nothing (a torn tail is repaired before
the next one); reading skips a torn line, never fatal, and reads from the end."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any

from kimi_supervisor.model import TeardownReport, shown
from kimi_supervisor.store.state import StateError, open_trusted


def history_path(state_dir: Path) -> Path:
    return state_dir / "history.jsonl"


def append(
    state_dir: Path,
    kind: str,
    record: TeardownReport | dict[str, Any],
    *,
    max_bytes: int = 64 << 20,
    keep: int = 5,
    once: bool = False,
) -> None:
    """One record, all or nothing: a torn tail (a crash or a full disk mid-write) is cut off
    first, and a write that fails is undone, so the next record never lands glued to half of
    one. Once the file passes `max_bytes` it is rotated (`keep` older files are kept). Raises
    StateError (with the reason) when the record could not be written. With `once` (the
    record's earlier try has no known end: its process died, or its answer never came), a
    history whose last record is this very line (or, just rotated, whose .1's last is) is left
    as it is: the earlier try wrote it."""
    body = record.model_dump(mode="json") if isinstance(record, TeardownReport) else record
    # A name that is not UTF-8 (a file another user named) has its odd bytes escaped, never a
    # record lost or a daemon crashed over it.
    line = (json.dumps(_shown({"kind": kind, **body}), ensure_ascii=False) + "\n").encode()
    path = history_path(state_dir)
    fd = open_trusted(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = _repair_tail(fd)
        if once and _written_last(fd, size, line, path=path):
            return
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.ENOSPC, "short write")
            os.fsync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise StateError(f"cannot append to {path}: {e}") from e
        size += len(line)
    finally:
        os.close(fd)
    if size > max_bytes:
        _rotate(path, keep)


def _rotate(path: Path, keep: int) -> None:
    """history.jsonl -> .1 -> .2 ... -> .keep (the oldest is dropped). Renames only: a reader
    sees either file whole."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"{path}.{keep}")
    for i in range(keep - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            os.rename(f"{path}.{i}", f"{path}.{i + 1}")
    os.rename(path, f"{path}.1")


def _ends_with(fd: int, size: int, line: bytes) -> bool:
    """The file (`size` bytes) ends with the whole line `line`."""
    if size < len(line):
        return False
    if size == len(line):
        return os.pread(fd, size, 0) == line
    return os.pread(fd, len(line) + 1, size - len(line) - 1) == b"\n" + line


def _written_last(fd: int, size: int, line: bytes, *, path: Path) -> bool:
    """`line` is the history's last record: in the file (`fd`, `size` bytes), or, when the
    file is empty (rotated since), in the newest rotated one."""
    if size:
        return _ends_with(fd, size, line)
    try:
        rotated = open_trusted(Path(f"{path}.1"), os.O_RDONLY)
    except (OSError, StateError):
        return False
    try:
        return _ends_with(rotated, os.fstat(rotated).st_size, line)
    finally:
        os.close(rotated)


def _repair_tail(fd: int) -> int:
    """Cut a last line that has no newline (a torn write); returns the file's size after."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    pos = size
    while pos > 0:
        step = min(65536, pos)
        chunk = os.pread(fd, step, pos - step)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            pos = pos - step + nl + 1
            break
        pos -= step
    os.ftruncate(fd, pos)
    return pos


def read(
    state_dir: Path, last: int | None = None, max_bytes: int | None = None
) -> list[dict[str, Any]]:
    """The last `last` records (all if None), oldest first, across the rotated files, and of
    them at most `max_bytes` (the newest). Reads from the end of each file, so a long history
    costs only what is asked for."""
    lines, _cut = read_lines(state_dir, last, max_bytes)
    return [json.loads(line) for line in lines]


def read_lines(
    state_dir: Path, last: int | None = None, max_bytes: int | None = None
) -> tuple[list[bytes], bool]:
    """The last `last` records as their JSON lines (each checked to parse), oldest first, and
    at most `max_bytes` of them (the newest); True if that cap left older ones out. A reader
    that serves an outsider holds only these bytes, never the records as objects."""
    path = history_path(state_dir)
    out: list[bytes] = []
    size = 0
    for i in range(0, 101):
        f_path = path if i == 0 else Path(f"{path}.{i}")
        want = None if last is None else last - len(out)
        try:
            room = None if max_bytes is None else max_bytes - size
            lines = _read_one(f_path, want, room)
        except FileNotFoundError:
            if i == 0:
                continue
            break
        if max_bytes is not None:
            kept: list[bytes] = []
            for line in reversed(lines):
                size += len(line) + 1
                if size > max_bytes:
                    return kept[::-1] + out, True
                kept.append(line)
            lines = kept[::-1]
        out = lines + out
        if last is not None and len(out) >= last:
            return out[-last:], False
    return out, False


def _read_one(path: Path, last: int | None, max_bytes: int | None = None) -> list[bytes]:
    """The file's last `last` records' lines (all if None), reading backwards in 64 KiB steps
    and no further than `max_bytes` (and a step) from its end."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if last is None and max_bytes is None:
            data = f.read()
        else:
            end = f.seek(0, os.SEEK_END)
            chunks: list[bytes] = []
            pos, newlines, read = end, 0, 0
            while pos > 0 and (last is None or newlines <= last):
                if max_bytes is not None and read > max_bytes:
                    break
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                chunk = f.read(step)
                chunks.append(chunk)
                newlines += chunk.count(b"\n")
                read += len(chunk)
            data = b"".join(reversed(chunks))
    out = []
    for line in data.splitlines():
        try:
            json.loads(line)
        except ValueError:
            continue  # a torn line, or the cut-off first line of the tail read
        out.append(line)
    return out[-last:] if last else out


def _shown(value: Any) -> Any:
    """`value` with every string as model.shown gives it (JSON cannot carry a lone surrogate)."""
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, dict):
        return {shown(str(k)): _shown(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_shown(v) for v in value]
    return value
