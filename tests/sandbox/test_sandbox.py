"""The sandbox as a user of it sees it: a real systemd unit running the fake vLLM on simulated
GPUs, driven through the project's own unit file and systemd port."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from kimi_supervisor.configfile import load_config
from kimi_supervisor.model import Mode
from kimi_supervisor.ports import launcher, processes
from kimi_supervisor.ports.http import request
from kimi_supervisor.ports.launcher import write_argv_file
from kimi_supervisor.sandbox.sandbox import UNIT
from kimi_supervisor.vllm_guard import kimi_profile_guard

from ..conftest import (
    HealthWatch,
    SandboxHelper,
    assert_starts_like_vllm_0_16,
    health,
    wait_until,
)
from ..vllm_0_16 import (
    assert_load_output_like_vllm_0_16,
    assert_stops_like_vllm_0_16,
    assert_traces_like_vllm_0_16,
    assert_tree_like_vllm_0_16,
    tree_of,
)

pytestmark = pytest.mark.systemd


def post(url: str, argv_file: Path | None = None) -> int:
    """POST `url`; with `argv_file`, as the daemon does: with the secret of this start, which
    the profile guard asks of the profiler's routes."""
    token = launcher.read_token(argv_file) if argv_file is not None else None
    headers = {kimi_profile_guard.HEADER: token} if token else {}
    req = urllib.request.Request(url, data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_the_unit_runs_the_fake_vllm_whose_workers_fill_the_gpus_and_stopping_returns_them(
    sandbox: SandboxHelper,
) -> None:
    main_pid = sandbox.start_vllm("production")
    status = sandbox.systemd.status(UNIT)
    assert status.active_state == "active" and status.main_pid == main_pid
    assert processes.cgroup_of(main_pid).endswith(f"/app.slice/{UNIT}")
    titles = {processes.cmdline_of(p)[0] for p in sandbox.systemd.cgroup_pids(UNIT)}
    assert {"VLLM::EngineCore", *(f"VLLM::Worker_TP{i}" for i in range(4))} <= titles
    assert [u - b for u, b in zip(sandbox.used(), sandbox.baseline(), strict=True)] == [90_000] * 4

    sandbox.systemd.stop(UNIT)
    wait_until(lambda: sandbox.systemd.status(UNIT).inactive, 10, "the unit to stop")
    assert sandbox.used() == sandbox.baseline()
    assert sandbox.systemd.status(UNIT).result == "success"


def test_health_refuses_while_loading_and_answers_200_once_ready_as_real_vllm_does(
    sandbox: SandboxHelper,
) -> None:
    sandbox.fake(load_s=1.5)
    watch = HealthWatch(sandbox.config.vllm.health_url)
    sandbox.start_vllm("production", wait_ready=False)
    wait_until(lambda: health(sandbox.config.vllm.health_url) == 200, 10, "200 once ready")
    assert_starts_like_vllm_0_16(watch.stop())
    r = request(sandbox.config.vllm.health_url)
    assert r.status == 200 and r.body == ""  # an empty body, as real vLLM's
    log = sandbox.config.vllm.log_file
    assert log is not None
    text = log.read_text()
    assert "Loading safetensors checkpoint shards: 100% Completed" in text
    assert "Application startup complete." in text


def test_the_fake_vllm_starts_profiles_and_stops_as_real_vllm_0_16_does(
    sandbox: SandboxHelper,
) -> None:
    # The checks the real-vLLM tier runs on real vLLM (tests/realvllm): the fake must pass them.
    tp = len(sandbox.baseline())
    api = sandbox.start_vllm("profile")
    tree = tree_of(api)
    assert_tree_like_vllm_0_16(api, tree, tp)
    log = sandbox.config.vllm.log_file
    assert log is not None
    assert_load_output_like_vllm_0_16(log.read_bytes())
    base = sandbox.config.vllm.health_url.removesuffix("/health")
    traces = sandbox.sb.root / "traces"
    before = {p.name for p in traces.iterdir()} if traces.exists() else set()
    argv_file = sandbox.config.vllm.argv_file
    assert post(base + "/start_profile") == 403  # a client, not the daemon
    assert post(base + "/start_profile", argv_file) == 200
    assert post(base + "/stop_profile", argv_file) == 200
    # This stop's files (profiler_out_N.txt is rewritten in place, as vLLM does).
    written = [p.name for p in traces.iterdir() if p.name not in before or "profiler_out" in p.name]
    assert_traces_like_vllm_0_16(written, tp)
    since = time.monotonic()
    processes.send_signal(processes.ref_of(api), signal.SIGTERM)  # type: ignore[arg-type]
    assert_stops_like_vllm_0_16(list(tree), since)


def test_the_profiler_config_json_arrives_byte_exact_in_vllms_argv(sandbox: SandboxHelper) -> None:
    main_pid = sandbox.start_vllm("profile")
    argv = processes.cmdline_of(main_pid)
    expected = sandbox.config.launch_argv(Mode.PROFILE)
    # The mode's argv byte for byte, then the profile guard's two arguments (an armed mode).
    assert argv[-2:] == launcher.GUARD_ARGS
    assert argv[:-2][-len(expected) + 1 :] == expected[1:]
    arg = argv[argv.index("--profiler-config") + 1]
    traces = f"{sandbox.sb.root}/traces"
    assert arg == '{"profiler": "torch", "torch_profiler_dir": "' + traces + '"}'


def test_a_ghost_outside_the_unit_keeps_its_memory_after_the_unit_stops(
    sandbox: SandboxHelper,
) -> None:
    sandbox.start_vllm("production")
    ghost = sandbox.ghost(gpu="all", mib=6_000, title="python")
    sandbox.systemd.stop(UNIT)
    wait_until(lambda: sandbox.systemd.status(UNIT).inactive, 10, "the unit to stop")
    assert processes.is_alive(ghost)
    assert processes.comm_of(ghost.pid) == "python"
    assert [u - b for u, b in zip(sandbox.used(), sandbox.baseline(), strict=True)] == [6_000] * 4
    listed = {p.pid for d in sandbox.gpu.sample(sandbox.indices) for p in d.processes}
    assert listed == {ghost.pid}


def test_the_fakes_ghost_fault_escapes_the_units_cgroup(sandbox: SandboxHelper) -> None:
    sandbox.fake(
        ghost_title="python3",
        ghost_mib=2_000,
        devices=[0, 1, 2, 3],
        ghost_cgroup_procs=sandbox.sb.ghost_cgroup_procs(),
    )
    sandbox.start_vllm("production")
    sandbox.systemd.stop(UNIT)
    wait_until(lambda: sandbox.systemd.status(UNIT).inactive, 10, "the unit to stop")
    listed = {p.pid for d in sandbox.gpu.sample(sandbox.indices) for p in d.processes}
    assert len(listed) == 1
    ghost = processes.ref_of(listed.pop())
    assert ghost is not None
    sandbox.started.append(ghost)  # ended by the fixture
    assert processes.comm_of(ghost.pid) == "python3"
    assert [u - b for u, b in zip(sandbox.used(), sandbox.baseline(), strict=True)] == [2_000] * 4


def test_profiler_endpoints_write_traces_in_profile_mode_and_are_404_in_production(
    sandbox: SandboxHelper,
) -> None:
    base = sandbox.config.vllm.health_url.removesuffix("/health")
    sandbox.start_vllm("production")
    assert post(base + "/start_profile") == 404
    sandbox.systemd.stop(UNIT)
    wait_until(lambda: sandbox.systemd.status(UNIT).inactive, 10, "the unit to stop")

    sandbox.start_vllm("profile")
    assert post(base + "/start_profile", sandbox.config.vllm.argv_file) == 200
    assert post(base + "/stop_profile", sandbox.config.vllm.argv_file) == 200
    traces = sorted((sandbox.sb.root / "traces").glob("*.pt.trace.json.gz"))
    assert len(traces) >= 4 and all(t.stat().st_size > 0 for t in traces)
    with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
        assert json.load(r)["data"][0]["id"] == "moonshotai/Kimi-K2.5"


def test_starting_the_unit_without_an_argv_file_fails_with_the_reason_in_its_log(
    sandbox: SandboxHelper,
) -> None:
    argv_file = sandbox.config.vllm.argv_file
    argv_file.unlink(missing_ok=True)
    sandbox.systemd.start(UNIT)
    # "failed", not merely inactive: the start job may not have begun yet on a loaded machine
    # (the unit still reads inactive, as before it).
    wait_until(
        lambda: sandbox.systemd.status(UNIT).active_state == "failed", 10, "the unit to fail"
    )
    status = sandbox.systemd.status(UNIT)
    assert status.active_state == "failed" and status.exec_main_status == 1
    log = sandbox.config.vllm.log_file
    assert log is not None and "vLLM is started by kimi-supervisor" in log.read_text()


def test_sandbox_config_written_by_up_points_at_this_sandbox(sandbox: SandboxHelper) -> None:
    config = load_config(sandbox.sb.config_path)
    assert config.gpus.sim_dir == sandbox.sb.gpu_dir
    assert config.vllm.argv_file == sandbox.sb.root / "run" / "kimi-supervisor" / "vllm-argv.json"
    assert Path(config.vllm.command[0]).parent == sandbox.sb.root / "bin"
    write_argv_file(config, Mode.PRODUCTION)
    assert json.loads(config.vllm.argv_file.read_text())["mode"] == "production"


def test_daemon_reload_through_the_port_picks_up_a_changed_drop_in(sandbox: SandboxHelper) -> None:
    dropin = sandbox.sb.manager.unit_dir / f"{UNIT}.d" / "zz-test.conf"
    dropin.write_text("[Service]\nEnvironment=KIMI_TEST_MARKER=reloaded\n")
    try:
        sandbox.systemd.daemon_reload()
        main_pid = sandbox.start_vllm()
        environ = Path(f"/proc/{main_pid}/environ").read_bytes().split(b"\0")
        assert b"KIMI_TEST_MARKER=reloaded" in environ
        # What the warming reads as vLLM's environment (loop/warming.vllm_env) is the unit's.
        assert sandbox.systemd.environment(UNIT)["KIMI_TEST_MARKER"] == "reloaded"
    finally:
        dropin.unlink()
        sandbox.systemd.daemon_reload()
