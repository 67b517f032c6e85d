"""The history file: one JSON line per teardown report, appended and fsynced, kept across
restarts. A torn last line (a crash mid-write) is skipped when reading, never fatal."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from supervisor.model import TeardownReport


def history_path(state_dir: Path) -> Path:
    return state_dir / "history.jsonl"


def append(state_dir: Path, kind: str, record: TeardownReport | dict[str, Any]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    body = record.model_dump(mode="json") if isinstance(record, TeardownReport) else record
    line = json.dumps({"kind": kind, **body}, ensure_ascii=False) + "\n"
    fd = os.open(history_path(state_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read(state_dir: Path, last: int | None = None) -> list[dict[str, Any]]:
    """The last `last` records (all if None), oldest first. Reads from the end of the file, so
    a long history costs only what is asked for."""
    path = history_path(state_dir)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return []
    with f:
        if last is None:
            data = f.read()
        else:
            end = f.seek(0, os.SEEK_END)
            data, pos = b"", end
            while pos > 0 and data.count(b"\n") <= last:
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    out = []
    for line in data.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a torn line, or the cut-off first line of the tail read
    return out[-last:] if last else out
