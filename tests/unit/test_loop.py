"""The daemon's loop, driven in-process: in-memory ports (tests/unit/loophost.py), a fake clock,
and a real child process as vLLM. The rows of what the loop must do with a switch, a failed
start, a STUCK teardown, a capture and a reload; each runs in a fraction of a second."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.cli.watch import mode_verdict
from kimi_supervisor.loop.inbox import CaptureStart, Reexec, Switch
from kimi_supervisor.model import Mode, State
from kimi_supervisor.ports import processes
from kimi_supervisor.ports.bounded import Worker
from kimi_supervisor.ports.gpu import GpuUnavailable
from kimi_supervisor.ports.launcher import launch_record_path

from .loophost import LoopHost


def booted(host: LoopHost) -> LoopHost:
    host.serving(Mode.PRODUCTION)
    return host


def reexec(host: LoopHost) -> None:
    """The daemon re-executes (`systemctl reload`, an upgrade): its loop ends with the unit
    left running, and a new daemon boots over the same state and history."""
    host.daemon.ask(Reexec())
    host.until(lambda: host.daemon.s.reexec_requested, "the re-exec to be asked")
    assert not host.daemon.turn()  # the loop ends for the re-exec, the unit left running
    host.new_daemon()


def transitions(host: LoopHost) -> list[tuple[str, str]]:
    return [(e["target"], e["outcome"]) for e in host.history("transition")]


def retry_waits(host: LoopHost, state: State, n: int) -> list[int]:
    """How long the loop waits in `state` before each of its next `n` retries (seconds)."""
    waits = []
    s = host.daemon.s
    for _ in range(n):
        host.until(lambda: host.state is state and not s.busy, state.value)
        assert s.next_attempt_at is not None
        waits.append(round(s.next_attempt_at - host.clock.now))
        host.until(lambda: host.state is not state or host.daemon.s.busy, "the retry")
    return waits


def test_the_daemon_boots_into_production_and_serves_it(host: LoopHost) -> None:
    booted(host)
    status = host.status()
    assert status["state"] == "serving" and status["mode"] == "production"
    assert host.systemd.starts == [Mode.PRODUCTION]
    assert transitions(host) == [("production", "ready")]


def test_a_switch_is_followed_by_the_transition_id_its_reply_carries(host: LoopHost) -> None:
    booted(host)
    reply = host.ask(Switch(Mode.PROFILE, "op"))
    assert reply.code == "accepted"
    host.serving(Mode.PROFILE)
    last = host.history("transition")[-1]
    assert last["id"] == reply.data["transition_id"]
    assert (last["target"], last["outcome"], last["requested_by"]) == ("profile", "ready", "op")


def test_during_a_teardown_the_same_mode_joins_the_other_is_refused_and_force_takes_over(
    host: LoopHost,
) -> None:
    booted(host)
    host.systemd.hold = hold = threading.Event()  # the teardown lasts until released
    first = host.ask(Switch(Mode.PROFILE, "alice"))
    host.until(lambda: host.daemon.s.busy, "the teardown to run")
    joined = host.ask(Switch(Mode.PROFILE, "bob"))
    assert joined.code == "joined"
    assert joined.data["transition_id"] == first.data["transition_id"]
    refused = host.ask(Switch(Mode.PRODUCTION, "carol"))
    assert (refused.ok, refused.code) == (False, "busy")
    forced = host.ask(Switch(Mode.PRODUCTION, "dave", force=True))
    assert (forced.ok, forced.code) == (True, "accepted")
    assert host.daemon.s.intent is not None  # the next intent, begun when the teardown ends
    hold.set()
    host.serving(Mode.PRODUCTION)
    ended = {e["id"]: e["outcome"] for e in host.history("transition")}
    assert ended[first.data["transition_id"]] == "preempted"
    assert ended[forced.data["transition_id"]] == "ready"
    assert host.systemd.starts == [Mode.PRODUCTION, Mode.PRODUCTION]  # profile never started


def test_a_failed_start_rolls_back_once_then_backs_off(host: LoopHost) -> None:
    booted(host)
    host.systemd.fail_modes = {Mode.PROFILE}
    host.ask(Switch(Mode.PROFILE, "op"))
    host.serving(Mode.PRODUCTION)  # rolled back to the mode that worked
    assert transitions(host)[-3:] == [
        ("production", "ready"),
        ("profile", "rolled_back"),
        ("production", "ready"),
    ]
    # Now production fails too: its rollback is not rolled back again, but a failure, retried
    # after a backoff that doubles, until FAILED after max_failures (3).
    host.systemd.fail_modes = {Mode.PROFILE, Mode.PRODUCTION}
    host.ask(Switch(Mode.PROFILE, "op"))
    assert retry_waits(host, State.BACKOFF, 2) == [4, 8]
    host.until(lambda: host.state is State.FAILED, "FAILED after max_failures")
    assert host.status()["state"] == "failed"
    assert transitions(host)[3:] == [
        ("profile", "rolled_back"),
        ("production", "failed"),
        ("production", "failed"),
        ("production", "failed"),
    ]
    assert host.systemd.starts[3:] == [Mode.PROFILE] + [Mode.PRODUCTION] * 3


def test_after_a_rollback_the_status_names_the_failed_switch_until_another_is_asked(
    host: LoopHost,
) -> None:
    """A `wait profile` that joins once the rollback is over reads why there: the failed
    start's own `last_failure` is gone as soon as the rolled-back-to mode is ready."""
    booted(host)
    host.systemd.fail_modes = {Mode.PROFILE}
    asked = host.ask(Switch(Mode.PROFILE, "op"))
    host.serving(Mode.PRODUCTION)
    st = host.status()
    back = st["rolled_back"]
    assert (back["mode"], back["transition"]) == ("profile", asked.data["transition_id"]), back
    assert back["reason"].startswith("profile did not become ready ("), back
    assert back["reason"].endswith("; rolling back to production"), back
    assert st["last_failure"] is None  # cleared by production's ready, as before
    host.systemd.fail_modes = set()
    host.ask(Switch(Mode.PROFILE, "op"))
    assert host.status()["rolled_back"] is None  # another switch asked: history now
    host.serving(Mode.PROFILE)


def test_a_rollback_is_still_named_after_the_daemon_re_executes(host: LoopHost) -> None:
    """An outside review: the rollback was kept in memory alone, so after a `systemctl reload`
    (or the restart an upgrade asks for) a late `wait profile` read `not_asked`. The history
    holds it, and the desired mode set by the rollback says it is still the last switch."""
    booted(host)
    host.systemd.fail_modes = {Mode.PROFILE}
    asked = host.ask(Switch(Mode.PROFILE, "op"))
    host.serving(Mode.PRODUCTION)
    reexec(host)
    host.serving(Mode.PRODUCTION)
    back = host.status()["rolled_back"]
    assert back is not None and back["mode"] == "profile", back
    assert back["transition"] == asked.data["transition_id"], back
    assert mode_verdict(host.status(), "profile") is not None  # the verdict: rolled back
    host.systemd.fail_modes = set()
    host.ask(Switch(Mode.PROFILE, "op"))
    host.serving(Mode.PROFILE)
    reexec(host)
    host.serving(Mode.PROFILE)
    assert host.status()["rolled_back"] is None  # a later switch: the rollback is history


def test_stuck_teardowns_are_retried_at_doubling_intervals(host: LoopHost) -> None:
    booted(host)
    host.gpu.extra[1] = 20_000  # held by nothing the teardown may kill
    host.ask(Switch(Mode.PROFILE, "op"))
    assert retry_waits(host, State.STUCK, 3) == [10, 20, 40]
    assert host.systemd.starts == [Mode.PRODUCTION]  # never started on an occupied GPU
    host.gpu.extra[1] = 0
    host.serving(Mode.PROFILE)


def test_stuck_stays_stuck_through_its_retries_and_the_history_keeps_the_operators_switch_in_view(
    host: LoopHost,
) -> None:
    """Before, each retry showed `tearing_down`, so monitoring never saw STUCK for long, and
    the retries' records pushed the operator's own switch out of the history's default view."""
    booted(host)
    host.gpu.extra[1] = 20_000
    host.ask(Switch(Mode.PROFILE, "op"))
    host.until(lambda: host.state is State.STUCK, "STUCK")
    seen: list[tuple[str, int, bool]] = []

    def retried(n: int) -> bool:
        st = host.status()
        assert st["state"] == "stuck" and st["stuck"] is not None, st["status_line"]
        seen.append((st["state"], st["stuck"]["retries"], st["stuck"]["retrying"]))
        return st["stuck"]["retries"] >= n and not st["stuck"]["retrying"]

    host.until(lambda: retried(4), "four retries")
    assert any(retrying for _, _, retrying in seen)  # seen retrying, and stuck all the while
    assert "STUCK since" in host.status()["status_line"]
    history = host.history()
    assert [(e["kind"], e.get("trigger")) for e in history if e["kind"] == "transition"] == [
        ("transition", "boot"),
        ("transition", "switch"),  # the operator's, ended stuck; the retries are counted
    ]
    assert len([e for e in history if e["kind"] == "teardown"]) == 2  # boot's, and the first STUCK
    host.gpu.extra[1] = 0
    host.serving(Mode.PROFILE)
    (incident,) = [e for e in host.history("incident") if "STUCK for" in e["what"]]
    assert incident["retries"] >= 5 and "made them clean" in incident["what"], incident
    assert host.status()["stuck"] is None


def test_a_capture_in_production_is_refused_unless_production_is_armed(tmp_path: Path) -> None:
    plain = LoopHost(tmp_path / "plain")
    try:
        booted(plain)
        refused = plain.ask(CaptureStart(by="op", then="production"))
        assert (refused.ok, refused.code) == (False, "wrong_mode")
        assert "profiler armed" in refused.message
    finally:
        plain.close()
    armed = LoopHost(tmp_path / "armed", armed=True)
    try:
        booted(armed)
        started = armed.ask(CaptureStart(by="op", seconds=0.5, then="production"))
        assert started.ok, started.message
        capture = armed.daemon.s.capture
        assert capture is not None
        armed.until(lambda: not capture.active, "the capture to end")
        assert capture.ok, capture.message
        armed.serving(Mode.PRODUCTION)
        assert armed.systemd.starts == [Mode.PRODUCTION]  # recorded without a restart
        assert [e["ok"] for e in armed.history("capture")] == [True]
    finally:
        armed.close()


def test_a_capture_in_an_armed_production_is_a_bounded_window_whatever_was_asked(
    tmp_path: Path,
) -> None:
    """Until stopped, in production, would slow every client for as long as nobody remembers
    it: the daemon ends it at profiling.armed_capture_max_s by itself, and says so up front.
    The record carries what it cost serving (capture/stall.py)."""
    armed = LoopHost(tmp_path / "armed", armed=True, extra="armed_capture_max_s = 0.5")
    try:
        booted(armed)
        started = armed.ask(CaptureStart(by="op", seconds=None, then="production"))
        assert started.ok, started.message
        assert "for 0.5 s (at most 0.5 s in production (profiling.armed_capture_max_s))" in (
            started.message
        )
        capture = armed.daemon.s.capture
        assert capture is not None and capture.spec.seconds == 0.5
        armed.until(lambda: not capture.active, "the capture to end by itself")
        assert capture.ok and not capture.stop.is_set(), capture.message
        armed.until(lambda: bool(armed.history("capture")), "the capture's record")
        (rec,) = armed.history("capture")
        stall = rec["stall"]
        assert stall["recording"]["seconds"] >= 0.5, stall  # the fake's /metrics: 7 tokens, still
        assert stall["recording"]["tokens_per_s"] == 0 and stall["failed"] == 0, stall
        assert "serving: " in rec["message"]
    finally:
        armed.close()


def test_a_silent_metrics_never_lengthens_a_recording_nor_delays_its_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stall's /metrics reads run beside the capture (an outside review: each sat between a
    decision and /stop_profile, and a silent /metrics recorded 22 s for a 2 s window and counted
    its 10 s in "flush took"). Here /metrics answers nothing: the recording lasts what was
    asked, the flush is what it is, and the record says which windows went unmeasured."""
    from kimi_supervisor.capture import job

    monkeypatch.setattr(job, "METRICS_TIMEOUT_S", 2.0)  # each read's bound (10 s shipped)
    armed = LoopHost(tmp_path / "armed", armed=True)
    silent = Path(f"{armed.systemd.hung_file}-metrics")
    try:
        booted(armed)
        silent.touch()
        t0 = time.monotonic()
        assert armed.ask(CaptureStart(by="op", seconds=0.5, then="production")).ok
        capture = armed.daemon.s.capture
        assert capture is not None
        armed.until(lambda: capture.phase not in ("starting", "recording"), "the flush")
        recorded_s = time.monotonic() - t0
        armed.until(lambda: not capture.active, "the capture to end", real_s=90)
        assert recorded_s < 3, recorded_s
        assert capture.ok and "flush took 0." in capture.message, capture.message
        armed.until(lambda: bool(armed.history("capture")), "the capture's record")
        stall = armed.history("capture")[-1]["stall"]
        assert "timed out" in stall["recording"]["not_measured"], stall
        assert stall["failed"] is None, stall
    finally:
        silent.unlink(missing_ok=True)
        armed.close()


def test_a_capture_holds_a_switch_until_it_has_flushed(host: LoopHost) -> None:
    booted(host)
    host.ask(Switch(Mode.PROFILE, "op"))
    host.serving(Mode.PROFILE)
    started = host.ask(CaptureStart(by="op", then="stay"))
    assert started.ok, started.message
    capture = host.daemon.s.capture
    assert capture is not None
    host.until(lambda: capture.phase == "recording", "the capture to record")
    reply = host.ask(Switch(Mode.PRODUCTION, "op"))
    assert reply.code == "accepted" and "waits for capture" in reply.message
    host.until(capture.stop.is_set, "the switch to stop the recording")
    assert host.state is State.SERVING  # nothing torn down while the capture is on
    host.until(lambda: not capture.active, "the capture to end")
    host.serving(Mode.PRODUCTION)
    assert any(e["event"] == "capture_stopped_for_switch" for e in host.lines)


def test_a_reload_during_a_start_is_adopted_by_the_new_image_without_a_second_load(
    host: LoopHost,
) -> None:
    booted(host)
    host.systemd.load_s = 1.0
    host.ask(Switch(Mode.PROFILE, "op"))
    host.until(lambda: host.state is State.STARTING, "the profile start")
    loading = host.systemd.child
    assert loading is not None
    record = launch_record_path(host.config.vllm.argv_file)  # launch-vllm has exec'd vLLM
    host.until(lambda: record.exists() and f'"pid": {loading.pid}' in record.read_text(), "exec")
    reexec(host)
    host.serving(Mode.PROFILE)
    assert host.systemd.child is loading, host.tail(40)
    assert host.systemd.starts.count(Mode.PROFILE) == 1
    assert transitions(host)[-1] == ("profile", "ready")


def test_a_reload_before_the_launcher_has_exec_d_vllm_is_adopted_too(host: LoopHost) -> None:
    # The new image looks at MainPID while it is still `kimi-supervisor launch-vllm`: what it
    # will run is the argv file's mode, not "an argv matching no mode" to tear down.
    booted(host)
    host.systemd.load_s = 1.0
    host.ask(Switch(Mode.PROFILE, "op"))
    host.until(lambda: host.state is State.STARTING, "the profile start")
    launching = host.systemd.child
    assert launching is not None
    assert "launch-vllm" in processes.cmdline_of(launching.pid)
    reexec(host)
    host.serving(Mode.PROFILE)
    assert host.systemd.child is launching, host.tail(40)
    assert host.systemd.starts.count(Mode.PROFILE) == 1


def reload_with(host: LoopHost, production_args: list[str]) -> None:
    """`vllm.command`'s production argv edited, then `systemctl reload`: a re-exec."""
    from kimi_supervisor.config import ModeConfig

    modes = host.config.modes.model_copy(update={"production": ModeConfig(args=production_args)})
    host.config = host.config.model_copy(update={"modes": modes})
    reexec(host)


def test_a_reload_with_an_edited_argv_keeps_vllm_serving_until_an_operator_applies_it(
    host: LoopHost,
) -> None:
    booted(host)
    serving = host.systemd.child
    assert serving is not None
    reload_with(host, ["--mode-production", "--max-num-seqs", "8"])
    host.serving(Mode.PRODUCTION)
    status = host.status()
    assert host.systemd.child is serving and host.systemd.starts == [Mode.PRODUCTION]
    assert status["unit"]["argv_stale"] and status["unit"]["main_pid"] == serving.pid
    assert status["restart_needed"] == (
        f"restart needed: vLLM (PID {serving.pid}) runs production with an earlier config's "
        "argv; run `kimi-mode production --apply` to load it with the config's (a full model "
        "load)"
    )
    assert [e for e in host.lines if e["event"] == "restart_needed"], host.tail(20)
    # Asking for the mode again changes nothing; --apply restarts it with the config's argv.
    again = host.ask(Switch(Mode.PRODUCTION, "op"))
    assert again.code == "already" and "--apply restarts it" in again.message
    assert host.systemd.child is serving
    applied = host.ask(Switch(Mode.PRODUCTION, "op", apply=True))
    assert applied.code == "accepted" and applied.message.startswith("restart of production")
    host.until(lambda: host.systemd.child is not serving, "the restart")
    host.serving(Mode.PRODUCTION)
    restarted = host.systemd.child
    assert restarted is not None and "--max-num-seqs" in processes.cmdline_of(restarted.pid)
    assert host.status()["restart_needed"] is None
    assert host.systemd.starts == [Mode.PRODUCTION, Mode.PRODUCTION]


def test_apply_with_the_configs_argv_running_restarts_nothing(host: LoopHost) -> None:
    booted(host)
    serving = host.systemd.child
    reply = host.ask(Switch(Mode.PRODUCTION, "op", apply=True))
    assert reply.code == "already" and "with the config's argv" in reply.message
    assert host.systemd.child is serving and host.status()["restart_needed"] is None


def test_a_vllm_started_by_hand_with_another_argv_is_still_replaced(host: LoopHost) -> None:
    """Only the launch record naming that very process makes an unknown argv 'stale': a record
    left by an earlier vLLM (a recycled PID, another start time) does not."""
    booted(host)
    serving = host.systemd.child
    assert serving is not None
    record = launch_record_path(host.config.vllm.argv_file)
    data = json.loads(record.read_text())
    record.write_text(json.dumps({**data, "start_ticks": data["start_ticks"] + 1}))
    reload_with(host, ["--mode-production", "--max-num-seqs", "8"])
    host.until(lambda: host.systemd.child is not serving, "the foreign vLLM to be replaced")
    host.serving(Mode.PRODUCTION)
    assert host.systemd.starts == [Mode.PRODUCTION, Mode.PRODUCTION]


def test_the_loop_never_sleeps_on_its_own_thread(host: LoopHost) -> None:
    booted(host)
    host.ask(Switch(Mode.PROFILE, "op"))
    host.serving(Mode.PROFILE)
    child = host.systemd.child
    assert child is not None
    child.kill()  # vLLM's MainPID exits: the loop waits for systemd to see it, by passes
    child.wait()
    host.until(lambda: host.state is not State.SERVING, "the death to be noticed")
    host.serving(Mode.PROFILE)
    assert host.clock.loop_sleeps == []


def test_an_unexpected_error_in_a_pass_is_shown_retried_with_backoff_and_never_ends_the_loop(
    host: LoopHost,
) -> None:
    """Before, an NVML error other than "unavailable" ended the loop, systemd restarted the
    daemon into the same error and gave up, and vLLM ran unsupervised."""
    booted(host)
    vllm = host.daemon.s.serving.pid if host.daemon.s.serving else 0
    host.gpu.fault = RuntimeError("GPU is lost")
    failures: list[float] = []

    def failed_again() -> bool:
        lines = [ln for ln in host.lines if ln["event"] == "step_failed"]
        if len(lines) > len(failures):
            failures.append(lines[-1]["retry_in_s"])
        return len(failures) >= 4

    host.until(failed_again, "four failed passes")
    assert failures == [1.0, 2.0, 4.0, 8.0]
    warnings = host.status()["warnings"]
    assert [w for w in warnings if "the loop's pass failed (RuntimeError: GPU is lost)" in w]
    host.gpu.fault = None
    host.until(lambda: not host.status()["warnings"], "the failure to clear")
    assert any(ln["event"] == "step_recovered" for ln in host.lines)
    status = host.status()
    assert status["state"] == "serving" and host.daemon.s.serving is not None
    assert host.daemon.s.serving.pid == vllm, "vLLM was never touched"


def test_a_summary_that_never_ends_holds_no_switch(
    host: LoopHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a capture left `summarizing` (a FIFO swapped over a trace) held every switch
    and profile expiry. The traces are saved before the summary starts: nothing waits on it."""
    from kimi_supervisor.capture import job
    from kimi_supervisor.loop.inbox import CaptureStop

    release = threading.Event()

    def wedged(*_args: object, **_kw: object) -> dict[str, object]:
        release.wait(60)
        return {"ranks": [], "errors": [], "took_s": 60.0}

    monkeypatch.setattr(job.ranks, "summarize", wedged)
    try:
        booted(host)
        host.ask(Switch(Mode.PROFILE, "op"))
        host.serving(Mode.PROFILE)
        assert host.ask(CaptureStart(by="op", then="stay")).ok
        capture = host.daemon.s.capture
        assert capture is not None
        host.until(lambda: capture.phase == "recording", "the capture to record")
        (host.root / "traces" / "1-rank-0.2.pt.trace.json.gz").write_bytes(b"x")  # vLLM's flush
        assert host.ask(CaptureStop(by="op")).ok
        host.until(lambda: capture.phase == "summarizing", "the summary to begin")
        reply = host.ask(Switch(Mode.PRODUCTION, "op"))
        assert reply.code == "accepted" and "waits for capture" not in reply.message
        host.serving(Mode.PRODUCTION)
        assert capture.phase == "summarizing", "the switch did not wait for the summary"
    finally:
        release.set()


def test_descriptors_running_out_in_a_teardown_make_it_stuck_and_retried_never_end_the_loop(
    host: LoopHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, EMFILE inside a teardown ended the loop. Here the process really runs out of
    descriptors (RLIMIT_NOFILE) as the teardown begins, on the teardown's thread."""
    import resource

    from kimi_supervisor.teardown.escalation import Teardown

    booted(host)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    real_run = Teardown.run

    def run_out_of_descriptors(td: Teardown) -> Any:
        if not fillers:
            resource.setrlimit(resource.RLIMIT_NOFILE, (3, hard))  # no new descriptor at all
            with contextlib.suppress(OSError):
                while True:  # 0, 1 and 2 taken, should one of them be free
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
            fillers.append(-1)
        return real_run(td)

    def give_back() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            if fd >= 0:
                os.close(fd)

    monkeypatch.setattr(Teardown, "run", run_out_of_descriptors)
    try:
        host.ask(Switch(Mode.PROFILE, "op"))
        host.until(lambda: host.state is State.STUCK, "the teardown to fail")
    finally:
        give_back()
    report = host.status()["last_teardown"]
    assert "Too many open files" in report["diagnosis"], report
    assert any(ln["event"] == "teardown_crashed" for ln in host.lines)
    host.serving(Mode.PROFILE)  # the retry, with descriptors again, goes through


def test_a_hung_vllm_that_answers_health_is_noticed_recorded_torn_down_and_started_again(
    host: LoopHost,
) -> None:
    """Before, an engine frozen mid-collective left /health at 200 and the daemon said
    `serving` for ten minutes while every request hung. Here the fake's requests stop ending
    (its /metrics: one running, the token counter still; its process asleep, using no CPU):
    noticed by the stall and the idle CPU together, restarted."""
    booted(host)
    first = host.daemon.s.serving.pid if host.daemon.s.serving else 0
    host.systemd.hung_file.touch()
    try:
        host.until(lambda: host.state is not State.SERVING, "the hang to be noticed")
    finally:
        host.systemd.hung_file.unlink()
    (incident,) = host.history("incident")
    # Whichever sign came first: the stall under load, or the idle canary that never returned.
    stalled = "1 running and 0 waiting, and no engine step, prompt or generated token for"
    unanswered = "a one-token request got no answer in 1 s"
    assert incident["what"].startswith((f"vLLM hung: {stalled}", f"vLLM hung: {unanswered}"))
    assert incident["main_pid"] == first
    host.serving(Mode.PRODUCTION)  # torn down and started again, under the failure backoff
    assert host.daemon.s.serving is not None and host.daemon.s.serving.pid != first
    assert host.status()["failures_in_window"] == 1
    assert not [w for w in host.status()["warnings"] if "canary" in w]
    # The hang restart left its incident bundle: the incident's signs, vLLM's last lines.
    host.until(
        lambda: (host.status()["incident_bundle"] or {}).get("trigger") == "hang", "its bundle"
    )
    kept = Path(host.status()["incident_bundle"]["path"]).read_text()
    assert "trigger:   hang" in kept and incident["what"][:40] in kept


def test_with_no_bus_at_boot_the_daemon_says_it_waits_for_systemd_and_goes_on_when_it_answers(
    host: LoopHost,
) -> None:
    """Before, with no system D-Bus the daemon sat in `booting` and status exited 0."""
    host.systemd.unreachable = "Could not open a bus to DBus"
    host.until(lambda: bool(host.status()["waiting_for"]), "the wait to show")
    status = host.status()
    assert status["state"] == "booting"
    assert status["waiting_for"].startswith("waiting for systemd: cannot read")
    assert "Could not open a bus to DBus" in status["status_line"]
    host.systemd.unreachable = ""
    host.serving(Mode.PRODUCTION)
    assert host.status()["waiting_for"] is None


def test_liveness_probes_keep_their_own_cadence_when_the_tick_is_longer(tmp_path: Path) -> None:
    """A serving vLLM's /metrics is read every liveness.metrics_interval_s (1 s here), not
    only at the unit's tick (10 s here): the pass falls due for the probe, too."""
    host = LoopHost(tmp_path, tick_s=10.0)
    try:
        booted(host)
        live = host.daemon.life.liveness
        probes: list[float] = []

        def probed_for(seconds: float) -> bool:
            if not probes or live.next_probe != probes[-1]:
                probes.append(live.next_probe)
            return probes[-1] - probes[0] >= seconds

        host.until(lambda: probed_for(20), "20 s of probes")
        # About one a second, not one in ten (3 at most in 20 s). A probe still running when
        # the next falls due (a loaded host's slow thread) waits for it: half is the floor.
        assert len(probes) >= 10, probes
    finally:
        host.close()


def test_a_switch_is_answered_before_a_slow_pass_and_its_status_is_already_published(
    host: LoopHost,
) -> None:
    """A pass can wait on systemd or NVML (sd-bus's 25 s per call when the manager hangs). The
    reply to a switch never waits for it, or the client's 60 s would run out on a switch the
    daemon accepted; and the status a client reads once answered already shows the switch."""
    booted(host)
    d, real_status = host.daemon, host.systemd.status
    answered_during_pass: list[bool] = []
    switch = Switch(Mode.PROFILE, "op")

    def slow_status(unit: str) -> Any:
        answered_during_pass.append(switch.reply.done())
        return real_status(unit)

    host.systemd.status = slow_status  # type: ignore[method-assign]
    try:
        d.ask(switch)
        # One message a turn: a message a daemon's thread queued before the switch goes first.
        for _ in range(100):
            d.turn()
            if switch.reply.done():
                break
    finally:
        host.systemd.status = real_status  # type: ignore[method-assign]
    assert switch.reply.result(timeout=10).code == "accepted"
    # The desk reads systemd before it answers (a port's holder); the pass reads it after.
    assert answered_during_pass[-1], answered_during_pass
    assert host.status()["desired_mode"] == "profile"


def test_a_driver_that_stops_answering_holds_no_pass_and_kills_nothing_until_it_answers(
    tmp_path: Path,
) -> None:
    """NVML takes no timeout: a hung driver (nvidia-smi in state D after an Xid) would have held
    the loop's pass, or the teardown, for as long as it lasts. Now a call past gpus.timeout_s is
    no reading: said in status; a switch's teardown cannot call the GPUs free, so it ends STUCK
    before anything is stopped, and the vLLM that serves goes on serving; once the driver
    answers, the retry switches."""
    host = LoopHost(tmp_path, extra="[gpus]\ntimeout_s = 0.3\n", health_interval_s=1)
    try:
        booted(host)
        served = host.systemd.child
        host.gpu.answers.clear()
        host.longest_turn = 0.0
        host.until(
            lambda: any("cannot read the GPUs: NVML" in w for w in host.status()["warnings"]),
            "status to say the GPUs cannot be read",
        )
        # A re-exec now would wait in execve for the stuck call, unsupervised: it waits instead.
        host.daemon.ask(Reexec())
        host.until(lambda: host.daemon.s.reexec_requested, "the re-exec to be asked")
        assert host.daemon.turn(), "the loop goes on"
        assert any(w.startswith("the re-exec waits") for w in host.status()["warnings"])
        host.daemon.s.reexec_requested = False  # asked again below, once the driver answers
        host.ask(Switch(Mode.PROFILE, "op"))
        host.until(lambda: host.state is State.STUCK, "STUCK")
        report = host.history("teardown")[-1]
        assert report["diagnosis"].startswith("the GPUs could not be read: NVML: reading GPU(s)")
        assert "nvidia-smi" in report["next_action"] and not report["kills"]
        assert host.systemd.child is served and served.poll() is None, "the vLLM serving goes on"
        assert host.longest_turn < 1.0, host.longest_turn  # the deadline, not the driver, bounds it
        said = [w for w in host.status()["warnings"] if w.startswith("cannot read the GPUs")]
        assert len(said) == 1, said  # one line for one cause, whatever its elapsed time says
        host.gpu.answers.set()
        host.serving(Mode.PROFILE)
        assert not any("cannot read the GPUs" in w for w in host.status()["warnings"])
        host.daemon.ask(Reexec())
        host.until(lambda: host.daemon.s.reexec_requested, "the re-exec to be asked")
        assert not host.daemon.turn(), "the re-exec goes on once nothing is stuck"
    finally:
        host.close()


def test_a_driver_that_hangs_while_the_baseline_is_resolved_leaves_a_provisional_one(
    tmp_path: Path,
) -> None:
    """An outside review: NVML hanging as a CLEAN teardown re-resolved a provisional baseline
    escaped as GpuUnavailable, and the operator's transition was never ended."""
    from kimi_supervisor.loop import boot

    host = LoopHost(tmp_path, extra="[gpus]\ntimeout_s = 0.3\n")
    try:
        booted(host)
        host.gpu.answers.clear()
        boot.resolve_baseline(host.daemon.ctx)
        assert host.daemon.s.baseline_provisional
        assert any(w.startswith("no baseline") for w in host.daemon.s.warnings)
    finally:
        host.gpu.answers.set()
        host.close()


def test_a_state_folder_that_stops_answering_refuses_switches_and_keeps_every_record_once(
    host: LoopHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen or hung file system under /var/lib held every pass that writes state.json or
    the history. Now each call waits at most state.timeout_s: an operator's switch, which must
    be on disk first, is refused with the reason; what the daemon records meanwhile is kept in
    memory and written once, in order, when the folder answers."""
    from kimi_supervisor.store import history

    booted(host)
    ctx = host.daemon.ctx
    # A thread that runs the calls as they are (no copy): the hang below is the test's closure.
    ctx.disk = Worker("state-io", 0.3)
    answers = threading.Event()
    update, append = ctx.store.update, history.append

    def hung(fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            answers.wait()
            return fn(*a, **kw)

        return call

    monkeypatch.setattr(ctx.store, "update", hung(update))
    monkeypatch.setattr(history, "append", hung(append))
    before = len(host.history())
    host.longest_turn = 0.0
    reply = host.ask(Switch(Mode.PROFILE, "op"))
    assert not reply.ok and reply.code == "state_error", reply
    assert "no answer in 0.3 s" in reply.message and "nothing was changed" in reply.message
    assert host.daemon.s.desired is Mode.PRODUCTION
    assert any("the state folder does not answer" in w for w in host.status()["warnings"])
    # vLLM dies meanwhile: restarted all the same, its incident kept for later.
    host.systemd.child.kill()  # the host's own child vLLM
    host.until(lambda: host.state is not State.SERVING, "the death to be seen")
    host.serving(Mode.PRODUCTION)
    assert host.longest_turn < 2.0, host.longest_turn
    answers.set()
    deadline = time.monotonic() + 5
    while ctx.disk.stuck() is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # the stuck write returns; the loop has not turned since
    on_disk = json.loads(ctx.store.path.read_text())
    assert on_disk["desired_mode"] == "production", "the refused switch never lands"
    host.until(lambda: not ctx.pending and not ctx.unsaved_state, "the records to be written")
    written = host.history()[before:]
    kinds = [e["kind"] for e in written]
    assert kinds[0] == "incident" and "is gone" in written[0]["what"], written[0]
    assert kinds.count("incident") == 1 and kinds.count("transition") == 1, kinds
    shown = [json.dumps(e, sort_keys=True) for e in written]
    assert len(set(shown)) == len(shown), "no record written twice"
    assert not any("the state folder does not answer" in w for w in host.status()["warnings"])
    assert json.loads(ctx.store.path.read_text())["desired_mode"] == "production"


def test_a_gpu_that_will_fail_the_load_is_refused_before_the_start_and_taken_up_once_reset(
    tmp_path: Path,
) -> None:
    """gpus.health_check = "refuse": a managed GPU whose remapped rows wait for a reset would
    fail a 30-minute load. The start is refused before systemd is asked, with the reason in
    status and the history, and retried with the failure backoff: once the GPU is reset, the
    retry loads, and the warning goes."""
    host = LoopHost(tmp_path, extra='[gpus]\nhealth_check = "refuse"')
    try:
        host.gpu.unhealthy = {1: {"remap_pending": True, "xids": (63,)}}
        host.until(lambda: host.daemon.s.last_failure is not None, "the refused start")
        st = host.status()
        assert host.systemd.starts == [], "vLLM was never started on the failing GPU"
        reason = st["last_failure"]["reason"]
        assert "refuses the load (gpus.health_check = refuse)" in reason, reason
        assert "GPU 1: rows remapped, waiting for a GPU reset to take effect" in reason
        assert "Xid 63 (a row remapping or page retirement recorded)" in reason
        health = st["gpu_health"]
        assert (health["verdict"], health["refused"]) == ("failing", True), health
        assert [g["remap_pending"] for g in health["gpus"]] == [False, True]
        assert any(w.startswith("GPU health: GPU 1: rows remapped") for w in st["warnings"])
        host.until(lambda: bool(transitions(host)), "the refused start's record")
        assert transitions(host) == [("production", "failed")]
        host.gpu.unhealthy = {}  # an operator reset the GPU
        host.serving(Mode.PRODUCTION)
        st = host.status()
        assert host.systemd.starts == [Mode.PRODUCTION]
        assert st["gpu_health"]["verdict"] == "healthy"
        assert not any(w.startswith("GPU health:") for w in st["warnings"]), st["warnings"]
    finally:
        host.close()


def test_by_default_a_failing_gpu_is_warned_of_and_loaded_and_no_reading_decides_nothing(
    host: LoopHost,
) -> None:
    """gpus.health_check = "warn" (the default): the load goes on, the history keeps an
    incident that names the GPU and what it reported. An Xid since boot alone is a warning
    only. A driver that gives no health reading starts the load too: no reading is no
    evidence."""
    host.gpu.unhealthy = {0: {"ecc_uncorrected": 2}, 1: {"xids": (79,)}}
    booted(host)
    st = host.status()
    assert st["gpu_health"]["verdict"] == "failing" and not st["gpu_health"]["refused"]
    said = [e["what"] for e in host.history("incident") if e["what"].startswith("GPU health")]
    assert said and "GPU 0: 2 uncorrected ECC error(s) since the driver loaded" in said[0]
    assert "GPU 1: the kernel logged Xid 79 (the GPU fell off the bus) since boot" in said[0]
    assert "loaded all the same (gpus.health_check = warn)" in said[0]
    host.gpu.health_fault = GpuUnavailable("the health of GPU(s) 0, 1: NVML query failed")
    reads = host.gpu.health_reads
    host.ask(Switch(Mode.PROFILE, "op"))
    host.serving(Mode.PROFILE)
    assert host.gpu.health_reads == reads + 1 and host.systemd.starts[-1] is Mode.PROFILE
    health = host.status()["gpu_health"]
    assert health["verdict"] == "unread" and "NVML query failed" in health["text"], health
    # A port's own bug (an outside review: a kernel log line that raised ValueError) is no
    # reading either: one start, never a teardown begun again and again.
    host.gpu.health_fault = ValueError("invalid literal for int() with base 16: ''")
    starts = len(host.systemd.starts)
    host.ask(Switch(Mode.PRODUCTION, "op"))
    host.serving(Mode.PRODUCTION)
    assert host.systemd.starts[starts:] == [Mode.PRODUCTION]
    health = host.status()["gpu_health"]
    assert health["verdict"] == "unread" and "ValueError: invalid literal" in health["text"]


def test_failed_by_the_hang_bound_and_stuck_each_say_why_and_the_outage_as_under_way(
    tmp_path: Path,
) -> None:
    """After the hang bound sent the daemon to FAILED, status said only "production gave up",
    its last_failure was null and the downtime shown was the previous, closed window."""
    host = LoopHost(tmp_path, liveness="max_hang_restarts = 1")  # the first hang is the last
    try:
        booted(host)
        host.systemd.hung_file.touch()
        try:
            host.until(lambda: host.state is State.FAILED, "FAILED by the hang bound")
        finally:
            host.systemd.hung_file.unlink()
        st = host.status()
        assert st["last_failure"] is not None, st
        assert st["last_failure"]["reason"].startswith("hung: "), st["last_failure"]
        assert "max_hang_restarts" in st["last_failure"]["reason"]
        assert st["status_line"].startswith("FAILED: production gave up: hung: ")
        assert st["downtime"]["under_way"] is True and st["downtime"]["window_s"] is not None
        assert "nothing serves, FAILED: not until `kimi-mode production`" in st["downtime"]["text"]
        # An operator's switch onto a GPU that something holds: STUCK, said with its cause.
        host.gpu.extra[1] = 20_000
        host.ask(Switch(Mode.PRODUCTION, "op"))
        host.until(lambda: host.state is State.STUCK, "STUCK")
        st = host.status()
        assert st["last_failure"]["reason"].startswith("teardown STUCK: "), st["last_failure"]
        assert st["status_line"].startswith("STUCK since") and "(" in st["status_line"]
        assert st["downtime"]["under_way"] is True and "back in about" not in st["downtime"]["text"]
        assert "nothing serves, STUCK" in st["downtime"]["text"]
        assert st["output_tail"] == []  # this switch's STUCK: no vLLM of its own failed
    finally:
        host.close()
