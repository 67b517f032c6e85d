"""The page cache port on real files (ports/pagecache.py) and the launcher's cache directory
(ports/launcher.py): what the daemon, as root, reads to warm a model and where vLLM may find
compiled code. Their domain's edges: links out of the model's tree, FIFOs and devices where a
file was, another user's directory on the cache's path. The open rule itself, case by case, is
in test_safeopen.py; a reader whose reads never return, in test_warming.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kimi_supervisor.ports import pagecache, safeopen
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
    (snap / "up.json").symlink_to("../../../elsewhere")  # out of the tree, relatively
    os.mkfifo(snap / "fifo.json")  # would block a reader forever
    (snap / "sub").mkdir()
    (snap / "sub" / "x.safetensors").write_bytes(b"y")  # not in the folder vLLM reads
    (snap / "config.json").write_text("{}")
    fd = safeopen.open_root(repo)
    try:
        listing = pagecache.files_in(fd, "snapshots/abc")
    finally:
        os.close(fd)
    assert [(f.name, f.rel, f.size) for f in listing.files] == [
        ("config.json", "snapshots/abc/config.json", 2),
        ("model.safetensors", "blobs/b1", 10),  # opened at its blob, which the listing saw
    ]
    blob = os.stat(repo / "blobs" / "b1")
    assert (listing.files[1].listed.dev, listing.files[1].listed.ino) == (blob.st_dev, blob.st_ino)
    assert sorted(listing.refused) == [
        ("fifo.json", "a FIFO, never opened"),
        ("leak.json", "a link out of the model's tree"),
        ("up.json", "a link out of the model's tree"),
    ]
    fd = safeopen.open_root(snap)  # the folder is the tree: ../../blobs leaves it
    try:
        listing = pagecache.files_in(fd)
    finally:
        os.close(fd)
    assert [f.name for f in listing.files] == ["config.json"]


def listed(path: Path, size: int | None = None) -> tuple[int, pagecache.File]:
    """`path`'s folder as the tree, and `path` as the listing saw it."""
    st = os.stat(path)
    ident = safeopen.Identity(st.st_dev, st.st_ino, st.st_size if size is None else size)
    return safeopen.open_root(path.parent), pagecache.File(path.name, path.name, ident)


def test_a_file_is_read_through_to_its_listed_size_and_a_stop_ends_it_between_reads(
    tmp_path: Path,
) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(os.urandom(3 * 1024 + 7))
    got: list[int] = []
    buffer = bytearray(1024)
    tree, file = listed(f)
    try:
        assert (
            pagecache.read_through(tree, file, lambda: False, done=got.append, buffer=buffer)
            == 3 * 1024 + 7
        )
        assert got == [1024, 1024, 1024, 7]
        # Grown after it was listed: read only as far as it was then.
        with open(f, "ab") as out:
            out.write(b"z" * 5000)
        small = pagecache.File(file.name, file.rel, safeopen.Identity(file.listed.dev,
                               file.listed.ino, 100))  # fmt: skip
        assert (
            pagecache.read_through(tree, small, lambda: False, done=got.append, buffer=buffer)
            == 100
        )
        stop = threading.Event()

        def done(k: int) -> None:
            stop.set()  # a --force switch arrives during the first read

        assert pagecache.read_through(tree, file, stop.is_set, done=done, buffer=buffer) == 1024
    finally:
        os.close(tree)


def test_a_fifo_put_where_a_file_was_listed_is_refused_at_once(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"x")
    tree, file = listed(p)
    try:
        p.unlink()
        os.mkfifo(p)
        with pytest.raises(safeopen.Refused, match="a FIFO"):
            pagecache.read_through(
                tree, file, lambda: False, done=lambda _n: None, buffer=bytearray(16)
            )
    finally:
        os.close(tree)


def test_the_reader_process_finds_a_hub_snapshot_reads_it_and_says_what_it_refused(
    tmp_path: Path,
) -> None:
    hub = tmp_path / "hub"
    repo = hub / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee\n")
    snap = repo / "snapshots" / "c0ffee"
    snap.mkdir(parents=True)
    (repo / "blobs" / "b1").write_bytes(b"x" * 5000)
    (snap / "model-00001-of-00001.safetensors").symlink_to("../../blobs/b1")
    (snap / "config.json").write_text("{}")
    (snap / "tokenizer.json").symlink_to("/etc/passwd")
    reader = pagecache.Reader.start()
    try:
        hub_repo = {"root": str(hub), "repo": "models--org--m", "rev": "main"}
        reader.ask({"find": [{"root": "org/m"}, hub_repo]})  # no local folder org/m: the hub
        listed = reader.next(30)
        assert (
            listed is not None
            and listed["listed"]["folder"] == f"{hub}/models--org--m/snapshots/c0ffee"
        )
        assert listed["listed"]["refused"] == [["tokenizer.json", "a link out of the model's tree"]]
        reader.ask({"read": ["config.json", "model-00001-of-00001.safetensors"], "threads": 2})
        while (msg := reader.next(30)) is not None and "done" not in msg:
            assert "progress" in msg, msg
        assert msg == {"done": {"read_bytes": 5002, "reading": 0, "refused": []}}
    finally:
        assert reader.end(30)  # it had ended: nothing is left
    # Of this one: a sandbox test's daemon may have left its own elsewhere on the machine.
    assert reader.pid not in pagecache.stuck_readers()


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


def test_a_reader_an_earlier_daemon_left_is_found_by_its_name_owner_and_scope(
    tmp_path: Path,
) -> None:
    """A daemon restarted (not re-executed) has no child of the readers its predecessor left
    stuck: it found none, and started another (an outside review left two). Root's process
    named kimi-warm in a kimi-supervisor-warm-* scope is one; another user's, or one elsewhere,
    is not. Read from a /proc laid out as the kernel's."""
    from kimi_supervisor.ports import pagecache

    def process(pid: int, comm: bytes, cgroup: str, uid: int = 0) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "comm").write_bytes(comm + b"\n")
        (d / "cgroup").write_text(f"0::{cgroup}\n")
        os.chown(d, uid, uid)

    scope = f"/system.slice/{pagecache.SCOPE_PREFIX}41.scope"
    process(41, b"kimi-warm", scope)
    process(42, b"kimi-warm", scope, uid=4245)  # another user's look-alike
    process(43, b"kimi-warm", "/system.slice/kimi-supervisor.service")  # not in its scope
    process(44, b"python3", scope)
    process(45, b"kimi-warm", f"/kimi-sbx-1/app.slice/{pagecache.SCOPE_PREFIX}45.scope")
    (tmp_path / "self").mkdir()
    assert pagecache._orphaned(tmp_path) == [41, 45], "where this process's cgroup is unknown"
    (tmp_path / "self" / "cgroup").write_text(
        "1:name=systemd:/system.slice/kimi-supervisor.service\n"
        "0::/system.slice/kimi-supervisor.service\n"
    )
    # another manager's (a sandbox's, side by side) stuck reader holds no warming here
    assert pagecache._orphaned(tmp_path) == [41]
