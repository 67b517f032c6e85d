"""state.json under the daemon: what any write does with a file deleted or changed behind the
daemon's back (the in-process loop of tests/unit/loophost.py)."""

from __future__ import annotations

import json
from pathlib import Path

from kimi_supervisor.loop.inbox import Switch
from kimi_supervisor.model import Mode

from .loophost import LoopHost


def serving_profile(host: LoopHost) -> Path:
    host.serving(Mode.PRODUCTION)
    assert host.ask(Switch(Mode.PROFILE, "op")).code == "accepted"
    host.serving(Mode.PROFILE)
    return host.config.state.dir / "state.json"


def test_a_state_file_deleted_before_any_write_is_written_again_with_the_desired_mode(
    host: LoopHost,
) -> None:
    # Not only the pass's check: a write that comes first (here the transition's) must not
    # take the defaults a read of no file gives, which would boot production at a restart.
    path = serving_profile(host)
    path.unlink()
    host.daemon.ctx.persist_transition()
    assert json.loads(path.read_text())["desired_mode"] == "profile"
    incidents = [e["what"] for e in host.history("incident")]
    assert [w for w in incidents if "disappeared while the daemon ran" in w], incidents
    # Once: the next pass's own check finds the file written, and reports nothing more.
    assert host.daemon.turn()
    assert not host.status()["warnings"]  # the file is back: nothing to warn of now
    assert len([e for e in host.history("incident") if "disappeared" in e["what"]]) == 1


def test_a_state_file_that_never_existed_is_written_from_the_defaults_without_an_incident(
    tmp_path: Path,
) -> None:
    h = LoopHost(tmp_path)
    try:
        h.serving(Mode.PRODUCTION)
        path = h.config.state.dir / "state.json"
        assert json.loads(path.read_text())["desired_mode"] == "production"
        assert not h.history("incident")
    finally:
        h.close()
