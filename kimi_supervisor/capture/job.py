"""One profiler capture, in a thread of its own (a flush can take many minutes):

    POST /start_profile -> record (S seconds, or until stopped) -> POST /stop_profile, waiting for
    the flush while the trace files grow -> the new files moved into the capture's own folder ->
    each rank's trace summarized (summary.json beside them) -> retention of older captures
    (capture/retention.py).

vLLM's /metrics is read at each edge (capture/stall.py): the record says what the capture cost
the clients served meanwhile (tokens/s before, while recording, in the flush and after it, and
the requests that failed).

It reports through the event bus (events carry `capture`: its id) and hands its end to the loop
(`on_done`), which then goes back to production unless told to stay. It changes no daemon state.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_supervisor.analysis import ranks
from kimi_supervisor.capture import retention
from kimi_supervisor.capture.stall import MAX_TOKENS_PER_S, Sample, Stall, sample_of
from kimi_supervisor.capture.tracedir import Listed, Missing, TraceDir, Untrusted
from kimi_supervisor.config import Config
from kimi_supervisor.decide.liveness import MAX_METRICS_BYTES
from kimi_supervisor.messages import End, Event
from kimi_supervisor.model import SUMMARY, CapturePhase, Mode, shown, utcnow
from kimi_supervisor.ports import launcher, safeopen
from kimi_supervisor.ports.gpu import GpuPort, fabric_of
from kimi_supervisor.ports.http import HttpResult, request
from kimi_supervisor.status import CaptureStatus
from kimi_supervisor.vllm_guard import kimi_profile_guard

# A /metrics read at a capture's edge: vLLM's API server answers it while the engine flushes
# (another process); past this, the window is said not measured.
METRICS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CaptureSpec:
    seconds: float | None  # None: until stopped
    then: str  # "production" or "stay"
    out: Path | None
    by: str
    # --out as the asker opened it (passed over the socket): files are created relative to it,
    # so swapping the path for a link later changes nothing, and the daemon's own sandbox
    # (a private /tmp, a read-only /home) does not decide where they land.
    out_fd: int | None = None
    # Who asked (the socket's peer credentials): the folder and the traces are handed to them.
    uid: int = 0
    gid: int = 0
    # The mode vLLM serves in: profile, or production started with the profiler armed.
    mode: Mode = Mode.PROFILE
    # The liveness reading that opens the stall's "before" window (time.monotonic()), or why
    # there is none (capture/stall.pick_before).
    before: Sample | str | None = None
    # The unit's `User=` (None: not known): only its files in the trace folder are vLLM's.
    vllm_uid: int | None = None
    # The most tokens/s the capture's record believes of this vLLM (capture/stall.ceiling_of).
    ceiling: float = MAX_TOKENS_PER_S


def check_out(fd: int, uid: int) -> str | None:
    """Why the --out directory the asker opened and passed cannot be used, or None. The daemon
    runs as root and creates files in it: only a directory the asker owns (root may use any).
    The asker opened it in their own view of the files, through any link of theirs; this checks
    what they reached."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if uid != 0 and st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not by you (uid {uid}): use a directory of your own"
    return None


def _move_into(
    traces: TraceDir, name: str, listed: safeopen.Identity, *, dir_fd: int, uid: int, gid: int
) -> str:
    """`name` in vLLM's trace folder (`traces`, open by descriptor) becomes `name` in the
    capture's folder `dir_fd`, owned by uid:gid. vLLM's user can swap the name at any moment,
    so the file is pinned first (O_PATH, no link followed), judged on that descriptor (the file
    listed, and vLLM's: capture/tracedir.py), and that very inode is linked into the capture's
    folder (through /proc/self/fd: whatever the name holds by then) or, across file systems,
    copied from it; the name in vLLM's folder is removed only while it still holds that inode.
    Returns "" when moved, else why not (said in the capture's record)."""
    try:
        pinned = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=traces.fd)
    except OSError as e:
        return f"gone since it was listed ({e.strerror}); nothing taken"
    try:
        st = os.fstat(pinned)
        if (st.st_dev, st.st_ino) != (listed.dev, listed.ino):
            return "replaced since it was listed; left where it was, not read"
        if why := traces.not_vllms(st):
            return f"{why}; left where it was, not read"
        try:
            os.link(f"/proc/self/fd/{pinned}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            if why := _copy_pinned(pinned, st, name, dir_fd=dir_fd):
                return why
        # The capture's folder is root's until the capture ends: the name made there is ours.
        os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        with contextlib.suppress(OSError):
            now = os.stat(name, dir_fd=traces.fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(name, dir_fd=traces.fd)
        return ""
    finally:
        os.close(pinned)


def _copy_pinned(pinned: int, st: os.stat_result, name: str, *, dir_fd: int) -> str:
    """The inode `pinned` copied as `name` into `dir_fd` (another file system); "" when done,
    else why not."""
    if why := _no_room(st, dir_fd):
        return f"{why}; left where it was, not read"
    try:
        src = os.open(f"/proc/self/fd/{pinned}", safeopen.READ_FLAGS)
    except OSError as e:
        return f"cannot be opened through /proc/self/fd ({e.strerror}); left where it was"
    try:
        again = os.fstat(src)
        if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
            return "changed while it was opened; left where it was, not read"
        os.set_blocking(src, True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(name, flags, 0o640, dir_fd=dir_fd)
        try:
            _copy_sparse(src, out, again.st_size)
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(src)
    return ""


# A trace bigger than this on disk is no vLLM trace: not copied (vLLM's user writes them).
MAX_TRACE_BYTES = 64 << 30
# What a copy leaves free on the capture's file system, at least.
MIN_FREE_SHARE = 0.05


def _no_room(st: os.stat_result, dir_fd: int) -> str:
    """Why a trace is not copied into the folder `dir_fd` ("" if it may be): the blocks it takes
    (its holes stay holes) past MAX_TRACE_BYTES, or past what leaves MIN_FREE_SHARE free."""
    used = st.st_blocks * 512
    if used > MAX_TRACE_BYTES:
        return f"{used / 2**30:.1f} GiB on disk, past {MAX_TRACE_BYTES >> 30} GiB for one trace"
    fs = os.fstatvfs(dir_fd)
    free, reserve = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize * MIN_FREE_SHARE
    if used > free - reserve:
        return f"{used / 1e9:.1f} GB would not fit (the capture's file system has {free / 1e9:.1f})"
    return ""


def _copy_sparse(src: int, out: int, size: int) -> None:
    """`src` into `out`, its data only: a hole is left a hole (a sparse file of a terabyte takes
    no time and no space), at the same offsets."""
    offset = 0
    while offset < size:
        try:
            data = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data past offset: the rest is a hole
                break
            raise
        end = os.lseek(src, data, os.SEEK_HOLE)
        while data < end:
            chunk = os.pread(src, min(1 << 20, end - data), data)
            if not chunk:
                break
            os.pwrite(out, chunk, data)
            data += len(chunk)
        offset = end
    os.ftruncate(out, size)


def explain(r: HttpResult, endpoint: str, timeout_s: float | None) -> str:
    if r.intruder:
        return f"{endpoint} was not asked: {r.error} (the profile guard's secret stays root's)"
    if r.status == 404:
        return (
            f"vLLM answered 404 to {endpoint}: its profiler is not configured (is it running with "
            "--profiler-config? `kimi-mode status` shows the mode)"
        )
    if r.status == 403:
        return (
            f"vLLM's profile guard refused {endpoint} (HTTP 403): the secret of this vLLM's start "
            "is missing or not this start's (a vLLM started by hand, or its secret's file gone): "
            "start the mode again with kimi-mode"
        )
    if r.status >= 500:
        return f"vLLM failed {endpoint} with HTTP {r.status}: {r.body.strip()[:300] or r.error}"
    if r.status == 0:
        limit = f" within {timeout_s:g} s" if timeout_s else ""
        return f"no answer from vLLM to {endpoint}{limit} ({r.error})"
    return f"vLLM answered HTTP {r.status} to {endpoint}: {r.body.strip()[:300]}"


class Capture:
    def __init__(
        self,
        config: Config,
        spec: CaptureSpec,
        publish: Callable[[Event | End], None],
        *,
        on_done: Callable[[Capture], None],
        log: Callable[..., None],
        gpu: GpuPort | None = None,  # the daemon's: the fabric is read from it (fabric.json)
    ) -> None:
        self.gpu = gpu
        self.config = config
        self.spec = spec
        self.publish = publish
        self.on_done = on_done
        self.log = log
        self.started_at = utcnow()
        # The UTC start to the millisecond: folders sort by time and two quick captures differ.
        self.id = f"{self.started_at:%Y%m%dT%H%M%S}.{self.started_at.microsecond // 1000:03d}Z"
        self.phase = CapturePhase.STARTING
        self.stop = threading.Event()
        self.ok = False
        self.message = ""
        self.bytes_written = 0
        self.folder: Path | None = None
        # When vLLM's profiler stopped being at work (the traces saved, or the capture failed):
        # from then on a switch waits no more (CapturePhase.holds_switch), though the summary
        # may still be written. The record carries it beside finished_at.
        self.released_at: datetime.datetime | None = None
        # What the capture cost serving (capture/stall.py), once its last reading is in.
        self.stall: Stall | None = None

    # Set by the loop when liveness finds vLLM hung during the capture (a process stopped on
    # the serving path, a kernel that spins): why; the capture fails with it at once.
    given_up = ""

    def give_up(self, why: str) -> None:
        self.given_up = why

    def _release(self) -> None:
        if self.released_at is None:
            self.released_at = utcnow()

    @property
    def active(self) -> bool:
        return self.phase.active

    def describe(self) -> CaptureStatus:
        return CaptureStatus(
            capture=self.id,
            phase=self.phase,
            started_at=self.started_at.isoformat(),
            seconds=self.spec.seconds,
            then=self.spec.then,
            bytes=self.bytes_written,
            by=self.spec.by,
        )

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name=f"capture-{self.id}").start()

    def _event(self, name: str, **data: Any) -> None:
        self.publish(Event(event=name, at=utcnow(), data={"capture": self.id, **data}))

    def _end(self, ok: bool, message: str, **data: Any) -> None:
        self.ok, self.message = ok, message
        self._release()
        self.phase = CapturePhase.DONE if ok else CapturePhase.FAILED
        self.log(
            "capture_finished",
            level="info" if ok else "warning",
            capture=self.id,
            ok=ok,
            message=message,
            **{k: v for k, v in data.items() if k != "summary"},  # summary.json has it
        )
        self.publish(
            End(
                ok=ok,
                outcome="captured" if ok else "capture_failed",
                message=message,
                data={"capture": self.id, "then": self.spec.then, **data},
            )
        )
        self.on_done(self)

    def _run(self) -> None:
        try:
            self._capture()
        except Exception as e:  # a bug here must not leave the daemon waiting for a flush
            self._end(False, f"the capture failed: {e!r}")
        finally:
            if self.spec.out_fd is not None:
                os.close(self.spec.out_fd)

    def _capture(self) -> None:
        trace_dir = self.config.vllm_trace_dir(self.spec.mode)
        if trace_dir is None:
            self._end(
                False,
                f"the {self.spec.mode.value} mode's --profiler-config names no "
                "torch_profiler_dir: set profiling.vllm_trace_dir to where vLLM writes its traces",
            )
            return
        # Entered once, by descriptor (capture/tracedir.py). vLLM makes the folder at its first
        # flush: one that is not there yet is entered, as judged, after the flush.
        traces: TraceDir | None = None
        with contextlib.ExitStack() as opened:
            try:
                traces = opened.enter_context(TraceDir.open(trace_dir, self.spec.vllm_uid))
            except Missing:
                pass
            except Untrusted as e:
                self._end(False, f"not capturing: {e}. Nothing was asked of vLLM")
                return
            self._record(trace_dir, traces, opened)

    def _record(
        self, trace_dir: Path, traces: TraceDir | None, opened: contextlib.ExitStack
    ) -> None:
        """The capture from /start_profile on, `traces` open (None: the folder is not there
        yet; it is then opened after the flush and closed with `opened`)."""
        p, base = self.config.profiling, self.config.vllm
        before = traces.files() if traces is not None else {}
        url = base.url
        # The secret of this vLLM's start: its profile guard refuses these routes without it.
        token = launcher.read_token(base.argv_file)
        guard = {kimi_profile_guard.HEADER: token} if token else {}
        # vLLM's user's socket only: another's listener on vLLM's address gets no secret.
        peer = self.spec.vllm_uid
        r = request(f"{url}/start_profile", "POST", p.start_timeout_s, headers=guard, peer_uid=peer)
        if not r.ok:
            self._end(False, explain(r, "/start_profile", p.start_timeout_s))
            return
        # Each edge's /metrics read runs on a thread of its own: a slow or silent /metrics never
        # lengthens the recording, delays /stop_profile, or the capture's end past one bound.
        started = _Reading(self, url, peer)
        self.phase = CapturePhase.RECORDING
        self._event("capture_recording", seconds=self.spec.seconds)
        self.stop.wait(self.spec.seconds)
        flushing = _Reading(self, url, peer)
        self.phase = CapturePhase.FLUSHING
        t0 = time.monotonic()
        self._event("capture_flushing")
        result: list[HttpResult] = []
        flush_timeout = p.flush_timeout_s or None
        stopper = threading.Thread(
            target=lambda: result.append(
                request(f"{url}/stop_profile", "POST", flush_timeout, headers=guard, peer_uid=peer)
            ),
            daemon=True,
        )
        stopper.start()
        last = -1
        while stopper.is_alive() and not self.given_up:
            stopper.join(1.0)
            new = self._new_files(traces, before)
            self.bytes_written = sum(f.size for f in new.values())
            if self.bytes_written != last:
                last = self.bytes_written
                self._event(
                    "capture_progress",
                    files=len(new),
                    bytes=self.bytes_written,
                    flushing_s=round(time.monotonic() - t0, 1),
                )
        if self.given_up:  # liveness's verdict (loop/lifecycle): the flush is not waited on
            self._end(False, f"the capture failed: {self.given_up}")
            return
        flushed = time.monotonic() - t0
        flushed_at = _Reading(self, url, peer)
        if not result[0].ok:
            # Whatever readings are in by now: a failed flush is told at once.
            a, b, c = (r.get(max_wait_s=1.0) for r in (started, flushing, flushed_at))
            self.stall = Stall.of(
                (self.spec.before, a, b, c, "no flush"), ceiling=self.spec.ceiling
            )
            self._end(
                False,
                explain(result[0], "/stop_profile", flush_timeout) + "; " + self.stall.line(),
                stall=self.stall.as_dict(),
            )
            return
        after = _Reading(self, url, peer, delay_s=p.stall_after_s) if p.stall_after_s else None
        # The folder vLLM wrote into must be the one judged: named again by its path now.
        try:
            if traces is None:
                traces = opened.enter_context(TraceDir.open(trace_dir, self.spec.vllm_uid))
            elif why := traces.replaced():
                raise Untrusted(why)
        except Untrusted as e:
            a, b, c = (r.get(max_wait_s=1.0) for r in (started, flushing, flushed_at))
            self.stall = Stall.of(
                (self.spec.before, a, b, c, "nothing taken"), ceiling=self.spec.ceiling
            )
            self._end(
                False,
                f"{e}: nothing was taken from it, and vLLM's traces are wherever the path led. "
                f"vLLM's user (uid {self.spec.vllm_uid}) can rename what it owns: choose a "
                "torch_profiler_dir whose parent only root can change (the shipped "
                f"/var/lib/kimi-supervisor/traces); {self.stall.line()}",
                stall=self.stall.as_dict(),
            )
            return
        new = self._new_files(traces, before)
        spec = self.spec
        into_captures_dir = spec.out is None or spec.out_fd is None
        if not into_captures_dir:
            assert spec.out is not None and spec.out_fd is not None
            folder, parent_fd = spec.out / self.id, os.dup(spec.out_fd)
        else:
            p.captures_dir.mkdir(parents=True, exist_ok=True)
            folder = p.captures_dir / self.id
            parent_fd = os.open(p.captures_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.mkdir(self.id, 0o750, dir_fd=parent_fd)
            fd = os.open(self.id, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
        finally:
            os.close(parent_fd)
        if into_captures_dir:
            retention.record(p.captures_dir, self.id)
        files: list[dict[str, Any]] = []
        refused: list[dict[str, str]] = []
        moved: list[str] = []
        summary: dict[str, Any] | None = None
        try:
            for name in sorted(new):
                why = _move_into(traces, name, new[name], dir_fd=fd, uid=spec.uid, gid=spec.gid)
                if why:
                    refused.append({"name": shown(name), "why": why})
                    self.log("capture_file_refused", capture=self.id, name=shown(name), why=why)
                    continue
                rank = ranks.rank_of(name)
                files.append({"name": shown(name), "rank": rank, "bytes": new[name].size})
                moved.append(name)  # as the file system names it: the summary opens these
            os.fchown(fd, spec.uid, spec.gid)
            if (fabric := fabric_of(self.gpu, self.config.gpus.managed)) is not None:
                with contextlib.suppress(OSError):  # the host's links, for the summary
                    ranks.write(fd, fabric, spec.uid, gid=spec.gid, name=ranks.FABRIC)
            if p.summarize and ranks.rank_traces(moved):
                summary = self._summarize(fd, moved)
        finally:
            os.close(fd)
        self.folder = folder
        removed = retention.retention(
            p.captures_dir, p.keep_captures, p.max_total_gb, newest=self.id
        )
        for old in removed:
            self.log("capture_removed", folder=old, why="retention")
        total = sum(f["bytes"] for f in files)
        self._release()
        a, b, c = (r.get() for r in (started, flushing, flushed_at))
        end = self._after(after) if after else "profiling.stall_after_s is 0"
        self.stall = Stall.of((self.spec.before, a, b, c, end), ceiling=self.spec.ceiling)
        self._end(
            True,
            f"{len(files)} trace file(s), {total / 1e6:.1f} MB in {folder} "
            f"(flush took {flushed:.1f} s)"
            + "".join(f"; {r['name']} not taken: {r['why']}" for r in refused)
            + f"; {self.stall.line()}",
            folder=str(folder),
            files=files,
            removed=removed,
            refused=refused,
            flush_s=round(flushed, 1),
            summary=brief(summary),
            stall=self.stall.as_dict(),
        )

    def _after(self, after: _Reading) -> Sample | str:
        """The "after" reading, waited for in a phase that holds no switch (said, with how long
        at most)."""
        if after.pending():
            self.phase = CapturePhase.MEASURING
            self._event("capture_measuring", seconds=round(after.left_s(), 1))
        return after.get()

    def _summarize(self, fd: int, names: list[str]) -> dict[str, Any]:
        """summary.json for the traces just saved. The traces are the capture: a summary that
        cannot be made or written (a full disk) is reported in it, and the capture still ends
        well."""
        self._release()
        self.phase = CapturePhase.SUMMARIZING
        self._event("capture_summarizing", files=len(names))
        summary = ranks.summarize(
            fd, names, safeopen.try_open, timeout_s=self.config.profiling.summary_timeout_s
        )
        try:
            ranks.write(fd, summary, self.spec.uid, gid=self.spec.gid)
        except OSError as e:
            summary["errors"].append({"rank": None, "file": SUMMARY, "error": f"not written: {e}"})
        self._event("capture_summarized", took_s=summary["took_s"])
        return summary

    @staticmethod
    def _new_files(
        traces: TraceDir | None, before: dict[str, Listed]
    ) -> dict[str, safeopen.Identity]:
        """Name -> what the listing saw of the files written since `before`: new ones, and those
        rewritten (vLLM rewrites profiler_out_N.txt, maybe to the same size, on every stop)."""
        if traces is None:
            return {}
        return {n: s[2] for n, s in traces.files().items() if before.get(n) != s}


class _Reading:
    """One /metrics read at a capture's edge (capture/stall.py), on a thread of its own, after
    `delay_s` (the "after" window): the capture goes on meanwhile. `get()` waits for it at most
    until its deadline (the delay, then METRICS_TIMEOUT_S and a second), or `max_wait_s`."""

    def __init__(
        self, capture: Capture, url: str, peer_uid: int | None, *, delay_s: float = 0.0
    ) -> None:
        self.url, self.peer_uid, self.delay_s = url, peer_uid, delay_s
        self.due = time.monotonic() + delay_s + METRICS_TIMEOUT_S + 1
        self.got: Sample | str = f"/metrics: no answer within {METRICS_TIMEOUT_S:g} s"
        self.thread = threading.Thread(target=self._read, daemon=True, name=f"{capture.id}-read")
        self.thread.start()

    def _read(self) -> None:
        if self.delay_s:
            threading.Event().wait(self.delay_s)  # the window's length, not a poll
        # The window's edge is when the reading was asked for, whenever the answer comes: two
        # edges timed by their answers could give a window of less than nothing.
        edge = time.monotonic()
        r = request(
            f"{self.url}/metrics", "GET", METRICS_TIMEOUT_S, max_bytes=MAX_METRICS_BYTES,
            peer_uid=self.peer_uid,
        )  # fmt: skip
        if not r.ok:
            self.got = f"/metrics: {r.error or f'HTTP {r.status}'}"
            return
        self.got = sample_of(r.body, edge)

    def pending(self) -> bool:
        return self.thread.is_alive()

    def left_s(self) -> float:
        return max(self.due - time.monotonic(), 0.0)

    def get(self, max_wait_s: float | None = None) -> Sample | str:
        wait = self.left_s() if max_wait_s is None else min(max_wait_s, self.left_s())
        self.thread.join(wait)
        if self.thread.is_alive():
            return f"/metrics: no answer in time ({METRICS_TIMEOUT_S:g} s)"
        return self.got


def brief(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """The summary as the capture's end message carries it: without the split's per-step rows
    (thousands on a long capture), which stay in summary.json."""
    split = (summary or {}).get("across_ranks")
    if summary is None or not split:
        return summary
    return {**summary, "across_ranks": {k: v for k, v in split.items() if k != "per_step"}}
