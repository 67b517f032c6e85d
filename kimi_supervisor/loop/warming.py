"""Warming: before a switch's teardown, while the old mode still serves, the next mode's model
files are read into the page cache, so that the new vLLM reads its weights from memory during
the downtime instead of from disk (decide/warmset.py says which files and how many fit).

It runs on the switch's job thread, before the teardown, and reports through the inbox
(`Warmed`). It never delays what must not wait: a `--force` switch skips it and one accepted
during it stops it, a stop stops it, and `warm.timeout_s` bounds it; each stops it between two
reads of 16 MiB. What it found, read and skipped is in the status, the live display and the
switch's history record.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from kimi_supervisor.config import WarmConfig
from kimi_supervisor.decide import warmset
from kimi_supervisor.ports import pagecache
from kimi_supervisor.ports.clock import Clock
from kimi_supervisor.status import WarmStatus

GB = 1e9
REPORT_S = 0.5  # progress at most this often


def find_folder(argv: list[str], env: Mapping[str, str], home: str) -> tuple[Path, Path] | str:
    """The folder vLLM will read the model from and the tree its links may point into, or why
    there is none."""
    src = warmset.source_of(argv)
    if src is None:
        return "vLLM's argv names no model"
    local = Path(src.model)
    if local.is_absolute() or local.is_dir():
        return (local, local) if local.is_dir() else f"the model folder {local} does not exist"
    looked = []
    for cache in warmset.hub_caches(src, env, home):
        repo = Path(cache) / warmset.repo_folder(src.model)
        rev = src.revision or "main"
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except OSError:
            commit = rev
        snap = repo / "snapshots" / commit
        if commit and "/" not in commit and snap.is_dir():
            return snap, repo
        looked.append(str(snap))
    return f"{src.model} is not in the hub's cache here (looked in {', '.join(looked)})"


def warm(
    config: WarmConfig,
    argv: list[str],
    stop: threading.Event,
    clock: Clock,
    report: Callable[[WarmStatus], None],
    env: Mapping[str, str] | None = None,
) -> WarmStatus:
    """Read the files vLLM started with `argv` will read; the last report is returned."""
    t0 = clock.monotonic()
    found = find_folder(argv, os.environ if env is None else env, os.path.expanduser("~"))
    if isinstance(found, str):
        return WarmStatus(under_way=False, text=f"nothing warmed: {found}")
    folder, tree = found
    try:
        files = {f.path.name: f for f in pagecache.files_in(folder, tree)}
        mem = pagecache.memory()
    except pagecache.PageCacheError as e:
        return WarmStatus(under_way=False, folder=str(folder), text=f"nothing warmed: {e}")
    ordered = [(n, files[n].size) for n in warmset.pick(list(files))]
    plan = warmset.plan(ordered, mem.available, config.max_ram_share)
    status = WarmStatus(
        under_way=True,
        folder=str(folder),
        files=len(plan.read),
        bytes=plan.read_bytes,
        skipped=[n for n, _ in plan.skipped],
        skipped_bytes=plan.skipped_bytes,
        budget_bytes=plan.budget,
        text="",
    )
    todo: queue.SimpleQueue[pagecache.File] = queue.SimpleQueue()
    for name, _size in plan.read:
        todo.put(files[name])
    lock = threading.Lock()
    read = [0]
    deadline = t0 + config.timeout_s
    timed_out = threading.Event()

    def halt() -> bool:
        return stop.is_set() or timed_out.is_set()

    def done(n: int) -> None:
        with lock:
            read[0] += n

    def worker() -> None:
        buffer = bytearray(pagecache.CHUNK)
        while not stop.is_set() and not timed_out.is_set():
            try:
                f = todo.get_nowait()
            except queue.Empty:
                return
            pagecache.read_through(f, halt, done, buffer)

    threads = [
        threading.Thread(target=worker, name=f"warm-{i}", daemon=True)
        for i in range(min(config.threads, max(len(plan.read), 1)))
    ]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(REPORT_S)
            if clock.monotonic() >= deadline:
                timed_out.set()
            with lock:
                so_far = read[0]
            report(_said(status, so_far, clock.monotonic() - t0, "", True))
    stopped = "aborted" if stop.is_set() else "timeout" if timed_out.is_set() else ""
    return _said(status, read[0], clock.monotonic() - t0, stopped, False)


def _said(s: WarmStatus, read: int, took: float, stopped: str, under_way: bool) -> WarmStatus:
    rate = f" at {read / took / GB:.2f} GB/s" if took > 0 and read else ""
    text = (
        f"warmed {read / GB:.2f} of {s.bytes / GB:.2f} GB ({s.files} files) in {took:.1f} s{rate}"
    )
    if under_way:
        text = f"warming the page cache: {read / GB:.2f} of {s.bytes / GB:.2f} GB"
    if stopped == "aborted":
        text += "; stopped: the switch goes on without waiting for it"
    elif stopped == "timeout":
        text += "; stopped at warm.timeout_s"
    if s.skipped:
        text += (
            f"; skipped {len(s.skipped)} file(s), {s.skipped_bytes / GB:.2f} GB: they do not fit "
            f"in warm.max_ram_share of MemAvailable ({s.budget_bytes / GB:.2f} GB); vLLM reads "
            "them from disk"
        )
    return s.model_copy(
        update={"read_bytes": read, "took_s": round(took, 2), "stopped": stopped,
                "under_way": under_way, "text": text}
    )  # fmt: skip
