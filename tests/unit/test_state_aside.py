"""The files state.json is set aside as (state.json.outside-TIME, state.json.corrupt-TIME): the
newest KEEP_ASIDE of each kind are kept, older ones removed only where the daemon made them, and
status says so (before, each outside edit left one more file, with no bound)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kimi_supervisor.model import Mode
from kimi_supervisor.store.state import KEEP_ASIDE, StateStore

from .loophost import LoopHost


def _edit_outside(path: Path, by: str) -> None:
    """As an editor saves: a new file renamed over state.json, with the desired mode changed."""
    edited = json.loads(path.read_text()) | {"desired_mode": "profile", "desired_by": by}
    tmp = path.with_name("state.json.swp")
    tmp.write_text(json.dumps(edited))
    tmp.rename(path)


def _aside(directory: Path, n: int, tag: str = "outside") -> list[Path]:
    """`n` files named as the daemon sets them aside, oldest first (one a second)."""
    paths = [directory / f"state.json.{tag}-20261201T0900{i:02d}.000000Z" for i in range(n)]
    for p in paths:
        p.write_text("{}")
        p.chmod(0o640)
    return paths


def test_eight_edits_made_outside_the_daemon_leave_the_newest_five_and_status_says_older_were_removed(  # noqa: E501
    host: LoopHost,
) -> None:
    host.serving(Mode.PRODUCTION)
    store = host.daemon.ctx.store
    for i in range(8):
        _edit_outside(store.path, f"editor-{i}")
        host.until(
            lambda i=i: any(f"editor-{i}" in p.read_text() for p in store.dir.glob("*outside*")),
            f"edit {i} to be set aside",
        )
    kept = sorted(store.dir.glob("state.json.outside-*"))
    assert len(kept) == KEEP_ASIDE == 5
    # The newest five edits, whole: the older three are gone.
    assert [json.loads(p.read_text())["desired_by"] for p in kept] == [
        f"editor-{i}" for i in range(3, 8)
    ]
    warning = [w for w in host.status()["warnings"] if "changed outside" in w][-1]
    assert f"kept as {kept[-1]} (5 outside files kept, the newest; 1 older removed)" in warning
    # Never acted on: the daemon goes on serving what it knows.
    assert json.loads(store.path.read_text())["desired_mode"] == "production"
    assert host.daemon.s.desired is Mode.PRODUCTION


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user's (chown)")
def test_pruning_removes_only_the_daemons_own_regular_files_never_a_link_a_fifo_or_anothers_file(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    store.check()
    old = _aside(tmp_path, 8)  # 00 .. 07
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.write_text("root's own file, outside the state directory")
    try:
        old[0].unlink()
        old[0].symlink_to(elsewhere)  # a link by the daemon's name
        old[1].unlink()
        os.mkfifo(old[1])  # a FIFO by the daemon's name
        os.chown(old[2], 65534, 65534)  # another user's file by the daemon's name
        (tmp_path / "state.json.outside-notes").write_text("not a name the daemon gives")
        newest = old[7]
        pruned = store.prune_aside("outside", newest)
        # 07 .. 03 are the newest five: kept. Of 02 .. 00, none is the daemon's to remove.
        assert (pruned.kept, pruned.removed, pruned.left) == (5, 0, 3), pruned
        assert elsewhere.read_text().startswith("root's own file")
        assert old[0].is_symlink() and old[1].exists() and old[2].exists()
        assert (tmp_path / "state.json.outside-notes").exists()
        assert "3 older left, not the daemon's to remove" in pruned.says("outside")
        # Made the daemon's again, they go: regular files of its own only.
        old[0].unlink()
        old[1].unlink()
        old[0].write_text("{}")
        old[1].write_text("{}")
        pruned = store.prune_aside("outside", newest)
        assert (pruned.kept, pruned.removed, pruned.left) == (5, 2, 1), pruned
        assert not old[0].exists() and not old[1].exists() and old[2].exists()
    finally:
        elsewhere.unlink()


def test_the_file_just_set_aside_is_kept_even_when_a_clock_stepped_back_named_it_oldest(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    store.check()
    paths = _aside(tmp_path, 7)
    stepped_back = tmp_path / "state.json.outside-20200101T000000.000000Z"
    stepped_back.write_text("{}")
    pruned = store.prune_aside("outside", stepped_back)
    assert stepped_back.exists() and pruned.removed == 3, pruned
    assert sorted(tmp_path.glob("state.json.outside-*")) == [stepped_back, *paths[3:]]


def test_a_state_directory_that_cannot_be_trusted_has_nothing_removed_and_says_why(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path)
    store.check()
    paths = _aside(tmp_path, 7)
    tmp_path.chmod(0o777)
    try:
        pruned = store.prune_aside("outside", paths[-1])
    finally:
        tmp_path.chmod(0o750)
    assert pruned.removed == 0 and "cannot be trusted" in pruned.error
    assert all(p.exists() for p in paths)
    assert "not pruned" in pruned.says("outside")


def test_corrupt_state_files_set_aside_are_kept_to_the_newest_five_too(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.check()
    _aside(tmp_path, 6, "corrupt")
    (tmp_path / "state.json").write_text('{"version": 1, "desired_mo')
    _st, warning = store.read()
    assert warning is not None and "5 corrupt files kept, the newest; 2 older removed" in warning
    kept = list(tmp_path.glob("state.json.corrupt-*"))
    assert len(kept) == 5 and any(p.read_text() == '{"version": 1, "desired_mo' for p in kept)


def test_a_write_removes_what_a_writer_that_died_mid_write_left_and_nothing_of_a_live_one(
    tmp_path: Path,
) -> None:
    """Each state write runs in a process of its own, whose PID names its temporary file: one
    killed mid-write left `.state.json.PID.tmp` that no later writer had the PID to remove."""
    from kimi_supervisor.store.state import PersistedState

    tmp_path.chmod(0o750)
    dead = tmp_path / ".state.json.4194305.tmp"  # above the kernel's largest PID: no process
    live = tmp_path / f".state.json.{os.getppid()}.tmp"  # a writer still at work
    other = tmp_path / ".state.json.x.tmp"  # not a name the writers give
    for f in (dead, live, other):
        f.write_text("{")
    StateStore(tmp_path).write(PersistedState())
    assert not dead.exists() and live.exists() and other.exists()
    assert json.loads((tmp_path / "state.json").read_text())["desired_mode"] == "production"


def test_a_state_file_nested_too_deep_to_parse_is_set_aside_not_a_crash_at_every_start(
    tmp_path: Path,
) -> None:
    """json.loads of 200,000 open brackets raises RecursionError, which no start caught: each
    start exited and systemd's restarts ran into their start limit (an outside review)."""
    tmp_path.chmod(0o750)
    (tmp_path / "state.json").write_text("[" * 200_000)
    state, warning = StateStore(tmp_path).read()
    assert state.desired_mode is Mode.PRODUCTION
    assert warning is not None and "it is not a valid state" in warning, warning
    assert [p.name.startswith("state.json.corrupt-") for p in tmp_path.iterdir()].count(True) == 1
