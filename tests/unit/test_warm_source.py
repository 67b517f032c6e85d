"""Where the warming looks for the next vLLM's model: where vLLM itself will, as its unit runs
it. The package's unit runs vLLM as kimi-vllm (home /var/lib/kimi-vllm), so a model named by
its hub id is in that user's cache, not root's: warming root's cache read nothing useful."""

from __future__ import annotations

import pwd
import threading
from pathlib import Path

from kimi_supervisor.config import WarmConfig
from kimi_supervisor.decide import warmset
from kimi_supervisor.loop import warming
from kimi_supervisor.ports.clock import SystemClock
from kimi_supervisor.ports.systemd import SystemdError
from kimi_supervisor.sandbox.sandbox import hub_snapshot
from tests.fakes import NoSystemd

UNIT = "vllm-kimi-k25.service"
NOBODY = pwd.getpwnam("nobody")


class Unit(NoSystemd):
    def __init__(self, env: dict[str, str], uid: int | None, down: bool = False) -> None:
        super().__init__()
        self.env, self.uid, self.down = env, uid, down

    def environment(self, unit: str) -> dict[str, str]:
        if self.down:
            raise SystemdError("no bus")
        return self.env

    def run_as(self, unit: str) -> int | None:
        return self.uid


def looked_in(unit: Unit) -> list[str]:
    env, home = warming.vllm_env(unit, UNIT)
    assert home is not None
    src = warmset.source_of(["vllm", "serve", "moonshotai/Kimi-K2.5"])
    assert src is not None
    return [c["root"] for c in warmset.candidates(src, env, home)[1:]]


def test_a_vllm_run_as_its_own_user_is_warmed_from_that_users_hub_cache() -> None:
    assert looked_in(Unit({}, NOBODY.pw_uid)) == [f"{NOBODY.pw_dir}/.cache/huggingface/hub"]


def test_the_units_environment_names_the_cache_before_the_users_home() -> None:
    assert looked_in(Unit({"HF_HOME": "/srv/hf"}, NOBODY.pw_uid)) == ["/srv/hf/hub"]
    assert looked_in(Unit({"HOME": "/srv/v"}, None)) == ["/srv/v/.cache/huggingface/hub"]


def test_a_unit_whose_user_cannot_be_said_leaves_the_daemons_own_view() -> None:
    assert warming.vllm_env(Unit({}, None), UNIT) == ({}, None)
    assert warming.vllm_env(Unit({"A": "1"}, 0, down=True), UNIT) == ({}, None)


def test_the_warming_reads_the_snapshot_in_vllms_home_by_its_hub_id(tmp_path: Path) -> None:
    hub_snapshot(tmp_path / ".cache" / "huggingface" / "hub", "moonshotai/Kimi-K2.5", 2, shard_mb=1)
    env, home = warming.vllm_env(Unit({"HOME": str(tmp_path)}, 0), UNIT)
    end = warming.warm(
        WarmConfig(),
        ["vllm", "serve", "moonshotai/Kimi-K2.5"],
        threading.Event(),
        clock=SystemClock(),
        report=lambda _w: None,
        env=env,
        home=home,
    )
    assert end.read_bytes >= 2 << 20, end.text
