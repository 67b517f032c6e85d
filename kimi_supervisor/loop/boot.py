"""Boot: the persisted state read back, the GPU driver waited for, the baseline resolved.

The loop calls these while BOOTING (and `resolve_baseline` again after a CLEAN teardown while the
baseline is provisional); each returns at once, and the loop retries on its own deadline.
"""

from __future__ import annotations

import functools
from pathlib import Path

from kimi_supervisor.loop.context import Context
from kimi_supervisor.loop.observer import PROVISIONAL_BASELINE_MIB
from kimi_supervisor.model import utcnow
from kimi_supervisor.ports.gpu import GpuUnavailable
from kimi_supervisor.store import baseline
from kimi_supervisor.store.state import (
    Baseline,
    StateError,
    StateStore,
    replaced,
    with_baseline,
)


def load_state(ctx: Context) -> None:
    """The desired mode, profile expiry and an interrupted transition, from state.json. A
    corrupt file is moved aside (StateStore.read) and recorded loudly; defaults are used.
    Nothing is answered before this (cli/run.py): status never shows a mode not yet read."""
    s = ctx.s
    # On the state folder's process: a frozen folder fails the start at state.timeout_s
    # (StateError: cli/run.py exits, systemd starts it again), never wedges it.
    try:
        st, warning = ctx.disk.call(
            functools.partial(StateStore.read_settled, ctx.store), f"reading {ctx.store.path}"
        )
    except OSError as e:  # TimeoutError, its process gone, the folder unreadable
        raise StateError(f"cannot read the state, so no mode to serve: {e}") from e
    ctx.saved, ctx.saved_stamp = st, ctx.stamp()
    if warning:
        ctx.warn(warning)
        ctx.log("state_file_corrupt", level="error", message=warning)
        ctx.incident({"at": utcnow().isoformat(), "what": warning})
        # Guarded: a full disk keeps the defaults in memory, says so, and writes at each pass.
        ctx.persist(functools.partial(replaced, st))
    s.desired = st.desired_mode
    s.profile_until = st.profile_until
    s.interrupted = st.transition
    s.inherited_id = st.transition.id if st.transition else ""
    if st.transition is not None:
        ctx.log("transition_interrupted", transition=st.transition.model_dump(mode="json"))


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

        s.baselines, fresh = baseline.resolve(ctx.gpu, s.indices, fixed, c.state.dir, stored)
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
