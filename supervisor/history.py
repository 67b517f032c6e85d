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
    try:
        lines = history_path(state_dir).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out[-last:] if last else out
