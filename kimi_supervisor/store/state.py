"""The persisted state: desired mode, the transition in progress, the baseline, and when each
changed, in one file (`state.dir`/state.json).

Writes are atomic: a temporary file in the same directory (created exclusively, never through a
symlink), fsync, rename over the old file, fsync of the directory. Read-modify-write goes through
`update`, under an flock, so the daemon and `kimi-supervisor calibrate` never lose each other's
change. A file that cannot be read as a valid state (truncated, corrupt, a symlink) is moved
aside with a timestamp and the defaults are used (production); the caller reports the warning.
Of the files set aside, the newest KEEP_ASIDE of each kind are kept (`prune_aside`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from kimi_supervisor.model import Mode, utcnow

STATE_VERSION: Literal[1] = 1

# The files set aside of each kind (state.json.outside-TIME, state.json.corrupt-TIME) that are
# kept: an edit made outside the daemon in a loop would otherwise leave one more each pass.
KEEP_ASIDE = 5


_TMP_NAME = re.compile(r"\.state\.json\.(\d+)\.tmp")


class StateError(Exception):
    """The state directory cannot be used (permissions, a full disk); the message says which."""


class Baseline(BaseModel):
    driver_version: str
    calibrated_at: datetime
    devices: dict[int, int]  # GPU index -> MiB


class TransitionRecord(BaseModel):
    """A mode switch in progress: from the start of its teardown until the new mode is ready."""

    id: str
    target: Mode
    previous: Mode | None = None
    kind: Literal["switch", "boot", "recover", "rollback", "retry"] = "switch"
    reason: str = ""
    requested_by: str = ""
    started_at: datetime
    # "teardown", "teardown:<step>" or "starting"
    step: str = "teardown"
    step_changed_at: datetime
    # Set when the unit was started: a daemon restarted mid-load resumes waiting until then.
    start_deadline_at: datetime | None = None

    def finished(
        self, at: datetime, outcome: str, message: str, *, detail: dict[str, Any]
    ) -> dict[str, Any]:
        """The history's record of this transition, ended at `at` with `outcome`."""
        return {
            "id": self.id,
            "target": self.target.value,
            "previous": self.previous.value if self.previous else None,
            "trigger": self.kind,
            "reason": self.reason,
            "requested_by": self.requested_by,
            "started_at": self.started_at.isoformat(),
            "finished_at": at.isoformat(),
            "duration_s": round((at - self.started_at).total_seconds(), 3),
            "outcome": outcome,
            "message": message,
            **detail,
        }


class PersistedState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = STATE_VERSION
    desired_mode: Mode = Mode.PRODUCTION
    desired_changed_at: datetime | None = None
    desired_by: str = "default"
    transition: TransitionRecord | None = None
    transition_changed_at: datetime | None = None
    baseline: Baseline | None = None
    baseline_changed_at: datetime | None = None
    # Timed profile mode: when it expires, production is desired again.
    profile_until: datetime | None = None
    profile_until_changed_at: datetime | None = None


# What only the daemon writes while it runs (kimi-mode's requests, its transitions, profile
# expiry); the baseline is also written by `kimi-supervisor calibrate`.
DAEMON_FIELDS = (
    "desired_mode",
    "desired_changed_at",
    "desired_by",
    "transition",
    "transition_changed_at",
    "profile_until",
    "profile_until_changed_at",
)


def changed_outside(known: PersistedState, found: PersistedState) -> list[str]:
    """The fields only the daemon writes that differ between what it knows and what is found."""
    return [f for f in DAEMON_FIELDS if getattr(known, f) != getattr(found, f)]


def untrusted(st: os.stat_result, what: str) -> str | None:
    """Why a state directory or file must not be trusted, as sshd's StrictModes judges: it is
    owned by another user than the daemon's, or others (or its group) may write it."""
    me = os.geteuid()
    if st.st_uid != me:
        return (
            f"{what} is owned by uid {st.st_uid}, not by the daemon's user (uid {me}): "
            f"`chown {me} {what}`"
        )
    if st.st_mode & 0o022:
        return (
            f"{what} is writable by its group or by others (mode {st.st_mode & 0o7777:o}): "
            f"`chmod go-w {what}`"
        )
    return None


def open_trusted(path: Path, flags: int, mode: int = 0o640) -> int:
    """Open a state file without following a link, and only if the daemon's user owns it and
    nobody else may write it (StateError otherwise)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StateError(
                f"{path} is a symlink: remove it (state files are never followed)"
            ) from None
        raise
    problem = untrusted(os.fstat(fd), str(path))
    if problem:
        os.close(fd)
        raise StateError(f"refusing to use {problem}")
    return fd


@dataclass(frozen=True)
class Pruned:
    """What `prune_aside` did: files of the kind now there, removed, left although old (not the
    daemon's to remove), and why nothing could be done, if so."""

    kept: int = 0
    removed: int = 0
    left: int = 0
    error: str = ""

    def says(self, kind: str) -> str:
        """For a warning: "5 corrupt files kept, the newest; 1 older removed"."""
        if self.error:
            return f"older {kind} files not pruned: {self.error}"
        text = f"{self.kept} {kind} file{'s' if self.kept != 1 else ''} kept, the newest"
        if self.removed:
            text += f"; {self.removed} older removed"
        if self.left:
            text += f"; {self.left} older left, not the daemon's to remove"
        return text


def older_than_newest(names: list[str], spare: str | Sequence[str], keep: int) -> list[str]:
    """Of `names` (each with its time in it, so that their order is their age), those past the
    newest `keep`: what a prune removes. `spare`, the one just made (or the ones this daemon
    made, oldest first, the last just made), is kept before any other, whatever a stepped clock
    named it; of several, the newest `keep` made."""
    made = [spare] if isinstance(spare, str) else list(spare)
    present = set(names)
    kept = [n for n in made if n in present][-max(keep, 1) :]
    others = [n for n in sorted(names, reverse=True) if n not in kept]
    return others[max(keep - len(kept), 0) :]


def prune(
    dfd: int, shown: str, pattern: re.Pattern[str], *, spare: str | Sequence[str], keep: int
) -> Pruned:
    """In the directory open as `dfd` (`shown` is its path), remove the files named by
    `pattern` but the newest `keep` (`older_than_newest`). Only what the daemon made is
    removed: a directory it can trust (the daemon's user's, written by nobody else), each a
    regular file of the daemon's user, looked at and unlinked from the directory's descriptor,
    never through a link. Anything else by such a name is left, and counted. Errors are data: a
    directory that cannot be listed removes nothing."""
    try:
        if untrusted(os.fstat(dfd), shown):
            return Pruned(error=f"{shown} cannot be trusted: nothing removed")
        names = [n for n in os.listdir(dfd) if pattern.fullmatch(n)]
        removed, left = 0, 0
        for name in older_than_newest(names, spare, keep):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    left += 1  # not the daemon's: a link, a FIFO, another user's file
                    continue
                os.unlink(name, dir_fd=dfd)  # the name itself: a link is never followed
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError:
                left += 1
                continue
            removed += 1
        return Pruned(len(names) - removed - left, removed, left)
    except OSError as e:
        return Pruned(error=f"cannot list {shown}: {e}")


class StateStore:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.path = directory / "state.json"
        self.lock_path = directory / "state.lock"

    def _ensure_dir(self) -> None:
        try:
            # Made only when missing: a mkdir, even of what exists, waits for write access to
            # its file system, which a frozen one never gives.
            try:
                st = os.lstat(self.dir)
            except FileNotFoundError:
                self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)
                st = os.lstat(self.dir)
        except OSError as e:
            raise StateError(f"cannot create the state directory {self.dir}: {e}") from e
        if not stat.S_ISDIR(st.st_mode):
            raise StateError(f"the state directory {self.dir} is not a directory (or a symlink)")
        problem = untrusted(st, str(self.dir))
        if problem:
            raise StateError(f"refusing the state directory: {problem}")

    def check(self) -> None:
        """At start: the state directory and its files can be trusted (StateError if not)."""
        self._ensure_dir()
        for name in ("state.json", "state.lock", "history.jsonl"):
            with contextlib.suppress(FileNotFoundError):
                os.close(open_trusted(self.dir / name, os.O_RDONLY))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._ensure_dir()
        fd = open_trusted(self.lock_path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def read(self) -> tuple[PersistedState, str | None]:
        """The state, and a warning if the file was unusable and has been moved aside."""
        self._ensure_dir()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return PersistedState(), None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return PersistedState(), self._move_aside("it is a symlink")
            raise StateError(f"cannot read {self.path}: {e}") from e
        problem = untrusted(os.fstat(fd), str(self.path))
        if problem:
            os.close(fd)
            return PersistedState(), self._move_aside(f"it cannot be trusted: {problem}")
        try:
            with os.fdopen(fd, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise StateError(f"cannot read {self.path}: {e}") from e
        try:
            return PersistedState.model_validate(json.loads(raw)), None
        except (ValueError, ValidationError, RecursionError) as e:  # deep nesting: RecursionError
            first = (str(e).splitlines() or [type(e).__name__])[0][:200]
            return PersistedState(), self._move_aside(f"it is not a valid state ({first})")

    def read_settled(self) -> tuple[PersistedState, str | None]:
        """`read` once no writer holds the lock: a daemon that starts while `kimi-supervisor
        calibrate` is writing boots from what it wrote."""
        with self._locked():
            return self.read()

    def keep_aside(self, tag: str) -> Path:
        """A second name for state.json as it is now (state.json.TAG-TIME), which the next
        write then leaves in place: kept whole, with no moment without a state.json."""
        aside = self.path.with_name(f"state.json.{tag}-{utcnow():%Y%m%dT%H%M%S.%fZ}")
        os.link(self.path, aside, follow_symlinks=False)
        return aside

    def prune_aside(self, tag: str, spare: Path, keep: int = KEEP_ASIDE) -> Pruned:
        """Remove the files set aside as state.json.TAG-TIME but the newest `keep` (by the
        time in their names; `spare`, the one just set aside, is kept whatever a stepped clock
        named it). Only what the daemon made is removed: names it gives, in its own state
        directory (opened without following a link, and trusted), each a regular file of the
        daemon's user, looked at and unlinked from the directory's descriptor, never through a
        link. Anything else by such a name is left, and counted. Errors are data: a directory
        that cannot be listed removes nothing."""
        pattern = re.compile(rf"state\.json\.{re.escape(tag)}-\d{{8}}T\d{{6}}\.\d{{6}}Z")
        try:
            dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            return Pruned(error=f"cannot open {self.dir}: {e}")
        try:
            return prune(dfd, str(self.dir), pattern, spare=spare.name, keep=keep)
        finally:
            os.close(dfd)

    def _move_aside(self, why: str) -> str:
        aside = self.path.with_name(f"state.json.corrupt-{utcnow():%Y%m%dT%H%M%S.%fZ}")
        os.rename(self.path, aside)  # renames a symlink itself, never its target
        pruned = self.prune_aside("corrupt", aside)
        return (
            f"{self.path} was unusable: {why}. Moved to {aside} ({pruned.says('corrupt')}); "
            "starting from defaults (desired mode: production)"
        )

    def write(self, state: PersistedState, proceed: Callable[[], bool] | None = None) -> None:
        """The new state.json, whole or not at all. `proceed`, asked just before the rename
        (the moment the write takes effect): False drops it (StateError), for a writer that
        stopped waiting for it."""
        self._ensure_dir()
        data = state.model_dump_json(indent=2).encode() + b"\n"
        tmp = self.dir / f".state.json.{os.getpid()}.tmp"
        self._sweep_tmp()
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640
            )
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            if proceed is not None and not proceed():
                raise OSError(errno.ECANCELED, "given up by its writer before it took effect")
            os.replace(tmp, self.path)
            dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise StateError(f"cannot write {self.path}: {e}") from e

    def _sweep_tmp(self) -> None:
        """Remove what writers that died mid-write left (`.state.json.PID.tmp` of a PID no
        process has now, or this one's, a predecessor's by the same PID): each write runs in a
        process of its own, so a leftover's PID never comes back to remove it."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            m = _TMP_NAME.fullmatch(name)
            if m is None:
                continue
            pid = int(m.group(1))
            if pid == os.getpid() or not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    os.unlink(self.dir / name)  # a name: never followed, if it is a link

    def update(
        self,
        change: Callable[[PersistedState], PersistedState],
        fallback: PersistedState | None = None,
        proceed: Callable[[], bool] | None = None,
    ) -> tuple[PersistedState, str | None]:
        """Read, change and write under the lock; returns the new state and any read warning.
        A file found unusable (moved aside) is replaced by `fallback` changed, when given: the
        daemon's last known state, so that nothing it holds is lost to a truncated file."""
        with self._locked():
            current, warning = self.read()
            if warning and fallback is not None:
                current = fallback
                warning += "; rewritten from the daemon's state in memory"
            new = change(current)
            self.write(new, proceed)
            return new, warning

    def update_known(
        self,
        change: Callable[[PersistedState], PersistedState],
        known: Known,
        deadline: float | None = None,
    ) -> Written:
        """The daemon's write (`update`, reconciled with what it knows first, see `reconcile`),
        run where its state folder's I/O runs (ports/bounded.py: a process of its own), so it
        takes data and returns what it did. With `deadline` (time.monotonic(), one clock for
        every process of the host), the write is dropped before its rename once the caller has
        stopped waiting for it (an operator's switch refused must not land afterwards)."""
        kept: list[Kept] = []
        gone: list[bool] = []
        proceed = None if deadline is None else functools.partial(_before, deadline)
        new, warning = self.update(
            lambda found: change(self.reconcile(known, found, kept, gone=gone)),
            known.state,
            proceed,
        )
        return Written(new, warning, kept, bool(gone))

    def reconcile(
        self, known: Known, found: PersistedState, kept: list[Kept], *, gone: list[bool]
    ) -> PersistedState:
        """What every write of the daemon first does with the file found (under its lock).

        state.json changed, and not by this daemon: a new baseline (a calibrate) is taken as
        written. What only the daemon writes (DAEMON_FIELDS: the desired mode above all) found
        changed is not taken: the daemon goes on with what it knows, which is what runs; the
        file found is kept beside as state.json.outside-TIME (`kept`), and state.json written
        again from memory. Taking it silently would switch at the next restart, with nobody
        having asked the daemon. Not when the file on disk is known to be behind (a write that
        failed). A file gone since the daemon wrote it (a read of no file gives the defaults) is
        the daemon's memory again, and noted in `gone`."""
        if not self.path.exists():
            if known.written and not known.behind:
                gone.append(True)
                return known.state
            return found
        fields = changed_outside(known.state, found)
        if not fields or known.behind:
            return found
        aside = self.keep_aside("outside")
        pruned = self.prune_aside("outside", aside)
        kept.append(Kept(fields, found.desired_mode, f"{aside} ({pruned.says('outside')})"))
        return found.model_copy(update={f: getattr(known.state, f) for f in DAEMON_FIELDS})


def _before(deadline: float) -> bool:
    return time.monotonic() < deadline


@dataclass(frozen=True)
class Known:
    """What the daemon knows of the state, for a write to reconcile the file found with."""

    state: PersistedState  # what the file holds, as the daemon last read or wrote it
    behind: bool  # the file is known to be behind it (a write failed)
    written: bool  # the daemon has read or written the file since it started


@dataclass(frozen=True)
class Kept:
    """A file changed outside the daemon, set aside: the fields that differed, its mode, where."""

    fields: list[str]
    mode: Mode
    aside: str


@dataclass(frozen=True)
class Written:
    """What a write of the daemon did: the state now on disk, a read warning, the files set
    aside, and whether the file had disappeared."""

    state: PersistedState
    warning: str | None
    kept: list[Kept]
    gone: bool


def same(state: PersistedState) -> PersistedState:
    """A write of the state as it is (reconciled): a change that changes nothing."""
    return state


def replaced(new: PersistedState, _found: PersistedState) -> PersistedState:
    return new


def with_fields(fields: dict[str, Any], state: PersistedState) -> PersistedState:
    return state.model_copy(update=fields)


def with_desired(state: PersistedState, mode: Mode, by: str) -> PersistedState:
    if state.desired_mode is mode:
        return state.model_copy(update={"desired_by": by})
    return state.model_copy(
        update={"desired_mode": mode, "desired_changed_at": utcnow(), "desired_by": by}
    )


def with_transition(state: PersistedState, tr: TransitionRecord | None) -> PersistedState:
    return state.model_copy(update={"transition": tr, "transition_changed_at": utcnow()})


def with_baseline(state: PersistedState, baseline: Baseline) -> PersistedState:
    return state.model_copy(update={"baseline": baseline, "baseline_changed_at": utcnow()})
