"""I/O that hangs in the kernel holds no command of the daemon, and kills nothing.

- The state folder on a real file system frozen by the kernel (`fsfreeze` of an ext4 on a loop
  device): every write waits in state D until it is thawed, as on a hung disk. The daemon
  answers status at once, refuses a switch it cannot persist with the reason, restarts a vLLM
  that died meanwhile, and writes what it kept, once, when the folder answers.
- A GPU driver that answers no NVML call (the simulated host's `nvml_hang`, which copies what a
  hung driver does: no call returns): status says the GPUs cannot be read; a switch's teardown
  ends STUCK before it stops anything, the serving vLLM serves on, and the retry switches once
  the driver answers.

Needs root, a loop device, mkfs.ext4 and fsfreeze: skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT
from kimi_supervisor.sandbox.simreader import HANG

from ..conftest import DaemonHelper, SandboxHelper, flat, wait_until

TIMEOUT_S = 2  # state.timeout_s and gpus.timeout_s here (10 s shipped)
FROZEN_S = 10  # state.timeout_s where an answer must come well before it, even on a busy host


def unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root (a loop device and fsfreeze)"
    for tool in ("losetup", "mkfs.ext4", "fsfreeze", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control: loop devices are not available here"
    return ""


pytestmark = [pytest.mark.systemd, pytest.mark.skipif(bool(unavailable()), reason=unavailable())]


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


@contextlib.contextmanager
def on_a_freezable_disk(folder: Path, ns_of: int) -> Iterator[Callable[[str], None]]:
    """`folder` on an ext4 of its own (content, owner and mode kept), mounted in the mount
    namespace of `ns_of` (the sandbox's manager: its services see their own mounts) and moved
    back afterwards. Yields `fsfreeze(option)`; thawed first at the end, whatever happened."""
    work = Path(tempfile.mkdtemp(prefix="kimi-freeze-"))
    image = work / "state.img"
    run("truncate", "-s", "32M", str(image))
    run("mkfs.ext4", "-q", "-F", str(image))
    device = run("losetup", "--find", "--show", str(image)).strip()
    ns = ["nsenter", f"--mount=/proc/{ns_of}/ns/mnt", "sh", "-euc"]
    f, m, kept = shlex.quote(str(folder)), shlex.quote(str(work / "m")), str(work / "kept")
    try:
        run(*ns, f"mkdir {m}; mount {device} {m}; cp -a {f}/. {m}/; rm -rf {m}/lost+found; "
            f"chown --reference={f} {m}; chmod --reference={f} {m}; umount {m}; "
            f"mount {device} {f}")  # fmt: skip
        try:
            yield lambda option: print(run(*ns, f"fsfreeze {option} {f}"), end="")
        finally:
            subprocess.run([*ns, f"fsfreeze -u {f}"], capture_output=True, timeout=30)
            run(*ns, f"mkdir {kept}; cp -a {f}/. {kept}/; umount {f}; cp -a {kept}/. {f}/")
    finally:
        run("losetup", "-d", device)
        shutil.rmtree(work)


def bounded(daemon: DaemonHelper) -> contextlib.AbstractContextManager[None]:
    """The sandbox's config with both deadlines at TIMEOUT_S, for the daemon started inside."""
    return daemon.configured(state={"timeout_s": TIMEOUT_S}, gpus={"timeout_s": TIMEOUT_S})


def warned(daemon: DaemonHelper, prefix: str) -> bool:
    return any(w.startswith(prefix) for w in daemon.status()["warnings"])


def test_a_frozen_state_disk_holds_no_command_and_what_was_kept_is_written_once_after(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    folder = sandbox.config.state.dir
    bystander = sandbox.spawn([sys.executable, "-c", "import time; time.sleep(600)"])
    with (
        daemon.configured(state={"timeout_s": FROZEN_S}, gpus={"timeout_s": TIMEOUT_S}),
        on_a_freezable_disk(folder, sandbox.sb.manager.pid) as fsfreeze,
    ):
        daemon.start()
        daemon.wait_serving("production")
        before, first = len(daemon.history()), daemon.vllm_pid()
        fsfreeze("-f")
        try:
            # Answered before any call to the frozen disk could have given up (FROZEN_S): from
            # memory. The switch is refused at that deadline, said with it, not held by the disk.
            (reply,) = daemon.request({"cmd": "status"}, FROZEN_S)
            assert reply["ok"] and reply["data"]["state"] == "serving", reply  # type: ignore[index]
            r = daemon.kimi_mode("profile", timeout=FROZEN_S + 60)
            assert r.returncode != 0, r.stdout
            assert "cannot be persisted" in flat(r.stdout + r.stderr), r.stdout + r.stderr
            assert f"no answer in {FROZEN_S} s" in flat(r.stdout + r.stderr), r.stdout + r.stderr
            wait_until(lambda: warned(daemon, "the state folder does not answer"), 10, "said")
            # vLLM dies meanwhile: the daemon restarts it all the same.
            os.kill(first, 9)  # the sandbox's own vLLM, started for this test
            daemon.wait_serving_anew("production", first, 60)
            assert daemon.status()["desired_mode"] == "production"
        finally:
            fsfreeze("-u")
        wait_until(lambda: not warned(daemon, "the state folder does not answer"), 30, "gone")
        wait_until(lambda: not daemon.status()["warnings"], 30, "every warning to go")
        written = daemon.history()[before:]
        gone = [e for e in written if e["kind"] == "incident" and "is gone" in e["what"]]
        assert len(gone) == 1, written
        assert [e["kind"] for e in written].count("transition") == 1, written
        daemon.stop()  # before its folder is moved back
    assert bystander.pid and os.path.exists(f"/proc/{bystander.pid}")


def io_processes(scope: str) -> list[int]:
    """Root's I/O processes of a daemon (named kimi-io) in a scope whose name starts `scope`."""
    found = []
    for name in os.listdir("/proc"):
        try:
            if not name.isdigit() or Path(f"/proc/{name}/comm").read_text().strip() != "kimi-io":
                continue
            cgroup = Path(f"/proc/{name}/cgroup").read_text()
        except OSError:
            continue
        if f"/{scope}" in cgroup and os.stat(f"/proc/{name}").st_uid == 0:
            found.append(int(name))
    return found


def state_of(pid: int) -> str:
    """The process's state letter (D: in the kernel, uninterruptible), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def test_a_stop_while_the_state_disk_is_frozen_returns_and_leaves_the_stuck_write_in_its_scope(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """A thread stuck in state D holds its process's exit, so the stop waited for the thaw or
    for TimeoutStopSec (10 min). The state folder's calls run in a process of their own, in a
    scope of its own: the stop returns, and that process ends after the thaw."""
    folder = sandbox.config.state.dir
    bystander = sandbox.spawn([sys.executable, "-c", "import time; time.sleep(600)"])
    stuck: list[int] = []
    with bounded(daemon), on_a_freezable_disk(folder, sandbox.sb.manager.pid) as fsfreeze:
        daemon.start()
        daemon.wait_serving("production")
        fsfreeze("-f")
        try:
            r = daemon.kimi_mode("profile", timeout=60)  # its write waits in the kernel
            said = flat(r.stdout + r.stderr)
            assert r.returncode != 0 and "cannot be persisted" in said, said

            def in_the_kernel() -> bool:
                stuck[:] = [
                    p for p in io_processes("kimi-supervisor-io-state-") if state_of(p) == "D"
                ]
                return bool(stuck)

            wait_until(in_the_kernel, 10, "the state write to wait in the kernel, in its scope")
            main = daemon.pid()
            # Before TimeoutStopSec, after which systemd gives up on a process the kernel keeps.
            assert daemon.stopped_by_itself(), "the stop waited for the frozen disk"
            assert not state_of(main), "the daemon's own process ended"
            assert all(state_of(p) == "D" for p in stuck), "left as it is, not waited for"
        finally:
            fsfreeze("-u")
        wait_until(lambda: not any(state_of(p) for p in stuck), 30, "it to end after the thaw")
    assert bystander.pid and os.path.exists(f"/proc/{bystander.pid}")


def test_a_daemon_started_on_a_frozen_state_disk_waits_for_it_says_so_and_serves_once_thawed(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """The state folder inside a frozen file system (below its mount point: a look-up of the
    mount point itself is answered by the file system above). The start read the state on the
    daemon's main thread, and a frozen disk held it there with no word why; exiting instead
    would have had systemd restart it every few seconds until its start limit, the unit then
    down for good. The read is asked of the state folder's process and waited for in the
    same daemon, said in the unit's status and the log; once thawed, that daemon serves."""
    top = Path(tempfile.mkdtemp(prefix="frozen-", dir=sandbox.sb.root))
    os.chmod(top, 0o755)
    folder = top / "state"
    shutil.copytree(sandbox.config.state.dir, folder, symlinks=True)
    # No lock file yet (a first start on a frozen /var): making it waits in the kernel, as
    # every write there does. An open of what exists, a read, a look-up answer at once.
    (folder / "state.lock").unlink(missing_ok=True)

    def status_text() -> str:
        r = sandbox.sb.manager.systemctl("show", "-p", "StatusText", "--value", DAEMON_UNIT)
        return r.stdout.strip()

    with (
        daemon.configured(state={"timeout_s": TIMEOUT_S, "dir": folder}),
        on_a_freezable_disk(top, sandbox.sb.manager.pid) as fsfreeze,
    ):
        fsfreeze("-f")
        try:
            daemon.start(wait=False)
            try:
                wait_until(lambda: "state_folder_waiting" in daemon.log(), TIMEOUT_S + 20, "it")
            except AssertionError as e:
                raise AssertionError(f"{e}; its log ends: {daemon.log()[-3000:]}") from None
            assert f"no answer in {TIMEOUT_S} s" in flat(daemon.log()), daemon.log()[-2000:]
            pid = daemon.pid()
            # Three deadlines on, the same daemon still waits, and says how long.
            wait_until(
                lambda: re.search(r"waiting for the state folder for (\d+) s", status_text())
                and int(re.search(r"for (\d+) s", status_text()).group(1)) >= 3 * TIMEOUT_S,
                30, "the unit's status to say how long it has waited",
            )  # fmt: skip
            assert daemon.pid() == pid and daemon.unit() == "activating", "never restarted"
            stuck = [p for p in io_processes("kimi-supervisor-io-state-") if state_of(p) == "D"]
            assert stuck, "the read it gave up on waits in the kernel, in its scope"
        finally:
            fsfreeze("-u")
        daemon.wait_serving("production", 60)
        assert daemon.pid() == pid and "state_folder_answered" in daemon.log()
        # The read given up on returned: its process serves the daemon's next calls.
        wait_until(lambda: all(state_of(p) != "D" for p in stuck), 30, "the stuck read to end")
        daemon.stop()  # before its folder is moved back


def test_a_stop_while_the_start_waits_for_a_frozen_state_disk_ends_it_at_once(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    """`systemctl stop` while the start waits for its folder: the daemon sees the SIGTERM
    it has not unblocked yet, and exits within a poll, not at TimeoutStopSec."""
    top = Path(tempfile.mkdtemp(prefix="frozen-", dir=sandbox.sb.root))
    os.chmod(top, 0o755)
    folder = top / "state"
    shutil.copytree(sandbox.config.state.dir, folder, symlinks=True)
    (folder / "state.lock").unlink(missing_ok=True)
    with (
        daemon.configured(state={"timeout_s": TIMEOUT_S, "dir": folder}),
        on_a_freezable_disk(top, sandbox.sb.manager.pid) as fsfreeze,
    ):
        fsfreeze("-f")
        try:
            daemon.start(wait=False)
            wait_until(lambda: "state_folder_waiting" in daemon.log(), TIMEOUT_S + 20, "it")
            assert daemon.stopped_by_itself(), "the stop waited for the frozen disk"
            assert daemon.unit() == "inactive"
        finally:
            fsfreeze("-u")


def test_a_driver_that_answers_nothing_stops_no_vllm_and_the_switch_waits_for_it(
    sandbox: SandboxHelper, daemon: DaemonHelper
) -> None:
    hang = sandbox.sb.gpu_dir / HANG
    with bounded(daemon):
        daemon.start()
        daemon.wait_serving("production")
        served = daemon.vllm_pid()
        hang.touch()
        try:
            r = daemon.kimi_mode("profile", "--no-wait", timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr
            st = daemon.wait_state("stuck", 30)
            assert st["last_teardown"]["diagnosis"].startswith("the GPUs could not be read"), st
            assert any(w.startswith("cannot read the GPUs: NVML") for w in st["warnings"]), st
            assert not st["last_teardown"]["kills"]
            assert daemon.vllm_pid() == served, "the serving vLLM was not stopped on no reading"
        finally:
            hang.unlink(missing_ok=True)
        st = daemon.wait_serving_anew("profile", served, 60)
        assert not any(w.startswith("cannot read the GPUs") for w in st["warnings"])
