"""The in-process loop's host (tests/unit/loophost.py), closed after each test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .loophost import LoopHost


@pytest.fixture
def host(tmp_path: Path) -> Iterator[LoopHost]:
    h = LoopHost(tmp_path)
    try:
        yield h
    finally:
        h.close()
