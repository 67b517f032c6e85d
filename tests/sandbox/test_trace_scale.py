"""The trace reader at the size of a real capture, in the slow tier: the unit tier checks the
same bound on inputs of seconds (tests/unit/test_capture.py, its growth between two sizes);
here it is checked once at full size, 400,000 events and more than 60 MB unpacked."""

from __future__ import annotations

import gzip
import tracemalloc
from pathlib import Path

from kimi_supervisor.analysis import trace

from ..unit.test_capture import cpu_trace


def test_a_trace_of_400k_events_is_read_in_a_few_megabytes(tmp_path: Path) -> None:
    path = tmp_path / "1-rank-0.1.pt.trace.json.gz"
    cpu_trace(path, extra=400_000)
    with gzip.open(path) as f:
        unpacked = sum(len(chunk) for chunk in iter(lambda: f.read(1 << 20), b""))
    tracemalloc.start()
    try:
        with open(path, "rb") as f:
            r = trace.summarize_file(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r["events"] > 400_000 and r["steps"]["decode"] == 2
    assert unpacked > 60e6 and peak < 12e6, (unpacked, peak)
