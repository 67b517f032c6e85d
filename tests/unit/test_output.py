"""vLLM's output as the daemon reads it: memory bounded whatever the output holds (300 MB
with no newline took the daemon from 49 to 774 MB)."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
from pathlib import Path

from kimi_supervisor.ports.output import MAX_LINE, MAX_READ, FileOutput, JournalOutput


def test_300_mb_of_output_with_no_newline_is_read_in_bounded_memory_and_the_tail_is_recent(
    tmp_path: Path,
) -> None:
    log = tmp_path / "vllm.log"
    log.write_bytes(b"Loading weights took 12.3 seconds\n")
    out = FileOutput(log)
    out.begin()
    with open(log, "ab") as f:
        f.truncate(300 * 2**20)  # 300 MB of NUL bytes, no newline (sparse: no disk used)
    tracemalloc.start()
    try:
        lines = out.read_new() + out.read_new()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MAX_READ, f"{peak / 2**20:.0f} MiB to read 300 MB"
    assert lines[0].startswith("[kimi-supervisor: ") and "bytes of output skipped" in lines[0]
    assert all(len(ln) <= MAX_LINE for ln in out.tail())
    with open(log, "ab") as f:
        f.write(b"\nINFO: Application startup complete.\n")
    assert out.read_new()[-1] == "INFO: Application startup complete."


def test_a_journal_line_of_50_mb_is_read_in_pieces_not_whole(tmp_path: Path) -> None:
    out = JournalOutput("vllm-kimi-k25.service", "system")
    code = "import sys; sys.stdout.buffer.write(b'x' * 50_000_000 + b'\\nready\\n')"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    tracemalloc.start()
    try:
        out._pump(proc)  # the reader thread's loop, run here to the end of the output
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        proc.wait()
    lines = out.read_new()
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB for one 50 MB line"
    assert lines[-1] == "ready" and all(len(ln) <= MAX_LINE for ln in lines)
    assert len(out.tail()) <= 30
