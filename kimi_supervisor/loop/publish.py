"""The status the loop publishes after each pass, built in one place from the loop state (the
models are plain data in kimi_supervisor/status.py), and its one-line summary.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from kimi_supervisor.decide import downtime, gpuhealth
from kimi_supervisor.model import CMDLINE_CHARS, State, TeardownReport, utcnow
from kimi_supervisor.ports.metrics import Metrics
from kimi_supervisor.status import (
    DaemonInfo,
    DowntimeStatus,
    EtaStatus,
    GpuStatus,
    KillSummary,
    ProgressStatus,
    RemainingSummary,
    Status,
    StuckStatus,
    TeardownSummary,
    TransitionStatus,
    UnitStatus,
)

if TYPE_CHECKING:
    from kimi_supervisor.decide.reconcile import Observed
    from kimi_supervisor.loop.loopstate import LoopState


def status_line(s: LoopState, now: float) -> str:
    """One line: sd_notify's STATUS=, the first line of `kimi-mode status`."""
    tr = s.transition
    if s.state is State.SERVING and s.serving:
        return f"{s.serving.mode.value}: serving (vLLM PID {s.serving.pid})"
    if s.state is State.STUCK and s.stuck_since is not None:
        cause = s.last_failure.reason if s.last_failure else "teardown STUCK"
        cause = cause.removeprefix("teardown STUCK: ")
        head = f"STUCK since {s.stuck_since:%H:%M:%S} UTC ({cause})"
        if s.job is not None:
            return f"{head}: retrying the teardown (retry {s.stuck_retries})"
        wait = max((s.next_attempt_at or now) - now, 0)
        return f"{head}: retry {s.stuck_retries} of the teardown in {wait:.0f} s"
    if s.state is State.WARMING and tr:
        said = s.warm.text if s.warm else "warming the page cache"
        old = f" ({s.serving.mode.value} serves meanwhile)" if s.serving else ""
        return f"switching to {tr.target.value}: {said}{old}"
    if s.state is State.TEARING_DOWN and tr:
        return f"switching to {tr.target.value}: {tr.step}"
    if s.state is State.STARTING and tr:
        eta = eta_said(s, now)[1] if s.eta and s.load_started is not None else None
        return f"switching to {tr.target.value}: {s.progress.describe()}" + (
            f"; {eta}" if eta else ""
        )
    if s.state in (State.BACKOFF, State.STUCK) and s.next_attempt_at is not None:
        wait = max(s.next_attempt_at - now, 0)
        return f"{s.state.value.upper()}: retrying {s.desired.value} in {wait:.0f} s"
    if s.state is State.FAILED:
        cause = f": {s.last_failure.reason}" if s.last_failure else ""
        return f"FAILED: {s.desired.value} gave up{cause}; `kimi-mode {s.desired.value}` retries"
    if s.waiting_for:
        return f"{s.state.value}: {s.waiting_for}"
    if s.state is State.STOPPING and s.job is not None:
        return "stopping: tearing vLLM down"
    return s.state.value


# Lines of vLLM's output the status carries while it loads, and after a vLLM failed (its start,
# or it died or hung): that vLLM's lines, never a switch's old vLLM's.
STATUS_OUTPUT_LINES = 10


def build(
    s: LoopState,
    unit: str,
    gpus: list[GpuStatus],
    *,
    now: float,
    started_at: datetime,
    output: tuple[list[str], str] = ([], ""),
) -> Status:
    """`output`: vLLM's last lines (the daemon passes none unless they say something now) and
    where all of it is read."""
    obs, tr = s.observed, s.transition
    waiting = s.next_attempt_at is not None and s.state in (State.BACKOFF, State.STUCK)
    eta = None
    if s.state is State.STARTING and s.eta is not None and s.load_started is not None:
        elapsed = now - s.load_started
        left, text = eta_said(s, now)
        eta = EtaStatus(
            expected_s=round(s.eta.expected_s, 1),
            remaining_s=left,
            elapsed_s=round(elapsed, 1),
            past_loads=s.eta.past,
            slower_than_past=s.eta.slower(elapsed),
            text=text,
        )
    return Status(
        eta=eta,
        downtime=downtime_status(s, now),
        warm=s.warm if s.transition is not None else None,
        desired_mode=s.desired,
        mode=s.serving.mode if s.serving else None,
        state=s.state,
        state_since=s.state_since.isoformat(),
        status_line=status_line(s, now),
        mode_since=s.serving.since.isoformat() if s.serving else None,
        transition=TransitionStatus.model_validate(tr.model_dump(mode="json")) if tr else None,
        progress=(
            ProgressStatus(
                phase=s.progress.phase, percent=s.progress.percent, text=s.progress.describe()
            )
            if s.state is State.STARTING
            else None
        ),
        unit=UnitStatus(
            name=unit,
            active_state=obs.active_state if obs else "unknown",
            sub_state=obs.sub_state if obs else "unknown",
            load_state=obs.load_state if obs else "unknown",
            main_pid=obs.main_pid if obs else 0,
            running_mode=obs.running_mode.value if obs and obs.running_mode else None,
            argv_stale=bool(obs and obs.argv_stale),
            health=obs.health if obs else -1,
        ),
        gpus=gpus,
        baseline_provisional=s.baseline_provisional,
        last_teardown=teardown_summary(s.last_teardown) if s.last_teardown else None,
        failures_in_window=len(s.failures),
        stuck=(
            StuckStatus(
                since=s.stuck_since.isoformat(),
                retries=max(s.stuck_retries - 1, 0) + (1 if s.job is not None else 0),
                retrying=s.job is not None,
            )
            if s.stuck_since is not None
            else None
        ),
        next_attempt_in_s=(
            round(max(s.next_attempt_at - now, 0.0), 1)
            if waiting and s.next_attempt_at is not None
            else None
        ),
        warnings=list(s.warnings) + unit_file_gone(obs, unit),
        last_intrusion=s.last_intrusion,
        incident_bundle=s.bundle,
        last_failure=s.last_failure,
        rolled_back=s.rolled_back,
        gpu_health=s.gpu_health,
        waiting_for=s.waiting_for or None,
        liveness=s.liveness if s.state is State.SERVING else None,
        profile_until=s.profile_until.isoformat() if s.profile_until else None,
        capture=s.capture.describe() if s.capture else None,
        restart_needed=restart_needed(s),
        output_tail=[] if s.state is State.SERVING else output[0][-STATUS_OUTPUT_LINES:],
        output_where=output[1],
        daemon=DaemonInfo(pid=os.getpid(), started_at=started_at.isoformat()),
    )


def downtime_status(s: LoopState, now: float) -> DowntimeStatus | None:
    """The window under way (so far, the part under way, the rest by past switches'
    parts), else the last one."""
    w, tr = s.watch, s.transition
    # Between attempts (a backoff, FAILED, STUCK) the outage goes on: nothing serves.
    between = s.state in (State.BACKOFF, State.FAILED, State.STUCK) and s.serving is None
    if w is None or (tr is None and not between):
        return s.last_downtime
    record = w.record()
    since = w.at.get("last_ok")
    so_far = round(now - since, 1) if since is not None else None
    # STUCK, or between attempts: no part is under way and nothing says when service is back.
    waiting = s.state is State.STUCK or tr is None
    left = downtime.remaining_s(s.expected_parts, w, now) if s.expected_parts else None
    left = None if waiting else left
    part = None if waiting else w.part_now()
    text = f"unavailable for {so_far:.0f} s" if so_far is not None else "nothing served before"
    if part:
        text += f"; now: {downtime.WORDS[part]}"
    if left is not None:
        text += f"; back in about {left:.0f} s by past switches"
    if waiting:
        text += "; nothing serves, " + {
            State.STUCK: "STUCK: not until the GPUs are clean",
            State.FAILED: f"FAILED: not until `kimi-mode {s.desired.value}`",
        }.get(s.state, f"{s.state.value}: until the next attempt")
    return DowntimeStatus(
        transition=tr.id if tr else "",
        target=tr.target if tr else s.desired,
        under_way=True,
        window_s=so_far,
        part=part,
        parts=record["parts"],
        remaining_s=left,
        at=utcnow().isoformat(),
        text=text,
    )


def eta_said(s: LoopState, now: float) -> tuple[float, str]:
    """While loading: the time left and its words, by the parts of past switches where they
    are known (decide/downtime.py), else by the median of past loads (decide/eta.py)."""
    assert s.eta is not None and s.load_started is not None
    elapsed = now - s.load_started
    left, text = round(s.eta.remaining_s(elapsed), 1), s.eta.describe(elapsed)
    by_parts = downtime.remaining_s(s.expected_parts, s.watch, now) if s.watch else None
    if by_parts is not None and not s.eta.slower(elapsed):
        part = s.watch.part_now() if s.watch else None
        left, now_ = by_parts, downtime.WORDS.get(part or "", "")
        text = (
            f"ready in about {whole_s(by_parts)} (now: {now_})"
            if by_parts >= 0.5  # the estimate ran out: said at once, not "about 0 s"
            else f"past the estimate by past switches (now: {now_})"
        )
    return left, text


def whole_s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def unit_file_gone(obs: Observed | None, unit: str) -> list[str]:
    """A warning while vLLM's unit runs with no file to start it again (systemd reads it
    "not-found", "masked", "bad-setting" or "error")."""
    if obs is None or obs.load_state == "loaded" or not obs.unit_up:
        return []
    return [
        f"{unit} runs with its unit file gone or broken (systemd: {obs.load_state}): vLLM "
        "serves on, but the next start fails; put the file back and run `systemctl daemon-reload`"
    ]


def restart_needed(s: LoopState) -> str | None:
    """What to tell the operator while the serving vLLM runs an earlier config's argv."""
    obs = s.observed
    if s.serving is None or obs is None or not obs.argv_stale:
        return None
    if obs.main_pid != s.serving.pid:
        return None
    mode = s.serving.mode.value
    return (
        f"restart needed: vLLM (PID {s.serving.pid}) runs {mode} with an earlier config's argv; "
        f"run `kimi-mode {mode} --apply` to load it with the config's (a full model load)"
    )


def teardown_summary(r: TeardownReport) -> TeardownSummary:
    return TeardownSummary(
        outcome=r.outcome,
        started_at=r.started_at.isoformat(),
        duration_s=round(r.duration_s, 3),
        kills=[
            KillSummary(
                pid=k.process.pid,
                comm=k.process.comm,
                cmdline=" ".join(k.process.cmdline)[:CMDLINE_CHARS],
                step=k.step.value,
                evidence=k.evidence.value,
                result=k.result,
            )
            for k in r.kills
            if k.signal == "SIGKILL"
        ],
        diagnosis=r.diagnosis,
        next_action=r.next_action,
        remaining=[
            RemainingSummary(
                pid=h.process.pid,
                name=h.process.title(),
                role=h.role,
                devices=h.devices,
                why=h.why,
                check=h.check,
            )
            for h in r.remaining
        ],
    )


def export(m: Metrics, s: LoopState, st: Status, *, uuid: Callable[[int], str]) -> None:
    """The published status, as the metrics say it."""
    m.set_modes(s.desired, s.serving.mode if s.serving else None)
    m.set_state(s.state.value, [x.value for x in State])
    for g in st.gpus:
        m.set_gpu(g.index, uuid(g.index), g.used_mib, baseline_mib=g.baseline_mib)
    if st.gpu_health and not st.gpu_health.gpus:
        m.gpu_health_unread()  # the last reading failed: what an older one said is not known
    for h in st.gpu_health.gpus if st.gpu_health else []:
        i = int(str(h["index"]))
        m.set_gpu_health(i, uuid(i), gpuhealth.dcgm_flags(h))
    m.start_eta.set(st.eta.remaining_s if st.eta else 0)
    m.stuck_since.set(s.stuck_since.timestamp() if s.stuck_since else 0)
    m.stuck_retries.set(st.stuck.retries if st.stuck else 0)
    m.restart_needed.set(1 if st.restart_needed else 0)
    doubts = []
    if s.state is State.SERVING:
        if st.liveness and st.liveness.doubt_since:
            doubts.append(datetime.fromisoformat(st.liveness.doubt_since).timestamp())
        if s.health_doubt_since is not None:
            doubts.append(s.health_doubt_since.timestamp())
    m.liveness_doubt_since.set(min(doubts, default=0))
    if doubts:
        m.set_liveness("doubt")
    elif s.state is State.SERVING and st.liveness is not None and not st.liveness.judging:
        m.set_liveness("progress")
    else:
        m.set_liveness("not_judged")
    d = s.last_downtime
    if d is not None:
        for part, seconds in d.parts.items():
            m.switch_downtime_part.labels(d.target.value, part).set(seconds)
