"""The open rule (ports/safeopen.py) on real files: what root opens in a folder another user can
change is the file it judged. Each case swaps an entry after it was listed, as the folder's owner
could, and watches the thing swapped in with inotify: root must never open it (O_PATH opens
nothing and reports no IN_OPEN; a real open of the watched inode would). Every case runs with
openat2 and with the per-component fallback of kernels without it."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.ports import safeopen
from tests.inotify import Watch


@pytest.fixture(params=["openat2", "per-component"])
def method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "per-component":
        monkeypatch.setattr(safeopen, "_openat2_works", False)
    else:
        monkeypatch.setattr(safeopen, "_openat2_works", None)
    yield request.param


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A model's folder with one shard, and its descriptor (the anchor)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "model-00001-of-00001.safetensors").write_bytes(b"w" * 4096)
    fd = safeopen.open_root(d)
    try:
        yield d, fd
    finally:
        os.close(fd)


SHARD = "model-00001-of-00001.safetensors"


def listed(d: Path) -> safeopen.Identity:
    return safeopen.Identity.of(os.lstat(d / SHARD))


def swap(d: Path, make: object) -> None:
    """What the folder's owner does after the listing: a new entry renamed over the shard."""
    new = d / ".swap"
    make(new)  # type: ignore[operator]
    os.rename(new, d / SHARD)


def test_the_file_listed_is_opened_and_read(method: str, tree: tuple[Path, int]) -> None:
    d, fd = tree
    f = safeopen.open_file(fd, SHARD, listed(d))
    try:
        assert os.read(f, 10) == b"w" * 10
        assert os.get_blocking(f)  # O_NONBLOCK served the open only
    finally:
        os.close(f)


def test_a_shard_swapped_for_a_link_is_refused_and_its_target_never_opened(
    method: str, tree: tuple[Path, int], tmp_path: Path
) -> None:
    d, fd = tree
    judged = listed(d)
    secret = tmp_path / "root-only"
    secret.write_text("not the model's")
    secret.chmod(0o600)
    watch = Watch(secret)
    try:
        swap(d, lambda p: p.symlink_to(secret))
        with pytest.raises(safeopen.Refused, match="symbolic link"):
            safeopen.open_file(fd, SHARD, judged)
        # A link inside the tree is no better: a link is never followed.
        (d / "inside").write_bytes(b"x")
        os.unlink(d / SHARD)
        swap(d, lambda p: p.symlink_to("inside"))
        with pytest.raises(safeopen.Refused, match="symbolic link"):
            safeopen.open_file(fd, SHARD)
        assert watch.opened() == []
    finally:
        watch.close()


def test_a_shard_swapped_for_a_fifo_is_refused_at_once_and_never_opened(
    method: str, tree: tuple[Path, int]
) -> None:
    d, fd = tree
    judged = listed(d)
    swap(d, os.mkfifo)
    watch = Watch(d / SHARD)
    try:
        with pytest.raises(safeopen.Refused, match="a FIFO, not a regular file"):
            safeopen.open_file(fd, SHARD, judged)  # returns at once: no writer is waited for
        assert watch.opened() == []
    finally:
        watch.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root (CAP_MKNOD)")
def test_a_shard_swapped_for_a_device_is_refused_and_the_device_never_opened(
    method: str, tree: tuple[Path, int]
) -> None:
    """/dev/null's numbers (1:3) at a path the test controls: a device whose open acts (a
    watchdog) would act on any open, O_NONBLOCK or not."""
    d, fd = tree
    judged = listed(d)
    swap(d, lambda p: os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 3)))
    watch = Watch(d / SHARD)
    try:
        with pytest.raises(safeopen.Refused, match="a character device, not a regular file"):
            safeopen.open_file(fd, SHARD, judged)
        assert watch.opened() == []
    finally:
        watch.close()


def test_a_shard_replaced_by_another_file_after_the_listing_is_not_the_file_judged(
    method: str, tree: tuple[Path, int]
) -> None:
    d, fd = tree
    judged = listed(d)
    swap(d, lambda p: p.write_bytes(b"someone else's"))
    watch = Watch(d / SHARD)
    try:
        with pytest.raises(safeopen.Refused, match="replaced since it was listed"):
            safeopen.open_file(fd, SHARD, judged)
        assert watch.opened() == []
    finally:
        watch.close()


def test_a_folder_on_the_way_swapped_for_a_link_and_dot_dot_never_leave_the_tree(
    method: str, tree: tuple[Path, int], tmp_path: Path
) -> None:
    d, fd = tree
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.safetensors").write_bytes(b"o")
    (d / "blobs").symlink_to(outside)
    with pytest.raises(safeopen.Refused, match="symbolic link"):
        safeopen.open_file(fd, "blobs/x.safetensors")
    with pytest.raises(safeopen.Refused, match="outside the folder"):
        safeopen.open_file(fd, "../outside/x.safetensors")
    with pytest.raises(safeopen.Refused, match="not a path inside"):
        safeopen.open_file(fd, str(outside / "x.safetensors"))


def test_a_hub_snapshot_s_file_is_opened_at_its_blob_which_the_listing_saw(
    method: str, tmp_path: Path
) -> None:
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "b1").write_bytes(b"blob")
    fd = safeopen.open_root(repo)
    try:
        judged = safeopen.identify(fd, "blobs/b1")
        assert judged.size == 4
        f = safeopen.open_file(fd, "blobs/b1", judged)
        os.close(f)
        with pytest.raises(safeopen.Refused, match="a folder, not a regular file"):
            safeopen.identify(fd, "blobs")
        with pytest.raises(safeopen.Refused, match="no such file"):
            safeopen.identify(fd, "blobs/gone")
    finally:
        os.close(fd)


def test_the_model_folder_swapped_for_a_link_by_its_owner_is_refused_and_roots_link_followed(
    tmp_path: Path,
) -> None:
    """The folder named in vLLM's argv, walked a link at a time: its owner (another user)
    swapping it for a link to a root-only folder had root read that folder's files (an outside
    review); a link root made in a folder only root can change (`/models` -> an NFS mount) is
    followed, as sshd's StrictModes would."""
    from kimi_supervisor.ports import safeopen

    tmp_path.chmod(0o755)
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "model.safetensors").write_bytes(b"root's")
    home = tmp_path / "bob"
    home.mkdir()
    os.chown(home, 4245, 4245)
    (home / "model").symlink_to(secret)  # Bob's swap: a link in Bob's folder
    with pytest.raises(safeopen.Refused, match="model is a link in a folder another user"):
        safeopen.open_root(home / "model")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: sticky, anyone writes
    (shared / "model").symlink_to(secret)
    os.chown(shared / "model", 4245, 4245, follow_symlinks=False)
    with pytest.raises(safeopen.Refused, match="a link in a folder another user"):
        safeopen.open_root(shared / "model")
    (tmp_path / "models").symlink_to(secret)  # root's own link, in a folder only root writes
    fd = safeopen.open_root(tmp_path / "models")
    try:
        assert os.listdir(fd) == ["model.safetensors"]
    finally:
        os.close(fd)
    fd = safeopen.open_root(secret / ".." / "root-only")  # no link: opened as named
    os.close(fd)
