"""The page cache port on real files (ports/pagecache.py) and the launcher's cache directory
(ports/launcher.py): what the daemon, as root, reads to warm a model and where vLLM may find
compiled code. Their domain's edges: links out of the model's tree, FIFOs and devices where a
file was, another user's directory on the cache's path."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kimi_supervisor.ports import pagecache
from kimi_supervisor.ports.launcher import cache_untrusted


def test_memory_is_read_from_meminfo_and_a_bad_one_is_said(tmp_path: Path) -> None:
    m = tmp_path / "meminfo"
    m.write_text("MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   12000000 kB\n")
    assert pagecache.memory(m) == pagecache.Memory(12_000_000 * 1024, 24_000_000 * 1024)
    m.write_text("MemTotal: 1 kB\n")
    with pytest.raises(pagecache.PageCacheError, match="no MemAvailable"):
        pagecache.memory(m)
    assert pagecache.memory().available > 0  # this host's


def test_a_model_s_files_are_its_regular_files_and_links_inside_its_tree_only(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (repo / "blobs" / "b1").write_bytes(b"x" * 10)
    (snap / "model.safetensors").symlink_to("../../blobs/b1")  # the hub's layout
    secret = tmp_path / "elsewhere"
    secret.write_text("not the model's")
    (snap / "leak.json").symlink_to(secret)  # out of the tree: not read
    os.mkfifo(snap / "fifo.json")  # would block a reader forever
    (snap / "sub").mkdir()
    (snap / "sub" / "x.safetensors").write_bytes(b"y")  # not in the folder vLLM reads
    (snap / "config.json").write_text("{}")
    found = pagecache.files_in(snap, repo)
    assert [(f.path.name, f.size) for f in found] == [("config.json", 2), ("model.safetensors", 10)]
    assert [f.path.name for f in pagecache.files_in(snap)] == ["config.json"]  # tree = folder


def test_a_file_is_read_through_to_its_listed_size_and_a_stop_ends_it_between_reads(
    tmp_path: Path,
) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(os.urandom(3 * 1024 + 7))
    got: list[int] = []
    buffer = bytearray(1024)
    n = pagecache.read_through(
        pagecache.File(f, f.stat().st_size), lambda: False, got.append, buffer
    )
    assert n == 3 * 1024 + 7 and got == [1024, 1024, 1024, 7]
    # Grown after it was listed: read only as far as it was then.
    with open(f, "ab") as out:
        out.write(b"z" * 5000)
    assert pagecache.read_through(pagecache.File(f, 100), lambda: False, got.append, buffer) == 100
    stop = threading.Event()

    def done(k: int) -> None:
        stop.set()  # a --force switch arrives during the first read

    assert pagecache.read_through(pagecache.File(f, 8000), stop.is_set, done, buffer) == 1024


def test_a_fifo_or_device_put_where_a_file_was_listed_is_never_read(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    os.mkfifo(p)
    never = pagecache.read_through(pagecache.File(p, 10), lambda: False, lambda _n: None,
                                   bytearray(16))  # fmt: skip
    assert never == 0  # returned at once: opened non-blocking, not a regular file
    zero = pagecache.File(Path("/dev/zero"), 1 << 40)
    assert pagecache.read_through(zero, lambda: False, lambda _n: None, bytearray(16)) == 0


def test_the_cache_dir_is_made_private_and_refused_where_another_user_could_write(
    tmp_path: Path,
) -> None:
    tmp_path.chmod(0o755)
    d = tmp_path / "cache" / "vllm"
    assert cache_untrusted(d) is None
    assert d.is_dir() and d.stat().st_mode & 0o777 == 0o700
    (tmp_path / "cache").chmod(0o777)  # anyone may replace vllm/ with their own code
    assert "writable by its group or others" in (cache_untrusted(d) or "")
    (tmp_path / "cache").chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(d)
    assert "not a directory (a link?)" in (cache_untrusted(link) or "")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        os.chown(theirs, 65534, 65534)  # nobody's
        assert "owned by uid 65534" in (cache_untrusted(theirs / "vllm") or "x")
