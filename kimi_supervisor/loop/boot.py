"""Boot: the persisted state read back, the GPU driver waited for, the baseline resolved.

The loop calls these while BOOTING (and `resolve_baseline` again after a CLEAN teardown while the
baseline is provisional); each returns at once, and the loop retries on its own deadline.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kimi_supervisor.loop.context import Context
from kimi_supervisor.loop.observer import PROVISIONAL_BASELINE_MIB
from kimi_supervisor.model import Mode, utcnow
from kimi_supervisor.ports.bounded import IoWorker, ProcessGone
from kimi_supervisor.ports.gpu import GpuUnavailable
from kimi_supervisor.status import RolledBackStatus
from kimi_supervisor.store import baseline
from kimi_supervisor.store.state import (
    Baseline,
    StateError,
    StateStore,
    replaced,
    with_baseline,
)

# How often a start that waits for its state folder looks whether it answered, or a stop came.
STATE_POLL_S = 0.5
STOPS = {signal.SIGTERM, signal.SIGINT}
STOPPED = "stopped while waiting for the state folder"


T = TypeVar("T")


def on_the_state_folder(
    disk: IoWorker,
    call: Callable[[], T],
    what: str,
    *,
    say: Callable[[str], None],
    log: Callable[..., None],
) -> T:
    """`call` on the state folder's process, at the daemon's start, waited for as long as the
    folder takes: a frozen or hung folder (an fsfreeze, a hung NFS server, a lock held by a
    write stuck in the kernel) is waited for here, said in the unit's status and the log,
    never an exit (systemd's restarts would hit their start limit in about 2 minutes, and the
    unit stay down after the folder answered). The call given up on at state.timeout_s is
    left in its scope; its late answer is taken; if its process died, it is asked again.
    Bounded by the unit's TimeoutStartSec, and by a stop: SIGTERM or SIGINT (blocked until
    the daemon serves, so seen pending here) ends the wait with StateError. Any other error
    (an untrusted folder) is StateError at once."""
    late: list[T] = []
    began, said = time.monotonic(), False
    pause = threading.Event()  # never set: its wait is the poll's bounded pause
    while True:
        try:
            return disk.call(call, what, on_late=late.append)
        except (TimeoutError, ProcessGone) as e:
            why = str(e)
        except OSError as e:
            raise StateError(f"{what}: {e}") from e
        while True:
            if STOPS & signal.sigpending():
                raise StateError(f"{STOPPED} ({why})")
            waited = time.monotonic() - began
            if not said:
                log("state_folder_waiting", level="error", what=what, error=why)
                said = True
            say(f"waiting for the state folder for {waited:.0f} s: {why}")
            if disk.stuck() is None:
                break
            pause.wait(STATE_POLL_S)
        if late:
            log("state_folder_answered", what=what, waited_s=round(time.monotonic() - began, 1))
            return late[0]
        pause.wait(STATE_POLL_S)  # its process died: asked again, not at once


def load_state(ctx: Context) -> None:
    """The desired mode, profile expiry and an interrupted transition, from state.json. A
    corrupt file is moved aside (StateStore.read) and recorded loudly; defaults are used.
    Nothing is answered before this (cli/run.py): status never shows a mode not yet read."""
    s = ctx.s
    st, warning = on_the_state_folder(
        ctx.disk,
        functools.partial(StateStore.read_settled, ctx.store),
        f"reading {ctx.store.path}",
        say=ctx.notifier.status,
        log=ctx.log,
    )
    ctx.saved, ctx.saved_stamp = st, ctx.stamp()
    if warning:
        ctx.warn(warning)
        ctx.log("state_file_corrupt", level="error", message=warning)
        ctx.incident({"at": utcnow().isoformat(), "what": warning})
        # Guarded: a full disk keeps the defaults in memory, says so, and writes at each pass.
        ctx.persist(functools.partial(replaced, st))
    s.desired = st.desired_mode
    if st.desired_by == "rollback":
        s.rolled_back = last_rollback(ctx)
    s.profile_until = st.profile_until
    s.interrupted = st.transition
    s.inherited_id = st.transition.id if st.transition else ""
    if st.transition is not None:
        ctx.log("transition_interrupted", transition=st.transition.model_dump(mode="json"))


def last_rollback(ctx: Context) -> RolledBackStatus | None:
    """The switch whose rollback set the desired mode, from the history (a daemon restarted or
    re-executed since): a late `kimi-mode wait MODE` still learns that MODE failed. None when
    the history cannot be read in time, or holds none."""
    try:
        records = ctx.read_history(200)
    except (OSError, TimeoutError) as e:
        ctx.log("rollback_not_read", level="warning", error=str(e))
        return None
    for r in reversed(records):
        if r.get("kind") != "transition" or r.get("trigger") == "rollback":
            continue  # the rollback's own switch comes after the one it rolled back
        if r.get("outcome") != "rolled_back":
            return None  # a later switch ended: the rollback is not the last one
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return RolledBackStatus(
                mode=Mode(r["target"]), at=str(r.get("finished_at") or r.get("at") or ""),
                reason=str(r.get("message", "")), transition=str(r.get("id", "")),
            )  # fmt: skip
        return None
    return None


def driver_up(ctx: Context) -> bool:
    """Ask NVML for the GPUs; if it does not answer, the next try is due after a doubling
    interval, up to driver_retry_max_s. Once it answers: the managed indices and the baseline."""
    s = ctx.s
    try:
        n = ctx.gpu.device_count()
        s.indices = list(ctx.config.gpus.managed) or list(range(n))
        ctx.gpu.sample(s.indices)
        for i in range(n):  # asked once here: a driver that hangs later need not answer them
            ctx.gpu.device_path(i)
    except GpuUnavailable as e:
        msg = f"waiting for the GPU driver: {e}"
        s.waiting_for = msg
        ctx.warn(msg)
        s.driver_retry_at = ctx.clock.monotonic() + s.driver_retry_s
        s.driver_retry_s = min(s.driver_retry_s * 2, ctx.config.daemon.driver_retry_max_s)
        return False
    ctx.unwarn("waiting for the GPU driver")
    s.driver_ready, s.waiting_for = True, ""
    resolve_baseline(ctx)
    return True


def resolve_baseline(ctx: Context) -> None:
    """Config, then the state file (same driver), else calibrated now (baseline.resolve);
    with processes on the GPUs and nothing stored, a provisional baseline until they are
    next seen idle (after a CLEAN teardown)."""
    s = ctx.s
    fixed = ctx.config.gpus.baseline_mib
    c = ctx.config
    try:
        # The stored one read on the state folder's worker, bounded by its wait; NVML's
        # calls are bounded by theirs.
        def stored(d: Path) -> Baseline | None:
            return ctx.disk.call(functools.partial(baseline.load, d), "reading the stored baseline")

        s.baselines, fresh = baseline.resolve(
            ctx.gpu, s.indices, fixed, state_dir=c.state.dir, stored_in=stored
        )
    except (baseline.BaselineError, GpuUnavailable, OSError) as e:
        s.baselines = {i: fixed.get(str(i), PROVISIONAL_BASELINE_MIB) for i in s.indices}
        s.baseline_provisional = True
        ctx.warn(
            f"no baseline, and it cannot be measured now ({e}): using "
            f"{PROVISIONAL_BASELINE_MIB} MiB until the GPUs are next idle, then calibrating"
        )
        return
    if fresh is not None:
        # Guarded like every state write: unsaved, it is used from memory and written again
        # at the next pass (a full disk at boot is not a crash loop).
        ctx.persist(functools.partial(with_baseline, baseline=fresh))
    if s.baseline_provisional:
        ctx.log("baseline_calibrated", devices=s.baselines)
    s.baseline_provisional = False
    ctx.unwarn("no baseline")
