"""Real vLLM 0.16 busy in ways that are no hang, with room for a long prompt (the tier's tiny
model with 16384 positions, `--max-model-len` and `--max-num-batched-tokens` 8448): an
8192-token prefill, a step longer than the stall (bench/liveness_real.py measured it), and the
profile mode run with `--disable-log-stats` saturated by clients. Neither may get a verdict."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest

from ..conftest import DaemonHelper, wait_until
from . import env
from .test_real_vllm import READY_S, Load, hangs, serving_real

pytestmark = [pytest.mark.realvllm, pytest.mark.systemd]

ROOM = 8448


@pytest.fixture(scope="module")
def roomy() -> Iterator[DaemonHelper]:
    try:
        model = env.long_model(env.venv()) if not env.unavailable() else None
    except env.Unavailable as e:
        pytest.skip(f"no real vLLM here: {e}")
    room = ["--max-model-len", str(ROOM), "--max-num-batched-tokens", str(ROOM)]
    # A stall shorter than the 8192-token prefill on a quiet machine too (2.24 s here,
    # bench/liveness_real.py): the step outlasts it, or this tests nothing.
    fast = {"metrics_interval_s": 0.5, "stall_s": 1.5}
    with serving_real(model, room, ("--disable-log-stats",), liveness=fast) as daemon:
        yield daemon


def post(daemon: DaemonHelper, path: str, body: dict[str, object], timeout_s: float) -> dict:  # type: ignore[type-arg]
    url = daemon.config.vllm.health_url.removesuffix("/health") + path
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_a_real_8192_token_prefill_longer_than_the_stall_gets_no_verdict(
    roomy: DaemonHelper,
) -> None:
    """One prefill step of 8192 tokens: no step ends and /metrics stands still for longer than
    stall_s (1.5 s here), the canary waits behind it; the engine works."""
    roomy.wait_serving("production", READY_S)
    pid = roomy.vllm_pid()
    model = json.loads(roomy.config.vllm.argv_file.read_text())["argv"][2]
    per_word = post(roomy, "/tokenize", {"model": model, "prompt": " ".join(["a"] * 100)}, 60)
    words = int((8192 - 8) / (int(per_word["count"]) / 100))
    body = {"model": model, "prompt": " ".join(["a"] * words), "max_tokens": 4}
    t0 = time.monotonic()
    got = post(roomy, "/v1/completions", body, READY_S)
    took = time.monotonic() - t0
    assert got["usage"]["prompt_tokens"] >= 8000, got["usage"]
    time.sleep(2 * roomy.config.liveness.metrics_interval_s)  # the readings after it
    assert not hangs(roomy) and roomy.vllm_pid() == pid, hangs(roomy)
    assert took > roomy.config.liveness.stall_s, f"the prefill took {took:.1f} s: no test"


def test_a_real_vllm_saturated_with_its_stats_off_gets_no_verdict(roomy: DaemonHelper) -> None:
    """`--disable-log-stats`: no vllm:* series, no stall to judge; the canary waits behind the
    clients, the engine busy. Four canaries' worth of saturation: no verdict, status says why."""
    r = roomy.kimi_mode("profile", timeout=READY_S + 120)  # this tier's profile: stats off
    assert r.returncode == 0, r.stdout + r.stderr
    pid = roomy.vllm_pid()
    c = roomy.config.liveness
    load = Load(roomy, 8)
    try:
        wait_until(lambda: load.answered > 8, 120, "the load to be answered")
        seen = roomy.wait_status(
            lambda s: (s.get("liveness") or {}).get("canary_at") is not None, 120, "a canary"
        )
        time.sleep(4 * (c.canary_interval_s + c.canary_timeout_s))
        status = roomy.status()
    finally:
        load.stop()
    assert not hangs(roomy) and roomy.vllm_pid() == pid, hangs(roomy)
    assert status["liveness"]["metrics"] == "absent", status["liveness"]
    assert seen["liveness"]["running"] is None
    assert load.answered > 20  # it served all along
