"""A switch's warming as an operator, and an attacker on the same host, would meet it.

- The next mode's model on a mount whose reads never return: a FUSE file system of the tests'
  own (tests/hungfs.py), mounted over the sandbox's hub cache in the daemon's own mount
  namespace (its unit has PrivateMounts=yes), standing in for a hung NFS or object-store mount.
  The switch must go on at `warm.timeout_s`; `--force` and `systemctl stop` must return within
  their bounds; a vLLM killed meanwhile must be started again; status must never say `warming`
  once the warming gave up; the stuck reader is left in a scope of its own, said, and never
  taken for a GPU holder.
- The model's folder owned by another user, who swaps shards after the listing for a link to a
  root-only file, a FIFO, a device and another file: root never opens any of them (watched
  with inotify on each inode).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.ports import processes
from kimi_supervisor.sandbox.sandbox import UNIT
from tests import hungfs
from tests.inotify import Watch

from ..conftest import DaemonHelper, SandboxHelper, as_user, flat, too_wide, wait_until

pytestmark = [
    pytest.mark.systemd,
    pytest.mark.skipif(bool(hungfs.unavailable()), reason=hungfs.unavailable() or "-"),
]

REPO = "models--moonshotai--Kimi-K2.5"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
NOBODY = 65534


# ------------------------------------------------------------------------------ helpers
@contextlib.contextmanager
def configured(sandbox: SandboxHelper, hub: Path, **warm: float) -> Iterator[None]:
    """The sandbox's config with the model's hub cache at `hub` and `warm` settings, for the
    daemon started inside the block; the original config afterwards."""
    path = sandbox.sb.config_path
    original = path.read_text()
    text = original.replace(f'"{sandbox.sb.root}/hub"', f'"{hub}"')
    assert text != original and "\n[warm]\n" in text
    for key, value in warm.items():
        text, n = re.subn(rf"(\[warm\][^\[]*?\n){key} = [^\n]*", rf"\g<1>{key} = {value}", text)
        assert n == 1, key
    path.write_text(text)
    try:
        yield
    finally:
        path.write_text(original)


def readers_of(daemon_pid: int) -> list[int]:
    """The daemon's warming readers (its children named kimi-warm)."""
    return [
        p
        for p in processes.all_pids()
        if processes.ppid_of(p) == daemon_pid and processes.comm_of(p) == "kimi-warm"
    ]


def all_readers() -> list[int]:
    """Every warming reader on the host, whoever its parent is now."""
    return [p for p in processes.all_pids() if processes.comm_of(p) == "kimi-warm"]


def left(pid: int) -> bool:
    """The process is still there (a reader the kernel keeps: stuck, or a zombie with a
    thread stuck)."""
    return Path(f"/proc/{pid}").exists()


def in_fuse(pid: int) -> bool:
    """A thread of `pid` waits for the FUSE server's answer (a read that never returns)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        with contextlib.suppress(OSError):
            if (task / "wchan").read_text() == "request_wait_answer":
                return True
    return False


class StatusWatch:
    """`status` every 50 ms on a thread of its own: (time, state, status_line, warm)."""

    def __init__(self, daemon: DaemonHelper) -> None:
        self.daemon = daemon
        self.seen: list[tuple[float, str, str, dict[str, Any] | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(Exception):
                s = self.daemon.status()
                self.seen.append((time.monotonic(), s["state"], s["status_line"], s["warm"]))

    def stop(self) -> list[tuple[float, str, str, dict[str, Any] | None]]:
        self._stop.set()
        self._thread.join(5)
        return self.seen


def said_warming(line: tuple[float, str, str, dict[str, Any] | None]) -> bool:
    _t, state, status_line, warm = line
    return state == "warming" or "warming" in status_line or bool(warm and warm["under_way"])


def warmed(daemon: DaemonHelper) -> list[dict[str, Any]]:
    """The daemon's `warmed` log lines (a warming's end each)."""
    out = []
    for line in daemon.log().splitlines():
        with contextlib.suppress(ValueError):
            e = json.loads(line)
            if e.get("event") == "warmed":
                out.append(e)
    return out


@pytest.fixture
def hung(sandbox: SandboxHelper, daemon: DaemonHelper) -> Iterator[subprocess.Popen[bytes]]:
    """The daemon serving production with the hub cache a hung mount in its namespace (its
    shards' reads never return; refs/main and config.json answer), warm.timeout_s 6 s. Yields
    the FUSE server; ending it at the test's end fails the stuck reads (their reader ends)."""
    hub = sandbox.sb.root / "hung-hub"
    hub.mkdir(exist_ok=True)
    snap = f"{REPO}/snapshots/{COMMIT}"
    tree: dict[str, object] = {
        f"{REPO}/refs/main": COMMIT,
        f"{REPO}/blobs/c1": "{}",
        f"{REPO}/blobs/s1": {"hang": 1 << 30},
        f"{REPO}/blobs/s2": {"hang": 1 << 30},
        f"{snap}/config.json": {"link": "../../blobs/c1"},
        f"{snap}/model-00001-of-00002.safetensors": {"link": "../../blobs/s1"},
        f"{snap}/model-00002-of-00002.safetensors": {"link": "../../blobs/s2"},
    }
    with configured(sandbox, hub, timeout_s=6, threads=2):
        daemon.start()
        daemon.wait_serving("production")
        with hungfs.mounted(hub, tree, mntns_of=daemon.pid()) as server:
            yield server
    # The mount gone, every stuck read fails: the readers end (a stopped daemon's too).
    wait_until(lambda: not any(map(in_fuse, all_readers())), 10, "the readers to end")


def switch_and_wait_stuck(daemon: DaemonHelper, mode: str = "profile") -> int:
    """Ask for `mode` and return once the warming's reader is stuck in the hung mount."""
    r = daemon.kimi_mode(mode, "--no-wait")
    assert r.returncode == 0, r.stderr
    daemon.wait_state("warming", 10)
    found: list[int] = []

    def stuck() -> bool:
        found[:] = [p for p in readers_of(daemon.pid()) if in_fuse(p)]
        return bool(found)

    wait_until(stuck, 10, "the warming's reader to be stuck in the hung mount")
    return found[0]


# ------------------------------------------------------------------------------ a hung mount
def test_a_switch_whose_model_reads_hang_goes_on_at_warm_timeout_s_and_leaves_its_reader(
    sandbox: SandboxHelper, daemon: DaemonHelper, hung: subprocess.Popen[bytes]
) -> None:
    pid, vllm = daemon.pid(), daemon.vllm_pid()
    watch = StatusWatch(daemon)
    reader = switch_and_wait_stuck(daemon)
    daemon.wait_status(lambda s: s["state"] in ("tearing_down", "starting"), 15, "giving up")
    text = daemon.kimi_mode("status").stdout  # as a person reads it, while the switch goes on
    status = daemon.wait_serving("profile", 60)
    seen = watch.stop()
    assert "warming:" not in text and "page cache:" in text, text
    assert not too_wide(text), text
    said = flat(text)  # the lines as wrapped at 80 columns, joined
    assert "stopped at warm.timeout_s (6 s)" in said
    assert f"the reader (PID {reader}) is left in kimi-supervisor-warm-{reader}.scope" in said
    assert "a warming's reader is left" in said  # the warning
    # It gave up at warm.timeout_s (6 s) and the switch went on: the last "warming" status is
    # within the bound, and none says warming after the first that did not.
    warming = [line[0] for line in seen if said_warming(line)]
    assert warming, "no status said warming"
    said_for = max(warming) - min(warming)
    print(f"measured: status said warming for {said_for:.2f} s (warm.timeout_s 6 s)")
    first_after = next(i for i, line in enumerate(seen) if line[0] > max(warming))
    assert not any(said_warming(line) for line in seen[first_after:])
    assert daemon.vllm_pid() != vllm and daemon.pid() == pid
    end = warmed(daemon)[-1]
    assert (end["stopped"], end["reader_pid"]) == ("timeout", reader)
    assert end["took_s"] >= 6, end["took_s"]  # not before its deadline ("timeout": at it)
    assert end["abandoned"] >= 1 and "stuck in the kernel abandoned" in end["text"]
    record = daemon.transitions()[-1]
    assert record["outcome"] == "ready" and record["downtime"]["warm"]["abandoned"] >= 1
    # Left in a scope of its own, outside the daemon's unit (whose stop it cannot hold), said
    # in status while it lasts, and never taken for a GPU holder by the teardown.
    assert f"kimi-supervisor-warm-{reader}.scope" in Path(f"/proc/{reader}/cgroup").read_text()
    assert end["left_in"] == f"kimi-supervisor-warm-{reader}.scope"
    assert any(w.startswith("a warming's reader is left") for w in status["warnings"])
    assert left(reader)
    # A second switch while it is left starts no other reader: skipped at once, and said.
    t1 = time.monotonic()
    assert daemon.kimi_mode("production").returncode == 0
    print(f"measured: the second switch, warming skipped, took {time.monotonic() - t1:.2f} s")
    skipped = warmed(daemon)[-1]
    assert f"the reader an earlier warming left (PID {reader}) is still stuck" in skipped["text"]
    assert readers_of(daemon.pid()) == [reader]
    # The mount answers again (its server gone): the reader ends, and the warning goes.
    hung.kill()
    daemon.wait_status(
        lambda s: not any(w.startswith("a warming's reader is left") for w in s["warnings"]),
        15,
        "the warning to go once the reader ended",
    )


def test_a_forced_switch_during_a_stuck_warming_returns_within_its_bound(
    sandbox: SandboxHelper, daemon: DaemonHelper, hung: subprocess.Popen[bytes]
) -> None:
    reader = switch_and_wait_stuck(daemon)
    t0 = time.monotonic()
    r = daemon.kimi_mode("production", "--force", timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    status = daemon.wait_serving("production", 5)
    print(f"measured: kimi-mode production --force returned, production served, in {took:.2f} s")
    end = warmed(daemon)[-1]  # "aborted", not "timeout": the switch ended it, not its deadline
    assert end["stopped"] == "aborted" and end["reader_pid"] == reader
    assert "stopped: a --force switch to production took over" in end["text"]
    assert status["warm"] is None and status["state"] == "serving"
    assert hung.poll() is None  # the bystanders: the mount's server, the reader left
    assert left(reader)


def test_systemctl_stop_during_a_stuck_warming_returns_within_its_bound(
    sandbox: SandboxHelper, daemon: DaemonHelper, hung: subprocess.Popen[bytes]
) -> None:
    """Before, `systemctl stop` waited the unit's TimeoutStopSec (10 minutes) here; a reader
    left in the daemon's own cgroup would still hold it that long (measured: 20 of 20 s)."""
    reader = switch_and_wait_stuck(daemon)
    t0 = time.monotonic()
    assert daemon.stopped_by_itself(), "the stop waited for the stuck reader"
    print(f"measured: systemctl stop returned in {time.monotonic() - t0:.2f} s")
    assert daemon.unit() == "inactive"
    assert sandbox.systemd.status(UNIT).inactive  # vLLM torn down, as a stop does
    assert hung.poll() is None and left(reader)  # left
    end = warmed(daemon)[-1]
    assert end["stopped"] == "aborted" and "stopped: the daemon is stopping" in end["text"]


def test_a_vllm_killed_during_a_stuck_warming_is_started_again(
    sandbox: SandboxHelper, daemon: DaemonHelper, hung: subprocess.Popen[bytes]
) -> None:
    """Before, nothing restarted it and status kept saying "warming the page cache"."""
    pid = daemon.pid()
    reader = switch_and_wait_stuck(daemon)
    old = processes.ref_of(daemon.vllm_pid())
    assert old is not None
    t0 = time.monotonic()
    processes.send_signal(old, signal.SIGKILL)
    daemon.wait_status(lambda s: s["state"] != "warming", 5, "the warming to give up")
    status = daemon.wait_serving("profile", 60)
    print(f"measured: profile served {time.monotonic() - t0:.2f} s after vLLM's SIGKILL")
    assert daemon.vllm_pid() != old.pid and daemon.pid() == pid
    end = warmed(daemon)[-1]
    assert end["stopped"] == "aborted" and "the old vLLM exited" in end["text"]
    assert status["state"] == "serving" and "warming" not in status["status_line"]
    assert hung.poll() is None and left(reader)  # bystanders


# ------------------------------------------------------------------------------ swapped shards
SWAPPER = r"""
import os, sys, time
from tests.inotify import Watch
snap, staging = sys.argv[1], sys.argv[2]
os.mkfifo(f"{staging}/fifo")
with open(f"{staging}/other", "wb") as f:
    f.write(b"not the file listed")
watch = Watch(f"{snap}/model-00001-of-00005.safetensors")
print("ready", flush=True)
watch.opened(120)  # root's warming opened the first shard: the listing is done
os.symlink(sys.argv[3], f"{staging}/link")
os.rename(f"{staging}/link", f"{snap}/model-00002-of-00005.safetensors")
os.rename(f"{staging}/fifo", f"{snap}/model-00003-of-00005.safetensors")
os.rename(f"{staging}/dev", f"{snap}/model-00004-of-00005.safetensors")
os.rename(f"{staging}/other", f"{snap}/model-00005-of-00005.safetensors")
print("swapped", flush=True)
time.sleep(3600)
"""


def test_shards_another_user_swaps_after_the_listing_are_never_opened_by_root(
    sandbox: SandboxHelper, daemon: DaemonHelper, python: str
) -> None:
    """The issue's four variants: root opened a root-only file through a link, a FIFO, and
    /dev/null and /dev/zero. Now each is refused and said; inotify sees no open of any."""
    base = Path(tempfile.mkdtemp(prefix="kimi-swap-"))
    base.chmod(0o755)
    swapper: subprocess.Popen[bytes] | None = None
    try:
        secret = base / "root-only"
        secret.write_text("root's secret\n")
        secret.chmod(0o600)
        repo = base / "hub" / REPO
        snap = repo / "snapshots" / COMMIT
        staging = base / "staging"
        for d in (repo / "refs", snap, staging):
            d.mkdir(parents=True)
        (repo / "refs" / "main").write_text(COMMIT)
        (snap / "config.json").write_text("{}")
        with open(snap / "model-00001-of-00005.safetensors", "wb") as f:
            f.truncate(2 << 30)  # holes: about a second to read, while the swaps happen
        for i in range(2, 6):
            (snap / f"model-0000{i}-of-00005.safetensors").write_bytes(os.urandom(1 << 20))
        # A device the folder's owner can rename: /dev/null's numbers, at a path they own.
        os.mknod(staging / "dev", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        for p in [base / "hub", repo, *repo.rglob("*"), staging, staging / "dev"]:
            os.chown(p, NOBODY, NOBODY, follow_symlinks=False)
        swapper = subprocess.Popen(
            [*as_user(f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"), "-c",
             SWAPPER, str(snap), str(staging), str(secret)],
            stdout=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        assert swapper.stdout is not None
        assert swapper.stdout.readline().startswith(b"ready")
        watch = Watch(secret, staging / "fifo", staging / "dev", staging / "other")
        with configured(sandbox, base / "hub", threads=1):
            daemon.start()
            daemon.wait_serving("production")
            assert daemon.kimi_mode("profile").returncode == 0
        assert swapper.stdout.readline().startswith(b"swapped")
        assert watch.opened() == [], "root opened what the shards were swapped for"
        end = warmed(daemon)[-1]
        refused = end["refused"]
        assert len(refused) == 4, end["text"]
        assert "model-00002-of-00005.safetensors: a symbolic link" in refused[0]
        assert "model-00003-of-00005.safetensors: a FIFO, not a regular file" in refused[1]
        assert "model-00004-of-00005.safetensors: a character device" in refused[2]
        assert "model-00005-of-00005.safetensors: replaced since it was listed" in refused[3]
        assert "not opened (not the files judged)" in end["text"]
        assert end["read_bytes"] == 2 + (2 << 30)  # config.json and the first shard only
        assert daemon.status()["state"] == "serving"  # the switch went on
        assert swapper.poll() is None  # the bystander: the folder's owner
        watch.close()
    finally:
        if swapper is not None:
            swapper.kill()
            swapper.wait()
        shutil.rmtree(base, ignore_errors=True)
