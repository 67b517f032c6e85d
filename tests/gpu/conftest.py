"""The GPU host fixture shared by the real-GPU tests (each ends every process it started)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_real_gpus import Host


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path)
    try:
        yield h
    finally:
        h.cleanup()
