"""The pure logic above the ports, driven directly: reconcile's decisions, the state file, the
protocol's parsing, vLLM's start-up progress, durations and capture retention."""

from __future__ import annotations

import argparse
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.capture.retention import oldest_first, record, retention
from kimi_supervisor.cli.kimi_mode import parse_duration
from kimi_supervisor.control.protocol import ProtocolError, SwitchRequest, parse_request
from kimi_supervisor.decide import policy
from kimi_supervisor.decide.progress import Progress, advance
from kimi_supervisor.decide.reconcile import Do, Intent, Memory, Observed, decide
from kimi_supervisor.model import Mode, State
from kimi_supervisor.store.state import PersistedState, StateStore, with_desired

P, R = Mode.PRODUCTION, Mode.PROFILE


def obs(
    active: str = "active", mode: Mode | None = P, health: int = 200, pid: int = 10
) -> Observed:
    return Observed(active, "running", pid if active == "active" else 0, mode, health, True)


def unloaded(load_state: str) -> Observed:
    """Production serving with its unit file moved away or masked, then a daemon-reload."""
    return Observed("active", "running", 10, P, 200, True, load_state=load_state)


@pytest.mark.parametrize(
    ("desired", "mem", "seen", "now", "expect"),
    [
        # a restarted daemon finds the desired mode healthy: adopt, never restart
        (P, Memory(State.BOOTING), obs(), 0, Do.ADOPT),
        (P, Memory(State.SERVING, serving_pid=10), obs(), 0, Do.NOTHING),
        # found loading at boot: wait for it
        (R, Memory(State.BOOTING), obs(mode=R, health=503), 0, Do.RESUME_START),
        # the other mode runs, or an argv that matches no mode, or nothing
        (R, Memory(State.SERVING, serving_pid=10), obs(mode=P), 0, Do.SWITCH),
        (P, Memory(State.BOOTING), obs(mode=None), 0, Do.SWITCH),
        (P, Memory(State.BOOTING), obs(active="inactive", mode=None, health=-1), 0, Do.SWITCH),
        # ... but never a running vLLM whose unit has no file to start it again from
        (R, Memory(State.SERVING, serving_pid=10), unloaded("not-found"), 0, Do.NOTHING),
        (R, Memory(State.SERVING, serving_pid=10), unloaded("masked"), 0, Do.NOTHING),
        # vLLM died while serving, or was replaced behind our back
        (P, Memory(State.SERVING, serving_pid=10), obs(active="failed", health=-1), 0, Do.DIED),
        (P, Memory(State.SERVING, serving_pid=10), obs(pid=11, health=503), 0, Do.DIED),
        # ... replaced and healthy in the desired mode: adopted (level-triggered)
        (P, Memory(State.SERVING, serving_pid=10), obs(pid=11), 0, Do.ADOPT),
        # unhealthy: tolerated within the grace, then restarted
        (
            P,
            Memory(State.SERVING, serving_pid=10, unhealthy_since=0),
            obs(health=0),
            30,
            Do.NOTHING,
        ),
        (
            P,
            Memory(State.SERVING, serving_pid=10, unhealthy_since=0, unhealthy_why="503"),
            obs(health=503),
            61,
            Do.UNHEALTHY,
        ),
        # ... but a slow /health alone, from an API server that is busy, never restarts it
        (
            P,
            Memory(State.SERVING, serving_pid=10, unhealthy_since=0),
            obs(health=0),
            6e4,
            Do.NOTHING,
        ),
        # starting: exited, ready, timed out, still loading
        (P, Memory(State.STARTING, start_deadline=100), obs(active="failed"), 0, Do.START_FAILED),
        (P, Memory(State.STARTING, start_deadline=100), obs(), 0, Do.READY),
        (P, Memory(State.STARTING, start_deadline=100), obs(health=503), 100, Do.START_FAILED),
        (P, Memory(State.STARTING, start_deadline=100), obs(health=503), 99, Do.NOTHING),
        # waiting states retry when due; FAILED waits for an operator
        (P, Memory(State.BACKOFF, next_attempt_at=5), obs(active="inactive"), 4, Do.NOTHING),
        (P, Memory(State.STUCK, next_attempt_at=5), obs(active="inactive"), 5, Do.RETRY),
        (P, Memory(State.FAILED), obs(active="inactive"), 1e9, Do.NOTHING),
    ],
)
def test_reconcile_decides_from_desired_and_observed_alone(
    desired: Mode, mem: Memory, seen: Observed, now: float, expect: Do
) -> None:
    assert decide(desired, mem, seen, now=now, health_grace_s=60).do is expect


def test_the_state_file_round_trips_and_a_corrupt_one_is_moved_aside_loudly(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    assert store.read() == (PersistedState(), None)
    store.update(lambda st: with_desired(st, R, "alice"))
    st, warning = store.read()
    assert st.desired_mode is R and st.desired_by == "alice" and warning is None
    assert not list(tmp_path.glob(".state.json.*"))  # no temporary file left behind

    (tmp_path / "state.json").write_text('{"version": 1, "desired_mo')
    st, warning = store.read()
    assert st.desired_mode is P
    assert warning is not None and "Moved to" in warning
    (aside,) = tmp_path.glob("state.json.corrupt-*")
    assert aside.read_text() == '{"version": 1, "desired_mo'


def test_a_state_file_that_is_a_symlink_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"version": 1, "desired_mode": "profile"}))
    os.symlink(target, tmp_path / "state.json")
    st, warning = StateStore(tmp_path).read()
    assert st.desired_mode is P and warning is not None and "symlink" in warning
    assert target.exists()  # the link was moved aside, its target untouched


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"{", "bad_json"),
        (b'"status"', "bad_request"),
        (b'{"cmd": "reboot"}', "bad_request"),
        (b'{"cmd": "switch", "mode": "turbo"}', "bad_request"),
        (b'{"cmd": "switch", "mode": "profile", "surprise": 1}', "bad_request"),
        (b'{"v": 2, "cmd": "status"}', "unsupported_version"),
        # every number from the wire is finite and bounded
        (b'{"cmd": "switch", "mode": "profile", "for_s": Infinity}', "bad_request"),
        (b'{"cmd": "switch", "mode": "profile", "for_s": NaN}', "bad_request"),
        (b'{"cmd": "switch", "mode": "profile", "for_s": 1e309}', "bad_request"),
        (b'{"cmd": "switch", "mode": "profile", "for_s": 259200000}', "bad_request"),
        (b'{"cmd": "switch", "mode": "profile", "for_s": -1}', "bad_request"),
        (b'{"cmd": "capture", "seconds": Infinity}', "bad_request"),
        (b'{"cmd": "capture", "seconds": 1e300}', "bad_request"),
        (b'{"cmd": "history", "n": 1e400}', "bad_request"),
        (b'{"cmd": "history", "n": 99999999999999999999999}', "bad_request"),
        (b'{"cmd": "capture", "out": "' + b"a" * 5000 + b'"}', "bad_request"),
        # pathological JSON: a nesting deep enough to exhaust the parser's recursion
        (b'{"cmd": "status", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "bad_json"),
    ],
)
def test_malformed_requests_are_named_precisely(line: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as e:
        parse_request(line)
    assert e.value.code == code


def test_a_switch_request_is_parsed_with_its_defaults() -> None:
    r = parse_request(b'{"v": 1, "cmd": "switch", "mode": "profile", "for_s": 7200}')
    assert r == SwitchRequest(mode="profile", follow=True, force=False, for_s=7200)


def test_progress_follows_shards_then_graphs_and_never_goes_back() -> None:
    p = Progress()
    lines = [
        "Loading safetensors checkpoint shards:  25% Completed | 16/64 [00:10<00:30]",
        "Loading safetensors checkpoint shards:  50% Completed | 32/64\r"
        "Loading safetensors checkpoint shards:  75% Completed | 48/64",
        "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 40%|####      | 27/67",
        "Loading safetensors checkpoint shards: 100% Completed | 64/64",  # late line: ignored
        "INFO:     Application startup complete.",
    ]
    seen = []
    for line in lines:
        p = advance(p, line)
        seen.append(p.describe())
    assert seen == [
        "loading safetensors shards 25%",
        "loading safetensors shards 75%",
        "capturing CUDA graphs 40%",
        "capturing CUDA graphs 40%",
        "starting the API server",
    ]


@pytest.mark.parametrize(
    ("text", "seconds"), [("2h", 7200), ("90m", 5400), ("1h30m", 5400), ("45s", 45), ("600", 600)]
)
def test_durations_read_like_an_operator_writes_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["2 hours", "h", "-5", "0", "1x", "3000000d", "367d"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration(text)


def test_retention_keeps_the_newest_captures_and_stays_under_the_size_cap(tmp_path: Path) -> None:
    for i in range(5):
        d = tmp_path / f"20261130T10000{i}.000Z"
        d.mkdir()
        (d / "rank0.pt.trace.json.gz").write_bytes(b"x" * 4096 * (i + 1))  # whole blocks
    removed = retention(tmp_path, keep=3, max_total_gb=0, newest="20261130T100004.000Z")
    assert [Path(r).name[:15] for r in removed] == ["20261130T100000", "20261130T100001"]
    cap_gb = 9 * 4096 / 1e9  # 9 blocks: the newest two fit
    removed = retention(tmp_path, keep=3, max_total_gb=cap_gb, newest="20261130T100004.000Z")
    assert [Path(r).name[:15] for r in removed] == ["20261130T100002"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir())[0][:15] == "20261130T100003"


def test_after_the_clock_steps_back_retention_removes_the_oldest_made_never_the_capture_just_taken(
    tmp_path: Path,
) -> None:
    made = ["20261201T110000.000Z", "20261201T111000.000Z", "20261201T112000.000Z"]
    made += ["20261201T100000.000Z"]  # the clock went back an hour and a half
    for name in made:
        (tmp_path / name).mkdir()
        record(tmp_path, name)
        retention(tmp_path, keep=3, max_total_gb=0, newest=name)
    assert [p.name for p in oldest_first(tmp_path)] == made[1:]
    (tmp_path / "20261201T100500.000Z").mkdir()  # and one more, five minutes later
    record(tmp_path, "20261201T100500.000Z")
    removed = retention(tmp_path, keep=3, max_total_gb=0, newest="20261201T100500.000Z")
    assert [Path(r).name for r in removed] == ["20261201T111000.000Z"]
    # Even when the size cap alone would take it, the capture just taken stays.
    (tmp_path / "20261201T100500.000Z" / "rank0.json").write_bytes(b"x" * 5000)
    assert retention(tmp_path, keep=3, max_total_gb=1e-6, newest="20261201T100500.000Z")
    assert [p.name for p in oldest_first(tmp_path)] == ["20261201T100500.000Z"]


def test_retention_removes_only_capture_folders_never_a_link_or_what_else_is_there(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("not a capture")
    captures_dir = tmp_path / "captures"
    captures_dir.mkdir()
    (captures_dir / "20261201T090000.000Z").symlink_to(outside)  # a link named as a capture
    (captures_dir / "notes").mkdir()
    (captures_dir / "20261201T090000.000Z.bak").mkdir()
    (captures_dir / "20261201T080000.000Z").mkdir()  # made before the order was kept
    for name in ("20261201T100000.000Z", "20261201T110000.000Z"):
        (captures_dir / name).mkdir()
        record(captures_dir, name)
    removed = retention(captures_dir, keep=1, max_total_gb=0, newest="20261201T110000.000Z")
    assert [Path(r).name for r in removed] == ["20261201T080000.000Z", "20261201T100000.000Z"]
    assert (outside / "keep.txt").exists() and (captures_dir / "notes").is_dir()
    assert (captures_dir / "20261201T090000.000Z.bak").is_dir()
    assert (captures_dir / "20261201T090000.000Z").is_symlink()


def test_a_stuck_status_lists_suspects_candidates_and_bystanders_apart_and_the_last_intrusion() -> (
    None
):
    from kimi_supervisor.cli.render import format_status

    def holder(pid: int, role: str, why: str, check: str = "") -> dict[str, object]:
        return {"pid": pid, "name": f"p{pid}", "role": role, "devices": [0], "why": why,
                "check": check}  # fmt: skip

    text = format_status(
        {
            "desired_mode": "profile",
            "state": "stuck",
            "state_since": "2026-11-30T10:00:00+00:00",
            "status_line": "STUCK",
            "unit": {"name": "vllm-kimi-k25.service"},
            "daemon": {"pid": 1, "started_at": "2026-11-30T09:00:00+00:00"},
            "gpus": [],
            "last_teardown": {
                "outcome": "stuck",
                "started_at": "2026-11-30T10:00:00+00:00",
                "duration_s": 12.5,
                "kills": [],
                "diagnosis": "GPU 0: 5615 MiB used",
                "next_action": "check the candidates",
                "remaining": [
                    holder(30, "bystander", "a monitor: maps no device file"),
                    holder(20, "candidate", "maps /dev/nvidia0 with no descriptor", "grep maps"),
                    holder(10, "suspect", "not signalled: protected process name"),
                ],
            },
            "last_intrusion": {"at": "2026-11-30T09:59:00+00:00", "what": "PID 7 took GPU 1"},
        }
    )
    lines = text.splitlines()
    order = [next(i for i, line in enumerate(lines) if w in line) for w in
             ("suspects", "PID 10", "candidates", "PID 20", "check: grep maps", "bystanders",
              "PID 30")]  # fmt: skip
    assert order == sorted(order)
    assert any("last intrusion" in line and "PID 7 took GPU 1" in line for line in lines)


def test_kimi_mode_status_says_a_gpu_health_that_was_not_read_and_says_nothing_when_healthy() -> (
    None
):
    from kimi_supervisor.cli.render import format_status

    base = {
        "desired_mode": "production",
        "state": "serving",
        "state_since": "2026-11-30T10:00:00+00:00",
        "status_line": "serving production",
        "unit": {"name": "vllm-kimi-k25.service"},
        "daemon": {"pid": 1, "started_at": "2026-11-30T09:00:00+00:00"},
        "gpus": [],
    }
    health = {"checked_at": "2026-11-30T09:59:00+00:00", "policy": "warn"}
    unread = {**health, "verdict": "unread", "text": "not read: GPU 0: the GPU: GPU is lost"}
    text = " ".join(format_status({**base, "gpu_health": unread}).split())
    assert "GPU health: unread at " in text
    assert "(before the load; gpus.health_check = warn): not read: GPU 0: the GPU: GPU is lost" in (
        text
    )
    healthy = {**health, "verdict": "healthy", "text": "healthy"}
    assert "GPU health" not in format_status({**base, "gpu_health": healthy})


# -- policy: what the daemon chooses, as tables --

_T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _view(**kw: object) -> policy.AdmissionView:
    base: dict[str, object] = {
        "stopping": False,
        "booting": False,
        "running": None,
        "serving_healthy": None,
        "desired": P,
        "capture_active": False,
    }
    return policy.AdmissionView(**{**base, **kw})  # type: ignore[arg-type]


def _running(target: Mode, queued: bool = False) -> policy.Running:
    return policy.Running(target, _T0, "teardown:stop_unit", "root", queued)


@pytest.mark.parametrize(
    ("case", "mode", "force", "view", "verdict"),
    [
        ("stopping beats everything", R, True, _view(stopping=True, booting=True),
         policy.Admit.REFUSE_STOPPING),
        ("booting", R, False, _view(booting=True), policy.Admit.REFUSE_BOOTING),
        ("same target running: join", R, False, _view(running=_running(R)), policy.Admit.JOIN),
        ("same target, but a take-over queued", R, False,
         _view(running=_running(R, queued=True)), policy.Admit.REFUSE_BUSY),
        ("other target running", P, False, _view(running=_running(R)), policy.Admit.REFUSE_BUSY),
        ("other target running, --force", P, True, _view(running=_running(R)),
         policy.Admit.TAKE_OVER),
        ("serving healthy and desired", P, False, _view(serving_healthy=P),
         policy.Admit.ALREADY),
        ("serving healthy but another mode desired", P, False,
         _view(serving_healthy=P, desired=R), policy.Admit.ACCEPT),
        ("a capture is flushing", P, False, _view(serving_healthy=R, capture_active=True),
         policy.Admit.ACCEPT_AFTER_CAPTURE),
        ("a capture is flushing, --force", P, True, _view(capture_active=True),
         policy.Admit.ACCEPT),
        ("idle", R, False, _view(), policy.Admit.ACCEPT),
    ],
)  # fmt: skip
def test_admission_of_a_switch_request_follows_its_table(
    case: str, mode: Mode, force: bool, view: policy.AdmissionView, verdict: policy.Admit
) -> None:
    assert policy.admit(mode, force, view) is verdict, case


@pytest.mark.parametrize(
    ("case", "apply", "stale", "verdict"),
    [
        ("the config's argv, no --apply", False, False, policy.Admit.ALREADY),
        ("the config's argv, --apply: nothing to restart", True, False, policy.Admit.ALREADY),
        ("an earlier config's argv, no --apply: it goes on serving", False, True,
         policy.Admit.ALREADY),
        ("an earlier config's argv, --apply: restarted", True, True, policy.Admit.ACCEPT),
    ],
)  # fmt: skip
def test_only_apply_restarts_the_serving_mode_and_only_when_it_runs_an_earlier_configs_argv(
    case: str, apply: bool, stale: bool, verdict: policy.Admit
) -> None:
    view = _view(serving_healthy=P, stale=stale)
    assert policy.admit(P, False, view, apply=apply) is verdict, case


@pytest.mark.parametrize(
    ("target", "previous", "rollback", "was_rollback", "back", "then"),
    [
        (R, P, True, False, P, policy.AfterFailedStart.ROLLBACK),
        (R, None, True, False, P, policy.AfterFailedStart.ROLLBACK),  # profile -> production
        (P, None, True, False, None, policy.AfterFailedStart.FAILURE),  # nowhere to go
        (P, R, True, False, R, policy.AfterFailedStart.ROLLBACK),
        (R, P, False, False, P, policy.AfterFailedStart.FAILURE),  # rollback switched off
        (P, R, True, True, R, policy.AfterFailedStart.FAILURE),  # a rollback that failed
    ],
)
def test_a_failed_start_rolls_back_once_or_counts_a_failure(
    target: Mode,
    previous: Mode | None,
    rollback: bool,
    was_rollback: bool,
    back: Mode | None,
    then: policy.AfterFailedStart,
) -> None:
    assert policy.rollback_target(target, previous) is back
    assert policy.after_failed_start(rollback, was_rollback, back) is then


def test_failures_back_off_doubling_within_the_window_then_fail() -> None:
    clock, seen, waits = 1000.0, (), []  # a fake clock: seconds, advanced by hand
    for _ in range(3):
        v = policy.after_failure(
            seen, clock, 60, max_failures=4, backoff_initial_s=5, backoff_max_s=300
        )
        assert not v.failed
        waits.append(v.backoff_s)
        seen, clock = v.failures, clock + 10
    assert waits == [5, 10, 20]
    assert policy.after_failure(
        seen, clock, 60, max_failures=4, backoff_initial_s=5, backoff_max_s=300
    ).failed
    # Failures older than the window are forgotten: the count starts again.
    fresh = policy.after_failure(
        seen, clock + 61 + 30, 60, max_failures=4, backoff_initial_s=5, backoff_max_s=300
    )
    assert not fresh.failed and fresh.failures == (clock + 91,) and fresh.backoff_s == 5
    assert (
        policy.after_failure(
            (), 0, 60, max_failures=10, backoff_initial_s=5, backoff_max_s=12
        ).backoff_s
        == 5
    )
    assert (
        policy.after_failure(
            tuple(range(5)), 5, 60, max_failures=10, backoff_initial_s=5, backoff_max_s=12
        ).backoff_s
        == 12
    )  # capped


def test_a_stuck_teardown_is_retried_doubling_up_to_the_cap() -> None:
    assert [policy.stuck_retry_s(k, 2, 30) for k in range(6)] == [2, 4, 8, 16, 30, 30]
    assert policy.stuck_retry_s(3, 60, 30) == 60  # never below stuck_retry_s itself


@pytest.mark.parametrize(
    ("case", "mem", "seen", "intent", "capture", "expect"),
    [
        ("an operator's switch while serving", Memory(State.SERVING, serving_pid=10), obs(),
         Intent(R, "root"), False, Do.SWITCH),
        ("an operator's switch ends a load under way", Memory(State.STARTING, start_deadline=9),
         obs(health=0), Intent(R, "root"), False, Do.SWITCH),
        ("an operator's switch waits for a capture's flush", Memory(State.SERVING,
         serving_pid=10), obs(), Intent(P, "root"), True, Do.HOLD_FOR_CAPTURE),
        ("... unless --force", Memory(State.SERVING, serving_pid=10), obs(),
         Intent(P, "root", force=True), True, Do.SWITCH),
        ("the daemon's own retry waits for a capture too", Memory(State.STUCK, next_attempt_at=0),
         obs(active="inactive"), None, True, Do.HOLD_FOR_CAPTURE),
        ("a capture never holds back a healthy mode", Memory(State.SERVING, serving_pid=10),
         obs(mode=R), None, True, Do.NOTHING),
    ],
)  # fmt: skip
def test_reconcile_is_asked_for_an_operators_switch_and_reads_force_as_data(
    case: str, mem: Memory, seen: Observed, intent: Intent | None, capture: bool, expect: Do
) -> None:
    desired = intent.mode if intent else R
    assert (
        decide(desired, mem, seen, now=1.0, health_grace_s=60, intent=intent, capture=capture).do
        is expect
    ), case


_FS = policy.AfterFailedStart


@pytest.mark.parametrize(
    ("case", "purpose", "clean", "stopping", "intent", "then", "attempt", "next_"),
    [
        ("stop: clean", policy.Purpose.SHUTDOWN, True, True, False, _FS.FAILURE, 1,
         policy.Next.EXIT),
        ("stop: stuck, tries again", policy.Purpose.SHUTDOWN, False, True, False, _FS.FAILURE, 1,
         policy.Next.SHUTDOWN_AGAIN),
        ("stop: stuck on the last attempt", policy.Purpose.SHUTDOWN, False, True, False,
         _FS.FAILURE, policy.SHUTDOWN_ATTEMPTS, policy.Next.EXIT),
        ("stuck beats everything else", policy.Purpose.SWITCH, False, True, True, _FS.ROLLBACK, 1,
         policy.Next.STUCK),
        ("stopping", policy.Purpose.SWITCH, True, True, True, _FS.FAILURE, 1, policy.Next.STOPPED),
        ("a switch accepted meanwhile", policy.Purpose.START_FAILED, True, False, True,
         _FS.ROLLBACK, 1, policy.Next.TAKE_OVER),
        ("a switch", policy.Purpose.SWITCH, True, False, False, _FS.FAILURE, 1, policy.Next.START),
        ("a failed start, rollback on", policy.Purpose.START_FAILED, True, False, False,
         _FS.ROLLBACK, 1, policy.Next.ROLLBACK),
        ("a failed start, no rollback", policy.Purpose.START_FAILED, True, False, False,
         _FS.FAILURE, 1, policy.Next.FAILURE),
        ("vLLM died", policy.Purpose.DIED, True, False, False, _FS.ROLLBACK, 1,
         policy.Next.FAILURE),
        ("an intrusion", policy.Purpose.INTRUSION, True, False, False, _FS.FAILURE, 1,
         policy.Next.FAILURE),
    ],
)  # fmt: skip
def test_what_follows_a_teardown_follows_its_table(
    case: str,
    purpose: policy.Purpose,
    clean: bool,
    stopping: bool,
    intent: bool,
    then: policy.AfterFailedStart,
    attempt: int,
    next_: policy.Next,
) -> None:
    assert (
        policy.after_teardown(
            purpose, clean, stopping, intent_pending=intent, then=then, attempt=attempt
        )
        is next_
    ), case


@pytest.mark.parametrize(
    ("case", "mode", "for_s", "default_s", "max_s", "hours", "capped"),
    [
        ("production never expires", P, None, 3600, 7200, None, False),
        ("--for", R, 1800, 3600, 7200, 0.5, False),
        ("the default", R, None, 3600, 7200, 1, False),
        ("capped", R, 3 * 3600, 3600, 7200, 2, True),
        ("no default, no --for: no end", R, None, 0, 7200, None, False),
        ("no cap (max 0)", R, 300 * 86400, 0, 0, 300 * 24, False),
    ],
)
def test_timed_profile_mode_ends_as_its_table_says(
    case: str,
    mode: Mode,
    for_s: float | None,
    default_s: float,
    max_s: float,
    hours: float | None,
    capped: bool,
) -> None:
    e = policy.profile_until(mode, for_s, default_s, max_s=max_s, now=_T0)
    got = (e.until - _T0).total_seconds() / 3600 if e.until else None
    assert (got, e.capped) == (hours, capped), case
    if e.until is not None:
        assert not policy.profile_expired(R, e.until, _T0)
        assert policy.profile_expired(R, e.until, e.until)
        assert not policy.profile_expired(P, e.until, e.until)


def test_a_torn_history_tail_is_cut_before_the_next_record_and_nothing_is_glued(
    tmp_path: Path,
) -> None:
    from kimi_supervisor.store import history

    tmp_path.chmod(0o750)
    history.append(tmp_path, "incident", {"what": "first"})
    with open(tmp_path / "history.jsonl", "ab") as f:
        f.write(b'{"kind": "incident", "what": "torn by a full di')  # no newline: torn
    history.append(tmp_path, "incident", {"what": "second"})
    lines = (tmp_path / "history.jsonl").read_bytes().splitlines()
    assert [json.loads(x)["what"] for x in lines] == ["first", "second"]


def test_a_record_tried_again_after_a_try_that_wrote_it_is_in_the_history_once(
    tmp_path: Path,
) -> None:
    """The state folder's process died after its append, before it answered: the daemon
    cannot tell, keeps the record and tries again with `once`. Written once, even across a
    rotation that try caused; a record not there yet, or one that only ends like it, is
    written."""
    from kimi_supervisor.store import history

    tmp_path.chmod(0o750)
    history.append(tmp_path, "incident", {"what": "a"})
    history.append(tmp_path, "incident", {"what": "a"}, once=True)
    history.append(tmp_path, "incident", {"what": "b"}, once=True)
    history.append(tmp_path, "incident", {"x": 1, "what": "a"}, once=True)  # ends the same
    history.append(tmp_path, "incident", {"what": "a"}, once=True)
    assert [(e.get("x"), e["what"]) for e in history.read(tmp_path)] == [
        (None, "a"), (None, "b"), (1, "a"), (None, "a")
    ]  # fmt: skip
    history.append(tmp_path, "incident", {"what": "c", "pad": "x" * 500}, max_bytes=500)
    assert (tmp_path / "history.jsonl.1").exists() and not (tmp_path / "history.jsonl").exists()
    history.append(tmp_path, "incident", {"what": "c", "pad": "x" * 500}, once=True)
    assert [e["what"] for e in history.read(tmp_path)] == ["a", "b", "a", "a", "c"]


def test_history_rotates_at_its_size_keeps_k_files_and_reads_across_them(tmp_path: Path) -> None:
    from kimi_supervisor.store import history

    tmp_path.chmod(0o750)
    for i in range(40):
        history.append(tmp_path, "incident", {"n": i, "pad": "x" * 200}, max_bytes=2000, keep=3)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["history.jsonl", "history.jsonl.1", "history.jsonl.2", "history.jsonl.3"]
    newest = [e["n"] for e in history.read(tmp_path, 12)]
    assert newest == list(range(28, 40))  # across the rotation, oldest first
    everything = [e["n"] for e in history.read(tmp_path)]
    assert everything == sorted(everything) and everything[-1] == 39
    assert len(everything) < 40  # the oldest file was dropped


def test_a_history_file_owned_by_another_user_or_a_link_is_never_appended_to(
    tmp_path: Path,
) -> None:
    from kimi_supervisor.store import history
    from kimi_supervisor.store.state import StateError

    tmp_path.chmod(0o750)
    target = tmp_path / "root-only"
    target.write_text("secret\n")
    (tmp_path / "history.jsonl").symlink_to(target)
    with pytest.raises(StateError, match="symlink"):
        history.append(tmp_path, "incident", {"what": "x"})
    assert target.read_text() == "secret\n"
    (tmp_path / "history.jsonl").unlink()
    (tmp_path / "history.jsonl").write_text("")
    os.chown(tmp_path / "history.jsonl", 65534, 65534)
    with pytest.raises(StateError, match="owned by uid 65534"):
        history.append(tmp_path, "incident", {"what": "x"})


def test_reading_the_newest_lines_of_a_large_history_costs_only_those_lines(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    tmp_path.chmod(0o750)
    line = json.dumps({"kind": "teardown", "pad": "y" * 1000}) + "\n"
    with open(tmp_path / "history.jsonl", "w") as f:
        f.write(line * 30_000)  # about 30 MB
    code = (
        "import resource, sys; from pathlib import Path\n"
        "from kimi_supervisor.store import history\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"assert len(history.read(Path({str(tmp_path)!r}), 20)) == 20\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)"
    )
    grown_kb = int(subprocess.check_output([sys.executable, "-c", code], text=True))
    assert grown_kb < 5_000, f"RSS grew {grown_kb} KiB reading 20 lines of a 30 MB history"


def test_a_start_job_queued_behind_the_units_dependencies_is_waited_for_not_failed() -> None:
    queued = Observed("inactive", "dead", 0, None, -1, True, job="start")
    mem = Memory(State.STARTING, start_deadline=100)
    assert decide(P, mem, queued, now=0, health_grace_s=60).do is Do.NOTHING
    gone = Observed("inactive", "dead", 0, None, -1, True)
    assert decide(P, mem, gone, now=0, health_grace_s=60).do is Do.START_FAILED


def test_the_eta_is_the_median_of_the_newest_loads_of_the_same_mode_and_argv() -> None:
    from kimi_supervisor.decide.eta import argv_key, estimate

    key = argv_key(["vllm", "serve", "m"])

    def load(target: str, s: float, k: str = key, outcome: str = "ready") -> dict[str, object]:
        return {"kind": "transition", "target": target, "outcome": outcome, "load_s": s,
                "argv_key": k}  # fmt: skip

    records = [load("production", 100.0)] + [load("production", s) for s in (1800, 1700, 1900,
               2000, 1750)] + [load("profile", 60.0), load("production", 9.0, k="other"),
               load("production", 5.0, outcome="failed")]  # fmt: skip
    e = estimate(records, "production", key)
    assert e is not None and (e.expected_s, e.slowest_s, e.past) == (1800, 2000, 5)  # not 100
    assert e.describe(600) == "ready in about 20 min (past loads: 30 min)"
    assert e.describe(1900) == "past the estimate: past loads took 30 min"
    assert e.describe(1799.6).startswith("past the estimate")  # never "in about 0 s"
    assert e.describe(2600).startswith("slower than the last 5 load(s): 43 min so far")
    assert estimate(records, "profile", argv_key(["vllm", "serve", "other-model"])) is None


@pytest.mark.parametrize(
    ("tail", "said"),
    [
        # the launcher, with the unit's own exit after it
        (["cannot execute /opt/vllm/bin/vllm: [Errno 2] No such file or directory"],
         ["cannot execute /opt/vllm/bin/vllm: [Errno 2] No such file or directory"]),
        # vLLM 0.16's two tracebacks: the engine's root cause first, the API server's last
        (["INFO 12-01 10:00:00 [api_server.py:1] vLLM API server version 0.16.0",
          "(EngineCore_DP0 pid=7) ERROR 12-01 10:00:09 [core.py:708] EngineCore failed to start.",
          "(EngineCore_DP0 pid=7) Traceback (most recent call last):",
          '  File "core.py", line 699, in run_engine_core',
          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
          "Traceback (most recent call last):",
          "RuntimeError: Engine core initialization failed. See root cause above."],
         ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
          "RuntimeError: Engine core initialization failed. See root cause above."]),
        # no exception: the last line that says error, colours gone
        (["loading", "\x1b[31mERROR\x1b[0m port 18000 is in use", "shutting down"],
         ["ERROR port 18000 is in use"]),
        (["loading weights", "", "bye"], ["bye"]),
        ([], []),
    ],
)  # fmt: skip
def test_a_failed_start_is_explained_by_the_lines_an_operator_looks_for(
    tail: list[str], said: list[str]
) -> None:
    from kimi_supervisor.decide.cause import explain

    assert explain(tail) == said


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens}
vllm:generation_tokens_created{{engine="0",model_name="m"}} 1.7e9
"""


def cpu(at: float, seconds: float, stopped: tuple[str, ...] = (), own: float | None = None) -> Any:
    """The engine's processes at `at`; those `stopped` have used `own` seconds of CPU each
    (0 unless said: a stopped process uses none)."""
    from kimi_supervisor.decide.liveness import Cpu

    return Cpu(at, seconds, 3, stopped, tuple(own or 0.0 for _ in stopped))


def test_vllms_metrics_are_read_with_its_step_counter_and_a_missing_series_is_no_reading() -> None:
    from kimi_supervisor.decide.liveness import Work, parse

    steps = (
        "# TYPE vllm:iteration_tokens_total histogram\n"
        'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 41.0\n'
        'vllm:iteration_tokens_total_count{engine="0"} 41.0\n'
        'vllm:iteration_tokens_total_sum{engine="0"} 900.0\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 3.0\n'
    )
    assert parse(VLLM_METRICS.format(running=2.0, tokens=310.0)) == Work(2.0, 310.0)
    got = parse(VLLM_METRICS.format(running=2.0, tokens=310.0) + steps)
    assert got == Work(2.0, 310.0, waiting=3.0, steps=41.0) and got.pending == 5.0
    assert parse("# nothing of vLLM's\nup 1\n") is None  # --disable-log-stats
    assert parse("not { metrics") is None


# The rule's table (decide/liveness.py), row by row: stall_s 120, 2 % of a core.
def test_requests_pending_with_no_step_and_an_idle_cpu_for_the_stall_time_is_a_hang() -> None:
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    readings = [(0, 100, 10.0), (30, 150, 40.0), (60, 150, 40.1), (149, 150, 40.2)]
    assert all(judge.seen(t, Work(2, k), "ok", cpu=cpu(t, c)) is None for t, k, c in readings)
    hang = judge.seen(150, Work(2, 150), "ok", cpu=cpu(150, 40.3))
    # Tokens came between the readings at 0 and 30 s: the window opens at 0, never after the
    # last progress (by the reading that saw them, it was up to one interval short).
    assert hang is not None and hang.since == 0
    assert hang.reason.startswith("2 running and 0 waiting, and no engine step")
    assert "used 0.30 s of CPU in 120 s" in hang.reason
    assert hang.evidence["since_progress_s"] == 120 and hang.evidence["tokens"] == 150


def test_a_long_step_that_keeps_the_cpu_busy_is_never_a_hang_however_long() -> None:
    """A 4096-token prefill, a guided-decoding step or a capture's flush on the engine's loop:
    no counter moves, the engine's processes work (real vLLM 0.16)."""
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    for t in range(0, 1200, 15):
        assert judge.seen(t, Work(1, 7), "ok", cpu=cpu(t, t * 0.9)) is None
    assert judge.doubt.endswith("but the engine's processes are busy: not hung")


def test_an_engine_busy_for_a_while_then_deadlocked_is_found_a_stall_time_after_it_stopped() -> (
    None
):
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    hangs = [
        judge.seen(t, Work(1, 7), "ok", cpu=cpu(t, min(t, 300) * 0.9)) for t in range(0, 600, 15)
    ]
    first = next(t for t, h in zip(range(0, 600, 15), hangs, strict=True) if h is not None)
    assert 420 <= first <= 435  # 300 s busy, then 120 s flat: not once its average falls


def test_a_stopped_process_with_work_pending_is_a_hang_whatever_the_others_burn() -> None:
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    frozen = ("PID 9 (VLLM::EngineCore, state T)",)
    assert judge.seen(0, Work(1, 7), "ok", cpu=cpu(0, 0, frozen)) is None
    hang = judge.seen(121, Work(1, 7), "ok", cpu=cpu(121, 120.0, frozen))
    assert hang is not None and "stopped: PID 9 (VLLM::EngineCore, state T)" in hang.reason


def test_a_process_paused_at_one_end_only_during_a_long_busy_step_is_no_hang() -> None:
    """py-spy or gdb attached while a long prefill runs: the worker is in state t for a moment,
    the others work. Found by an outside review: 3 false restarts in 7 runs before."""
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    paused = ("PID 9 (VLLM::Worker_TP0, state t)",)
    assert judge.seen(0, Work(1, 7), "ok", cpu=cpu(0, 0)) is None
    assert judge.seen(121, Work(1, 7), "ok", cpu=cpu(121, 110.0, paused)) is None
    assert judge.doubt.endswith("but the engine's processes are busy: not hung")
    # The canary's window too: paused when it was sent, running when it timed out.
    sent = cpu(200, 150.0, paused)
    assert (
        judge.seen(260, Work(0, 7), "ok", cpu=cpu(260, 200.0), canary=(False, 60.0, sent)) is None
    )


def test_nothing_pending_is_never_a_stall_however_long_the_counters_stay() -> None:
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    assert all(
        judge.seen(t, Work(0, 500), "ok", cpu=cpu(t, 0)) is None for t in range(0, 1000, 100)
    )
    assert judge.seen(1000, Work(1, 500), "ok", cpu=cpu(1000, 0)) is None  # a request has just come


def test_an_unanswered_canary_is_a_hang_only_when_the_engine_shows_no_progress_too() -> None:
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    assert judge.seen(0, Work(0, 5), "ok", cpu=cpu(0, 1.0)) is None
    # Load that /metrics does not show (a long prefill began after the last step): busy.
    busy = judge.seen(60, Work(0, 5), "ok", cpu=cpu(60, 50.0), canary=(False, 60.0, cpu(0, 1.0)))
    assert busy is None and judge.doubt.startswith("a one-token request got no answer in 60 s")
    hang = judge.seen(
        120, Work(0, 5), "ok", cpu=cpu(120, 50.1), canary=(False, 60.0, cpu(60, 50.0))
    )
    assert hang is not None and hang.reason.startswith("a one-token request got no answer in 60")
    assert hang.evidence["canary_answered"] is False
    # An answer, even an error, is progress; so is nothing pending.
    assert (
        judge.seen(130, Work(0, 5), "ok", cpu=cpu(190, 50.1), canary=(True, 0.2, cpu(189, 50.1)))
        is None
    )
    assert judge.progress_at == 130


def test_a_canary_waiting_behind_busy_api_servers_is_a_doubt_unless_the_engine_is_stopped() -> None:
    """The engine idle for want of work while its API server tokenizes a long prompt (a quarter
    of a core or more over the canary's wait): a doubt, for one canary. Two in a row with the
    engine flat all along are no tokenization: a deadlock whose clients keep the API server
    busy, a hang. Under the share, or with a process stopped: the engine's flat CPU decides."""
    from kimi_supervisor.decide.liveness import API_BUSY_FRACTION, API_HELD_CANARIES, Judge, Work

    assert API_HELD_CANARIES == 2
    judge = Judge(120, 0.02)
    assert judge.seen(0, Work(0, 5), "ok", cpu=cpu(0, 1.0)) is None
    busy = API_BUSY_FRACTION * 60
    sent = cpu(0, 1.0)
    assert (
        judge.seen(
            60, Work(0, 5), "ok", cpu=cpu(60, 1.0), canary=(False, 60.0, sent), others_s=busy
        )
        is None
    )
    said = "but vLLM's API server(s) used 15.0 s of CPU in 60 s (the canary may wait behind them)"
    assert judge.doubt.endswith(f"{said}: not hung"), judge.doubt
    hang = judge.seen(
        360, Work(0, 5), "ok", cpu=cpu(360, 1.0), canary=(False, 60.0, cpu(300, 1.0)), others_s=busy
    )
    assert hang is not None, "a second canary held behind busy API servers, the engine flat"
    assert "2 canaries in a row waited behind busy API server(s)" in hang.reason
    # An answered canary starts the count again.
    again = Judge(120, 0.02)
    assert again.seen(0, Work(0, 5), "ok", cpu=cpu(0, 1.0)) is None
    assert (
        again.seen(
            60, Work(0, 5), "ok", cpu=cpu(60, 1.0), canary=(False, 60.0, sent), others_s=busy
        )
        is None
    )
    assert (
        again.seen(70, Work(0, 5), "ok", cpu=cpu(70, 1.0), canary=(True, 0.1, cpu(70, 1.0))) is None
    )
    assert (
        again.seen(
            130,
            Work(0, 5),
            "ok",
            cpu=cpu(130, 1.0),
            canary=(False, 60.0, cpu(70, 1.0)),
            others_s=busy,
        )
        is None
    )
    frozen = ("PID 9 (VLLM::EngineCore, state T)",)
    other = Judge(120, 0.02)
    assert other.seen(0, Work(0, 5), "ok", cpu=cpu(0, 1.0, frozen)) is None
    still = (False, 60.0, cpu(0, 1.0, frozen))
    hang = other.seen(60, Work(0, 5), "ok", cpu=cpu(60, 1.0, frozen), canary=still, others_s=busy)
    assert hang is not None and "the engine: stopped: PID 9" in hang.reason
    under = Judge(120, 0.02)
    assert under.seen(0, Work(0, 5), "ok", cpu=cpu(0, 1.0)) is None
    hang = under.seen(
        60, Work(0, 5), "ok", cpu=cpu(60, 1.0), canary=(False, 60.0, sent), others_s=busy - 1
    )
    assert hang is not None and hang.evidence["api_cpu_s"] == busy - 1


def test_without_vllm_series_the_judge_never_reads_idle_and_needs_the_canary_and_the_cpu() -> None:
    """--disable-log-stats: no counters. Saturated (the CPU busy), a canary that waits behind the
    load is no hang; frozen (the CPU flat), it is."""
    from kimi_supervisor.decide.liveness import Judge

    judge = Judge(120, 0.02)
    for t in range(60, 600, 60):
        sent = cpu(t - 60, (t - 60) * 1.5)
        assert (
            judge.seen(t, None, "absent", cpu=cpu(t, t * 1.5), canary=(False, 60.0, sent)) is None
        )
    assert judge.metrics == "absent"
    hang = judge.seen(
        660, None, "absent", cpu=cpu(660, 900.5), canary=(False, 60.0, cpu(600, 900.0))
    )
    assert hang is not None and hang.evidence["metrics"] == "absent"


def test_an_idle_hangs_window_starts_at_the_last_answer_not_at_the_frozen_idle_gauges() -> None:
    """A frozen engine's gauges are frozen: "nothing pending" proves nothing. The window starts
    at the last canary answered (an outside review: 3-4 s reported against 12-14 s seen)."""
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    assert judge.seen(0, Work(0, 5), "ok", cpu=cpu(0, 1.0), canary=(True, 0.1, cpu(0, 1.0))) is None
    for t in range(15, 300, 15):  # idle readings, the gauges at 0
        assert judge.seen(t, Work(0, 5), "ok", cpu=cpu(t, 1.0)) is None
    hang = judge.seen(360, Work(0, 5), "ok", cpu=cpu(360, 1.0), canary=(False, 60.0, cpu(300, 1.0)))
    assert hang is not None and hang.since == 0 and hang.evidence["since_alive_s"] == 360


def test_a_capture_pauses_the_verdict_and_the_stall_counts_again_from_its_end() -> None:
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    assert judge.seen(0, Work(1, 7), "ok", cpu=cpu(0, 0)) is None
    for t in range(15, 300, 15):  # a 285 s flush blocking the engine
        judge.capturing(t, cpu(t, 0))
    assert judge.seen(300, Work(1, 7), "ok", cpu=cpu(300, 0)) is None
    assert judge.seen(419, Work(1, 7), "ok", cpu=cpu(419, 0)) is None
    assert judge.seen(420, Work(1, 7), "ok", cpu=cpu(420, 0)) is not None


def test_unreadable_processes_or_metrics_give_no_verdict() -> None:
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    assert all(judge.seen(t, Work(1, 7), "ok", cpu=None) is None for t in range(0, 600, 15))
    other = Judge(120, 0.02)
    assert other.seen(0, Work(1, 7), "ok", cpu=cpu(0, 0)) is None
    # /metrics too slow: no reading; the stall neither grows into a verdict nor resets.
    assert all(
        other.seen(t, None, "unreachable", cpu=cpu(t, 0)) is None for t in range(15, 600, 15)
    )
    assert other.progress_at == 0


def test_the_holder_steps_note_names_what_it_killed_and_whom_it_spared() -> None:
    from kimi_supervisor.model import Evidence
    from kimi_supervisor.teardown.kills import holders_note

    none = dict.fromkeys(Evidence, 0)
    assert (
        holders_note({**none, Evidence.NVML_LISTED: 2}, set()) == "2 NVML-listed holder(s) killed"
    )
    assert holders_note(none, {41, 7}) == "holder PID 7, 41 protected, not signalled"
    both = holders_note({**none, Evidence.OPEN_AND_MAPPED: 1}, {7})
    assert both == "1 open-and-mapped holder(s) killed; holder PID 7 protected, not signalled"
    assert holders_note(none, set()).startswith("nothing killed: NVML lists no live holder")


# /health failing while serving (daemon.health_grace_s): a slow answer alone restarts nothing.
@pytest.mark.parametrize(
    "health,slow,api,said",
    [
        # vLLM said so itself: 503 once its engine is dead; a refused connection
        (503, False, [], "/health answered 503"),
        (0, False, [], "/health refused the connection"),
        # no answer in time, the API server busy: a blocked event loop doing work
        (0, True, [(0, 10.0), (30, 25.0), (60, 40.0)], ""),
        # ... or not read for a whole window yet: nothing to judge by
        (0, True, [(0, 10.0), (30, 10.0)], ""),
        (0, True, [], ""),
        # ... vLLM's processes idle over the last 60 s (deadlocked), though busy before
        (0, True, [(0, 1.0), (30, 40.0), (60, 40.1), (90, 40.2)], "used 0.20 s of CPU in 60 s"),
        # ... or one stopped throughout the window, whatever the others use
        (0, True, [(0, 1.0, ("PID 7 (api, state T)",)), (60, 60.0, ("PID 7 (api, state T)",))],
         "stopped: PID 7"),
        # ... not one paused at the ends only (a profiler's samples): its own CPU grew
        (0, True, [(0, 1.0, ("PID 7 (api, state t)",), 1.0),
                   (60, 60.0, ("PID 7 (api, state t)",), 30.0)], ""),
        (0, True, [(0, 1.0), (60, 1.0, ("PID 7 (api, state T)",))], "used 0.00 s"),
    ],
)  # fmt: skip
def test_a_failing_health_restarts_vllm_only_with_a_second_sign_of_no_progress(
    health: int, slow: bool, api: list[tuple[Any, ...]], said: str
) -> None:
    from kimi_supervisor.decide.liveness import health_failure

    why = health_failure(health, slow, [cpu(*a) for a in api], window_s=60, idle_fraction=0.05)
    assert (said in why) if said else why == "", why


def test_an_engine_spinning_on_a_gpu_that_never_answers_is_a_doubt_that_lasts_until_progress() -> (
    None
):
    """A worker waiting on a hung collective spins a core (H200: 100 % of one, state R;
    bench/cuda_wait_cpu.py), its gauges frozen idle: each canary goes unanswered with the CPU
    busy. Never a verdict; a doubt, shown and alerted on, from the first canary sent until a
    proof of progress, however many readings come between."""
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    assert judge.seen(0, Work(0, 7), "ok", cpu=cpu(0, 0)) is None
    for t in range(15, 1200, 15):
        canary = (False, 60.0, cpu(t - 60, t - 60.0)) if t % 300 == 0 else None
        assert judge.seen(t, Work(0, 7), "ok", cpu=cpu(t, float(t)), canary=canary) is None
    assert judge.doubt.startswith("a one-token request got no answer in 60 s")
    assert judge.doubt_since == 240  # the first canary's sending
    judge.seen(1215, Work(1, 8), "ok", cpu=cpu(1215, 1215.0))  # a token: progress
    assert judge.doubt == "" and judge.doubt_since is None


def test_a_profiler_that_stops_a_busy_engine_for_each_sample_is_no_hang() -> None:
    """py-spy stops its target for each sample: a busy real EngineCore read in state t in
    44-58 % of reads at 100 Hz (an outside review). Seen stopped at both ends of a window but
    using the CPU in between, it was called hung; only a process whose own CPU stood still
    counts as stopped."""
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.05)
    paused = ("PID 9 (VLLM::EngineCore, state t)",)
    for t in range(0, 600, 15):  # one long step: no counter moves, the engine works
        assert judge.seen(t, Work(1, 7), "ok", cpu=cpu(t, 0.9 * t, paused, own=0.9 * t)) is None
    frozen = ("PID 9 (VLLM::EngineCore, state T)",)
    assert judge.seen(600, Work(1, 7), "ok", cpu=cpu(600, 540.0, frozen, own=540.0)) is None
    hang = judge.seen(721, Work(1, 7), "ok", cpu=cpu(721, 600.0, frozen, own=540.0))
    assert hang is not None and "stopped: PID 9 (VLLM::EngineCore, state T)" in hang.reason


def test_a_process_leaving_the_tree_makes_its_cpu_sum_fall_and_that_says_nothing() -> None:
    from kimi_supervisor.decide.liveness import no_progress

    assert no_progress(cpu(0, 50.0), cpu(60, 49.25), 0.05) == ""
    assert "used 0.50 s" in no_progress(cpu(0, 50.0), cpu(60, 50.5), 0.05)


def test_a_history_record_naming_a_file_in_odd_bytes_is_written_escaped_not_lost(
    tmp_path: Path,
) -> None:
    from kimi_supervisor.store import history

    tmp_path.chmod(0o700)
    name = os.fsdecode(b"tokenizer-\xe9.json")
    history.append(tmp_path, "incident", {"at": "2026-12-03T00:00:00+00:00", "what": name})
    (got,) = history.read(tmp_path, 10)
    assert got["what"] == "tokenizer-\\xe9.json"


def test_a_reading_without_counters_between_two_does_not_shorten_a_hangs_window() -> None:
    """An outside review: counters read at 100, none at 115 (/metrics unreachable),
    moved by 130; the progress may be at 101. The window opens at 100, not 115."""
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    assert judge.seen(100, Work(2, 100), "ok", cpu=cpu(100, 10.0)) is None
    assert judge.seen(115, None, "unreachable", cpu=cpu(115, 11.0)) is None
    assert judge.seen(130, Work(2, 150), "ok", cpu=cpu(130, 12.0)) is None
    assert judge.alive_at == 100


def test_a_sparse_terabyte_in_one_capture_removes_no_other_capture(tmp_path: Path) -> None:
    """Retention counts the blocks a capture takes, not its files' apparent sizes: the asker
    owns their capture and vLLM's user wrote its traces, and either can make a sparse file."""
    made = ["20261201T100000.000Z", "20261201T110000.000Z", "20261201T120000.000Z"]
    for name in made:
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank0.pt.trace.json").write_bytes(b"x" * 4096)
        record(tmp_path, name)
    with open(tmp_path / made[1] / "rank1.pt.trace.json", "wb") as f:
        f.truncate(1 << 40)  # 1 TiB apparent, no block on disk
    assert os.stat(tmp_path / made[1] / "rank1.pt.trace.json").st_blocks == 0
    assert retention(tmp_path, keep=10, max_total_gb=1.0, newest=made[2]) == []
    assert [p.name for p in oldest_first(tmp_path)] == made


def test_a_canarys_verdict_says_what_the_last_reading_of_the_gauges_was_and_how_old() -> None:
    """A canary's reading carries no counters of its own (the readings beside it judged them):
    its verdict shows the last ones read, with their age, so the operator sees the engine
    read idle when the request went unanswered."""
    from kimi_supervisor.decide.liveness import Judge, Work

    judge = Judge(120, 0.02)
    assert judge.seen(0, Work(0, 5, waiting=0), "ok", cpu=cpu(0, 1.0)) is None
    assert judge.seen(50, Work(0, 5), "ok", cpu=cpu(50, 1.0)) is None
    hang = judge.seen(60, None, "ok", cpu=cpu(60, 1.0), canary=(False, 30.0, cpu(30, 1.0)))
    assert hang is not None and "a one-token request got no answer in 30 s" in hang.reason
    seen = hang.evidence
    assert (seen["running"], seen["waiting"], seen["tokens"]) == (0, 0, 5)
    assert seen["work_read_s_ago"] == 10
