"""A capture's summary: every rank's trace summarized (analysis/trace.py) in a process of
its own, all ranks at once, and the result written beside the traces as summary.json and shown
as the operator reads it.

Each trace is opened relative to the capture's folder by the opener the caller gives (the daemon
and kimi-mode give ports/safeopen's: never through a link, never a FIFO or a device), and handed
to its process as stdin: the daemon runs this on folders its askers own. A process per rank
spreads eight 80 MB traces over the host's cores and keeps the daemon's own memory flat; a rank
that cannot be read, or takes longer than the deadline, is reported and the others still are.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kimi_supervisor
from kimi_supervisor.analysis import sizes, skew, trace
from kimi_supervisor.analysis.jsonstream import TraceError
from kimi_supervisor.analysis.timeline import Timeline
from kimi_supervisor.model import SUMMARY

TRACE = re.compile(r"\.pt\.trace\.json(\.gz)?$|\.trace\.json(\.gz)?$")
RANK = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
# summary.json's shape: 2 added the collectives, the steps' distribution, the overlap and the
# wait/transfer split across ranks (`across_ranks`); 3 the message sizes, the late rank's lead,
# the per-step arrival spread and the fabric; --compare summarizes again what is older.
SUMMARY_VERSION = 3
# The host's fabric as NVML read it at capture time (ports/gpu.py's `fabric`), written by the
# capture beside its traces: the summary carries it and sets the collectives against it.
FABRIC = "fabric.json"
FABRIC_MAX_BYTES = 1 << 20


def rank_of(name: str) -> int | None:
    """The rank in a trace's name: vLLM 0.16 writes `<id>-rank-N.<ts>.pt.trace.json.gz`, 0.32
    `rankN.<ts>...`; the API server's `vm_<pid>.async_llm...` has none."""
    m = RANK.search(name)
    return int(m.group(1)) if m else None


HOST = re.compile(r"^(.+?)[-_.]rank[_-]?\d+", re.IGNORECASE)


def host_of(name: str) -> str:
    """The host a trace's name gives, "" for none: an operator who gathers several hosts'
    traces into one folder names each `HOST-rank-N...`; vLLM's own names (`<instance id, a
    number>-rank-N`, `rankN`) give none: the ranks of one capture, on the daemon's host."""
    m = HOST.match(name)
    return "" if m is None or m.group(1).isdigit() else m.group(1)


@dataclass(frozen=True, order=True)
class RankTrace:
    """A rank's trace file in a capture's folder, and the rank its name gives."""

    rank: int
    name: str


def rank_traces(names: list[str]) -> list[RankTrace]:
    """The rank traces among `names`, by rank (then name)."""
    return sorted(
        RankTrace(r, n) for n in names if TRACE.search(n) and (r := rank_of(n)) is not None
    )


# What one rank's summarizer may take (address space, RLIMIT_AS; 8 ranks in parallel: 8 GiB at
# most in all). A real rank's trace of 500,000 events needs 3.6 MB of Python's allocations
# (docs/performance.md); a gzip bomb of 7 MB took 780 MB before this cap.
SUMMARY_MEMORY_MB = 1024


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The package this daemon runs from comes first, whatever else is called `kimi_supervisor`.
    root = str(Path(kimi_supervisor.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


# How a trace is opened: (fd, "") or (None, why not). The caller gives it (ports/safeopen's
# try_open): only a regular file, reached through no link, never a FIFO or a device, whose open
# alone may block or act. This package imports nothing of the daemon's ports.
Opener = Callable[[int, str], tuple[int | None, str]]


def summarize(
    dir_fd: int,
    names: list[str],
    open_file: Opener,
    *,
    timeout_s: float = 900.0,
    memory_mb: int = SUMMARY_MEMORY_MB,
) -> dict[str, Any]:
    """The summary of the rank traces among `names` in the folder `dir_fd` (see the module),
    each opened with `open_file`. Each rank's summarizer may use `memory_mb` of address space
    at most (a trace with more events than that holds is an error, not a daemon out of
    memory)."""
    t0 = time.monotonic()
    traces = rank_traces(names)
    running: list[tuple[int, str, subprocess.Popen[bytes]]] = []
    done: list[tuple[int, str, dict[str, Any]]] = []
    errors: list[dict[str, Any]] = []
    env = _child_env()
    for t in traces:
        rank, name = t.rank, t.name
        fd, why = open_file(dir_fd, name)
        if fd is None:
            errors.append({"rank": rank, "file": name, "error": why})
            continue
        try:
            summarizer = ["-m", "kimi_supervisor.analysis.trace", "--memory-mb", str(memory_mb)]
            # From "/": `python -m` puts its working directory first on the import path, and a
            # caller's (root running kimi-mode in a folder another user writes) must not
            # choose the code that runs.
            proc = subprocess.Popen(
                [sys.executable, *summarizer],
                stdin=fd,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                cwd="/",
            )
        except OSError:
            # No interpreter to start (a caller who may not run this one's path): read it here.
            with os.fdopen(fd, "rb") as f:
                try:
                    done.append((rank, name, trace.summarize_file(f)))
                except TraceError as e:
                    done.append((rank, name, {"error": str(e)}))
            continue
        os.close(fd)
        running.append((rank, name, proc))
    deadline = t0 + timeout_s
    for rank, name, proc in running:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            errors.append({"rank": rank, "file": name, "error": f"not read within {timeout_s:g} s"})
            continue
        try:
            done.append((rank, name, json.loads(out)))
        except ValueError:
            done.append((rank, name, {"error": f"the summarizer exited with {proc.returncode}"}))
    fabric = _fabric(dir_fd, open_file)
    ranks: list[dict[str, Any]] = []
    timelines: list[skew.RankTimeline] = []
    for rank, name, result in sorted(done, key=lambda d: d[0]):
        if "error" in result:
            errors.append({"rank": rank, "file": name, "error": result["error"]})
        else:
            if (tl := result.pop("timeline", None)) is not None:
                timelines.append(skew.RankTimeline(rank, Timeline.from_json(tl), host_of(name)))
            ranks.append({**result, "rank": rank, "file": name})
    return {
        "version": SUMMARY_VERSION,
        "ranks": ranks,
        "across_ranks": skew.split(timelines),
        "fabric": fabric,
        "errors": sorted(errors, key=lambda e: e["rank"]),
        "took_s": round(time.monotonic() - t0, 1),
    }


def _fabric(dir_fd: int, open_file: Opener) -> dict[str, Any] | None:
    """The capture's fabric.json (see FABRIC), with its limit (analysis/sizes.py); None where
    the folder has none; {"error": why} where it cannot be read."""
    try:
        os.stat(FABRIC, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"error": f"{FABRIC}: {e.strerror}"}
    fd, why = open_file(dir_fd, FABRIC)
    if fd is None:
        return {"error": f"{FABRIC}: {why}"}
    with os.fdopen(fd, "rb") as f:
        raw = f.read(FABRIC_MAX_BYTES + 1)
    try:
        found = json.loads(raw) if len(raw) <= FABRIC_MAX_BYTES else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return {"error": f"{FABRIC} is not a fabric reading"}
    return {**found, "limit": sizes.limit(found)}


def write(
    dir_fd: int, summary: dict[str, Any], uid: int = -1, *, gid: int = -1, name: str = SUMMARY
) -> None:
    """summary.json (or `name`: FABRIC) in the folder, replaced whole (a reader never sees half
    of it)."""
    tmp = f".{name}.{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o640, dir_fd=dir_fd)
    try:
        os.write(fd, (json.dumps(summary, indent=1) + "\n").encode())
        os.fsync(fd)
        if uid >= 0:
            os.fchown(fd, uid, gid)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


SUMMARY_MAX_BYTES = 64 * 2**20  # a summary.json of 5,000 per-step rows is about 300 kB


def read_summary(folder: Path, open_file: Opener) -> dict[str, Any] | None:
    """The folder's summary.json, or None when it has none, or one that does not parse (made
    again then). Opened with `open_file`; larger than SUMMARY_MAX_BYTES is none."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sfd, _why = open_file(fd, SUMMARY)
    finally:
        os.close(fd)
    if sfd is None:
        return None
    with os.fdopen(sfd, "rb") as f:
        raw = f.read(SUMMARY_MAX_BYTES + 1)
    if len(raw) > SUMMARY_MAX_BYTES:
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def summarize_folder(
    folder: Path, open_file: Opener, timeout_s: float = 900.0
) -> tuple[dict[str, Any], str | None]:
    """`kimi-mode capture --summarize DIR`: the summary of an existing capture, written as
    summary.json when the folder is writable and holds traces; the second value says why it
    was not."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        summary = summarize(fd, os.listdir(fd), open_file, timeout_s=timeout_s)
        if not summary["ranks"]:
            return summary, (
                f"no rank traces to summarize in {folder} (*.pt.trace.json or "
                f"*.pt.trace.json.gz); {SUMMARY} not written"
            )
        try:
            write(fd, summary)
        except OSError as e:
            return summary, f"{SUMMARY} not written: {e.strerror}"
        return summary, None
    finally:
        os.close(fd)
