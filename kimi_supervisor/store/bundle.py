"""An incident bundle: what the daemon saw at a STUCK, a FAILED or a hang restart, in one
bounded file under the state directory, root's alone. The evidence an operator needs is gone
after the reboot reached for at 3 am (the holders, the kernel's Xid lines, vLLM's last words),
so it is kept at the moment it matters, as data, never as a step of the state machine.

The file (`state.dir/incidents/incident-TIME-TRIGGER.txt`, mode 0600, in a folder of mode 0700)
holds, each part under its own cap (`PART_CAPS`) and the whole under `MAX_BYTES`, a cut said
where it was made:
- the teardown report, and the history's newest records (those not written yet, kept in
  memory, too);
- each holder's /proc entries: `status`, `cgroup`, and the lines of `maps` that map a device
  file (`/dev/nvidia*`: openfiles' rule); a holder that exited, or whose PID now names another
  process (its start time), is said so;
- NVML's view of the managed GPUs (read by the daemon, through its `nvml` process), the health
  last read before a load, and the kernel's Xid lines (ports/gpu.py's reading of them);
- vLLM's last output lines, as the daemon followed them (at a hang: the last before it);
- at a hang, what was read at its verdict, before the teardown lost it: the stacks of every
  vLLM process (ports/stacks.py), NVML's counters and memory of the managed GPUs, and vLLM's
  last /metrics answer.

`make` runs where the daemon's blocking I/O runs (ports/bounded.py: a process of its own, in a
scope of its own), so it takes data and returns what it did. Each /proc read is waited for at
most `PROC_READ_S` on a thread of that process: a read stuck in the kernel (a maps file whose
process holds its mmap lock in a fault on a hung mount) is said, and the rest is written all
the same. Old bundles are pruned to the newest `state.bundles_keep` (store/state.prune). The
file is written as state.json is: a temporary file made with O_EXCL|O_NOFOLLOW in the folder
(opened without following a link, and trusted), fsync, rename, fsync of the folder.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kimi_supervisor.ports import openfiles, processes
from kimi_supervisor.ports.bounded import Worker
from kimi_supervisor.ports.gpu import xid_lines
from kimi_supervisor.store import history
from kimi_supervisor.store.state import Pruned, StateError, prune, untrusted

DIR = "incidents"  # under state.dir
TRIGGERS = ("stuck", "failed", "hang")
NAME = re.compile(r"incident-\d{8}T\d{6}\.\d{6}Z-(?:stuck|failed|hang)\.txt")
_TMP = re.compile(r"\.incident-.*\.(\d+)\.tmp")

# The whole file, at most: a flood of holders, a history of huge records or a kernel log full
# of Xids never fills the state folder (10 bundles kept: 20 MiB at most).
MAX_BYTES = 2 << 20
PART_CAPS = {
    "report": 128 << 10,
    "stacks": 512 << 10,
    "counters": 32 << 10,
    "metrics": 128 << 10,
    "history": 256 << 10,
    "holders": 256 << 10,
    "gpus": 32 << 10,
    "xids": 64 << 10,
    "output": 128 << 10,
}
HISTORY_RECORDS = 30  # the newest records of the history, before the bundle's moment
MAX_HOLDERS = 16  # holders whose /proc is read; the others are named and counted
STATUS_MAX = 8 << 10  # bytes of /proc/PID/status (about 1.5 KiB on Linux 6)
CGROUP_MAX = 4 << 10
MAPS_READ_MAX = 16 << 20  # bytes of /proc/PID/maps read (a CUDA process: about 1 MiB)
MAPS_KEEP_MAX = 32 << 10  # bytes of its device-file lines kept
XID_LINES = 200  # the newest Xid lines
# One /proc read's deadline, on the bundle process's own thread (below). After one passes it,
# every other is not tried (it would wait behind the same lock): said, and the rest written.
PROC_READ_S = 2.0


@dataclass(frozen=True)
class Holder:
    """A process found on a managed GPU: its PID, its start time where known (epoch seconds,
    ProcessDescription's), and why it is named."""

    pid: int
    start_time: float | None
    why: str


@dataclass(frozen=True)
class Bundle:
    """What the loop hands over (plain data): the moment, and what it knows of it."""

    trigger: str  # one of TRIGGERS
    at: str  # ISO time, UTC
    stamp: str  # the time in the file's name: YYYYmmddTHHMMSS.ffffffZ
    reason: str
    unit: str
    state_dir: Path
    keep: int
    report: dict[str, Any] | None = None
    pending: list[dict[str, Any]] = field(default_factory=list)  # history not written yet
    holders: tuple[Holder, ...] = ()
    gpus: list[dict[str, Any]] | str = "not read"  # NVML's view, or why there is none
    gpu_health: dict[str, Any] | None = None
    output_tail: list[str] = field(default_factory=list)
    output_where: str = ""
    # The bundles this daemon wrote before this one, oldest first: a prune keeps them before
    # any other, so that a clock stepped back never makes the newer evidence the one removed.
    recent: tuple[str, ...] = ()
    # What explains a hang, read at its verdict, before the teardown lost it (loop/liveness.py):
    # "stacks" (every vLLM process's), "gpus" (NVML's counters and memory), "metrics" (the
    # last /metrics answer).
    kept: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"incident-{self.stamp}-{self.trigger}.txt"


@dataclass(frozen=True)
class Made:
    """What `make` did: where the bundle is, its size, the parts that were cut, how many older
    bundles are kept and removed, and what could not be read (said in the file too)."""

    path: str
    size: int
    cut: tuple[str, ...]
    pruned: str
    unread: tuple[str, ...] = ()


# -------------------------------------------------------------------- pure: the file's text
def capped(text: str, cap: int, keep_end: bool = False) -> tuple[str, bool]:
    """`text` in at most `cap` bytes (UTF-8), cut at a line's end where one is near, with a
    line that says how much was not kept: its head kept, or with `keep_end` its end (the
    newest lines of a history or an output)."""
    data = text.encode()
    if len(data) <= cap:
        return text, False
    note_room = 120
    room = max(cap - note_room, 0)
    if keep_end:
        part = data[len(data) - room :]
        nl = part.find(b"\n")
        if 0 <= nl < 4096:
            part = part[nl + 1 :]
        note = f"[cut: the first {len(data) - len(part)} bytes not kept (this part's cap: {cap})]"
        return note + "\n" + part.decode(errors="ignore"), True
    part = data[:room]
    nl = part.rfind(b"\n")
    if nl >= 0 and room - nl < 4096:
        part = part[: nl + 1]
    note = f"[cut: the last {len(data) - len(part)} bytes not kept (this part's cap: {cap})]"
    return part.decode(errors="ignore").rstrip("\n") + "\n" + note, True


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with every control character but the newline and the tab as `\\xNN`: an escape
    sequence an unprivileged process put in its name reaches no operator's terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def render(bundle: Bundle, parts: dict[str, str], unread: Sequence[str] = ()) -> bytes:
    """The bundle's bytes: a header, then each part under its cap (`PART_CAPS`), newest lines
    kept where a part is a log; at most MAX_BYTES whatever the parts hold."""
    i = bundle
    caps = ", ".join(f"{k} {v >> 10} KiB" for k, v in PART_CAPS.items())
    head = [
        "kimi-supervisor incident bundle",
        f"trigger:   {i.trigger} ({_TRIGGER_SAYS.get(i.trigger, i.trigger)})",
        f"at:        {i.at}",
        f"reason:    {i.reason}",
        f"unit:      {i.unit}",
        f"host:      {socket.gethostname()}",
        f"caps:      this file at most {MAX_BYTES >> 10} KiB; each part its own ({caps}); a "
        "part cut says so",
    ]
    for u in unread:
        head.append(f"unread:    {u}")
    out = ["\n".join(head)]
    cut: list[str] = []
    for key, title in _PARTS:
        text, was_cut = capped(parts.get(key, "(none)"), PART_CAPS[key], key in _NEWEST_LAST)
        if was_cut:
            cut.append(key)
        out.append(f"== {title} ==\n{text.rstrip()}")
    if cut:
        out.insert(1, f"cut:       {', '.join(cut)}")
    out.append("== end of the bundle ==\n")
    # What a holder named itself (its comm, a cgroup, a mapped file's name) or vLLM printed is
    # anyone's text: its control characters are shown escaped, never sent to a terminal.
    data = printable("\n\n".join(out)).encode()
    if len(data) > MAX_BYTES:  # the parts' caps add up to less: a guard, said if it bites
        end = f"\n[cut: the file passed its cap of {MAX_BYTES} bytes]\n".encode()
        data = data[: MAX_BYTES - len(end)] + end
    return data


def cut_parts(data: bytes) -> tuple[str, ...]:
    """The parts a rendered bundle says were cut."""
    for line in data.split(b"\n", 20)[:20]:
        if line.startswith(b"cut:"):
            return tuple(p.strip() for p in line[4:].decode().split(","))
    return ()


_TRIGGER_SAYS = {
    "stuck": "a teardown ended STUCK: the GPUs are not clean",
    "failed": "FAILED: not retried until an operator asks",
    "hang": "vLLM was found hung and restarted",
}
_PARTS = (
    ("report", "the teardown report (JSON)"),
    ("stacks", "vLLM's processes: their stacks at the hang's verdict, before the teardown"),
    ("counters", "the managed GPUs at the hang's verdict: NVML's counters and memory"),
    ("metrics", "vLLM's last /metrics answer before the hang's verdict"),
    ("history", f"the history: its newest {HISTORY_RECORDS} records, oldest first (JSON lines)"),
    ("holders", "the holders: their /proc entries"),
    ("gpus", "the managed GPUs: NVML's view, and their health as last read before a load"),
    ("xids", "the kernel's Xid lines (this boot)"),
    ("output", "vLLM's last output lines, as the daemon followed them"),
)
_NEWEST_LAST = {"history", "xids", "output"}


def report_part(report: dict[str, Any] | None) -> str:
    return json.dumps(report, indent=1) if report is not None else "(no teardown report)"


def history_part(lines: Sequence[str], pending: Sequence[dict[str, Any]]) -> str:
    out = list(lines)
    out += [json.dumps(p) + "  (not written to the history yet)" for p in pending]
    return "\n".join(out) if out else "(no record)"


def gpus_part(gpus: list[dict[str, Any]] | str, health: dict[str, Any] | None) -> str:
    if isinstance(gpus, str):
        lines = [f"NVML: no reading: {gpus}"]
    else:
        lines = []
        for g in gpus:
            procs = ", ".join(
                f"PID {p['pid']} ({p['kind']}, "
                f"{'?' if p['used_mib'] is None else p['used_mib']} MiB)"
                for p in g["processes"]
            )
            lines.append(
                f"GPU {g['index']}: {g['used_mib']} of {g['total_mib']} MiB used; "
                f"processes: {procs or 'none listed'}"
            )
    lines.append(
        "health (before the last load): "
        + (json.dumps(health) if health is not None else "not read (gpus.health_check = off?)")
    )
    return "\n".join(lines)


def output_part(tail: Sequence[str], where: str) -> str:
    said = f"(the last {len(tail)} lines; all of it: {where})" if where else ""
    return "\n".join([said, *tail]) if tail else f"(no line followed; all of it: {where})"


# -------------------------------------------------------------------- I/O: in the bundle process
_proc: Worker | None = None


def _proc_worker() -> Worker:
    """The bundle process's thread for /proc reads, kept across bundles: once a read is stuck
    in the kernel, the next bundles do not start another behind it."""
    global _proc
    if _proc is None:
        _proc = Worker("bundle-proc", PROC_READ_S)
    return _proc


def _read_head(path: str, cap: int) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read(cap + 1)


def _proc_read(what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """fn() on the /proc thread within PROC_READ_S: its value, or None and why not."""
    try:
        return _proc_worker().call(fn, what), None
    except FileNotFoundError:
        return None, "gone (the process exited)"
    except ProcessLookupError:
        return None, "gone (the process exited)"
    except OSError as e:
        return None, str(e)


def holder_part(h: Holder) -> str:
    """One holder's /proc entries, read now, as a person reads them: said whether it is still
    the process named (its start time), and whether it exited while it was read."""
    head = f"-- PID {h.pid}: {h.why}"
    ref = processes.ref_of(h.pid)
    if ref is None:
        return f"{head}\n(gone: exited before it was read)"
    start = processes.start_time_epoch(ref)
    if h.start_time is not None and abs(start - h.start_time) > 0.005:
        return (
            f"{head}\n(not read: PID {h.pid} now names another process, started at {start:.2f}, "
            f"not at {h.start_time:.2f})"
        )
    known = (
        ""
        if h.start_time is not None
        else "; not known when it was named: a later process may hold the PID now"
    )
    out = [f"{head} (started at {start:.2f}, epoch seconds{known})"]
    base = f"{processes.PROC}/{h.pid}"
    for name, cap in (("status", STATUS_MAX), ("cgroup", CGROUP_MAX)):
        raw, why = _proc_read(
            f"reading {base}/{name}", functools.partial(_read_head, f"{base}/{name}", cap)
        )
        if raw is None:
            out.append(f"{name}: not read: {why}")
            continue
        text = raw[:cap].decode(errors="backslashreplace").rstrip("\n")
        more = " (cut)" if len(raw) > cap else ""
        out.append(f"{name}{more}:\n" + "\n".join(f"  {x}" for x in text.splitlines()))
    got, why = _proc_read(
        f"reading {base}/maps",
        functools.partial(openfiles.device_maps_lines, h.pid, MAPS_READ_MAX, MAPS_KEEP_MAX),
    )
    if got is None:
        out.append(f"maps of device files: not read: {why or 'unreadable'}")
    else:
        lines, dropped, rest = got
        notes = []
        if dropped:
            notes.append(f"{dropped} bytes of such lines not kept (cap {MAPS_KEEP_MAX})")
        if rest:
            notes.append(f"maps read only to its first {MAPS_READ_MAX >> 20} MiB")
        note = f" ({'; '.join(notes)})" if notes else ""
        out.append(f"maps of device files ({len(lines)} lines){note}:")
        out += [f"  {x}" for x in lines] or ["  (none)"]
    if processes.ref_of(h.pid) != ref:
        out.append("(it exited while it was read: what was read is kept)")
    return "\n".join(out)


def holders_part(holders: Sequence[Holder]) -> str:
    if not holders:
        return "(no process holds a managed GPU, as the report and NVML say)"
    shown = holders[:MAX_HOLDERS]
    out = [holder_part(h) for h in shown]
    if len(holders) > MAX_HOLDERS:
        rest = ", ".join(str(h.pid) for h in holders[MAX_HOLDERS:])
        out.append(
            f"({len(holders) - MAX_HOLDERS} more not read, the cap is {MAX_HOLDERS}: {rest})"
        )
    return "\n\n".join(out)


def make(bundle: Bundle) -> Made:
    """Collect what is read here (the history, the holders' /proc, the Xid lines), write the
    bundle, prune the older ones. StateError when it cannot be written (the folder untrusted,
    a link where the folder should be, a full or read-only disk); what cannot be read is said
    in the file, never a reason not to write it."""
    i = bundle
    unread: list[str] = []
    try:  # the folder this is written to: one that hangs holds the write all the same
        lines, _ = history.read_lines(i.state_dir, HISTORY_RECORDS, PART_CAPS["history"])
        hist = [line.decode(errors="backslashreplace") for line in lines]
    except (OSError, ValueError) as e:
        hist = []
        unread.append(f"the history: {e}")
    xids, xcut = xid_lines(XID_LINES)
    if xids is None:
        xid_text = "(not read: neither the kernel's log nor this boot's journal can be read)"
        unread.append("the kernel's Xid lines")
    else:
        more = f"\n[cut: only the newest {XID_LINES} lines, or some not read]" if xcut else ""
        xid_text = ("\n".join(xids) or "(no Xid line this boot)") + more
    at_hang = "(read only at a hang's verdict, before its teardown)"
    parts = {
        "report": report_part(i.report),
        "stacks": i.kept.get("stacks", at_hang),
        "counters": i.kept.get("gpus", at_hang),
        "metrics": i.kept.get("metrics", at_hang),
        "history": history_part(hist, i.pending),
        "holders": holders_part(i.holders),
        "gpus": gpus_part(i.gpus, i.gpu_health),
        "xids": xid_text,
        "output": output_part(i.output_tail, i.output_where),
    }
    data = render(i, parts, unread)
    path, pruned = write(i.state_dir, i.name, data, keep=i.keep, recent=i.recent)
    return Made(str(path), len(data), cut_parts(data), pruned.says("bundle"), tuple(unread))


def _open_dir(state_dir: Path, make_it: bool) -> int:
    """The bundles' folder, opened without following a link and judged on its descriptor:
    the daemon's user's, nobody else's to write (StateError otherwise). Made (0700) if missing
    and `make_it`; a folder of the daemon's others may read is made root-only."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        sfd = os.open(state_dir, flags)
    except OSError as e:
        raise StateError(f"cannot open the state directory {state_dir}: {e}") from e
    try:
        problem = untrusted(os.fstat(sfd), str(state_dir))
        if problem:
            raise StateError(f"refusing the state directory: {problem}")
        if make_it:
            with contextlib.suppress(FileExistsError):
                os.mkdir(DIR, 0o700, dir_fd=sfd)
        try:
            dfd = os.open(DIR, flags, dir_fd=sfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a link or a file where it should be
                link = False
                with contextlib.suppress(OSError):
                    link = stat.S_ISLNK(os.stat(DIR, dir_fd=sfd, follow_symlinks=False).st_mode)
                raise StateError(
                    f"{state_dir / DIR} is {'a symlink' if link else 'not a directory'}: remove "
                    "it (bundles are never written through a link)"
                ) from None
            raise StateError(f"cannot open {state_dir / DIR}: {e}") from e
    finally:
        os.close(sfd)
    st = os.fstat(dfd)
    problem = untrusted(st, str(state_dir / DIR))
    if problem:
        os.close(dfd)
        raise StateError(f"refusing the bundles' folder: {problem}")
    if st.st_mode & 0o077:
        with contextlib.suppress(OSError):
            os.fchmod(dfd, 0o700)
    return dfd


def write(
    state_dir: Path, name: str, data: bytes, *, keep: int, recent: Sequence[str] = ()
) -> tuple[Path, Pruned]:
    """The bundle `name`, whole or not at all (root's alone: 0600), then the older ones pruned
    to the newest `keep`: `recent` (this daemon's own, oldest first) and `name` first, then by
    the time in their names. StateError when it cannot be written."""
    dfd = _open_dir(state_dir, make_it=True)
    try:
        _sweep_tmp(dfd)
        tmp = f".{name}.{os.getpid()}.tmp"
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dfd,
            )
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise StateError(f"cannot write {state_dir / DIR / name}: {e}") from e
        pruned = prune(dfd, str(state_dir / DIR), NAME, spare=(*recent, name), keep=keep)
    finally:
        os.close(dfd)
    return state_dir / DIR / name, pruned


def _sweep_tmp(dfd: int) -> None:
    """What a bundle's writer that died mid-write left (its PID no process's now)."""
    with contextlib.suppress(OSError):
        for n in os.listdir(dfd):
            m = _TMP.fullmatch(n)
            if m and (int(m.group(1)) == os.getpid() or not os.path.exists(f"/proc/{m.group(1)}")):
                with contextlib.suppress(OSError):
                    os.unlink(n, dir_fd=dfd)


def newest(state_dir: Path) -> tuple[str, int] | None:
    """The newest bundle there (by the time in its name) and its size; None if none. Asked at
    the daemon's start, so that status names it across restarts."""
    try:
        dfd = _open_dir(state_dir, make_it=False)
    except StateError:
        return None
    try:
        for n in sorted((n for n in os.listdir(dfd) if NAME.fullmatch(n)), reverse=True):
            with contextlib.suppress(OSError):
                st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
                ours = st.st_uid == os.geteuid() and not st.st_mode & 0o077
                if ours and stat.S_ISREG(st.st_mode):  # never a FIFO a `cat` would block on
                    return str(state_dir / DIR / n), st.st_size
        return None
    finally:
        os.close(dfd)


def with_gpus(bundle: Bundle, gpus: list[dict[str, Any]] | str) -> Bundle:
    return replace(bundle, gpus=gpus)
