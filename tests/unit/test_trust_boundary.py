"""The trust boundary: root acts only on what it verified.

vLLM runs as its own user (played here by VLLM_UID, a real unprivileged uid), parses untrusted
client input, owns its folders and answers on a port; any local user (OTHER_UID) can listen on
loopback. For every path the root daemon touches that another uid can write or rename, and every
socket it believes, a row says what the daemon does there and what it does when the other party
cheats. The rows run real processes as those uids, on real folders; each asserts that what the
cheat aimed at (root's files, another user's) is untouched.

Rules held elsewhere with their own tables, on the same boundary: /dev/shm and /tmp leftovers
(tests/unit/test_leftovers.py), the profile guard's routes (tests/unit/test_profile_guard.py),
the control socket's peers (tests/unit/test_control_accept.py), the model folder's reads
(tests/unit/test_safeopen.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kimi_supervisor.capture import retention
from kimi_supervisor.capture.job import Capture, CaptureSpec, _move_into, check_out
from kimi_supervisor.capture.tracedir import TraceDir, Untrusted
from kimi_supervisor.config import Config, one_address
from kimi_supervisor.model import Mode
from kimi_supervisor.ports import launcher
from kimi_supervisor.ports.http import request

from .loophost import config_for

VLLM_UID = 4242  # vLLM's own user (the unit's User=)
OTHER_UID = 4343  # any local user
ASKER_UID = 4444  # a member of the control group who asked for a capture
# The other parties' scripts need only the standard library; the project's interpreter may sit
# in a folder they cannot enter (a checkout in root's 0700 home).
PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play other uids")


@dataclass
class Host:
    """A folder laid out as a host's: root's state, a root-only folder, another user's folder,
    and vLLM's user's home with its trace folder."""

    base: Path

    @property
    def state(self) -> Path:
        return self.base / "state"

    @property
    def secret(self) -> Path:
        return self.base / "root-only"

    @property
    def others(self) -> Path:
        return self.base / "others"

    @property
    def vhome(self) -> Path:
        return self.base / "vllm-home"

    @property
    def traces(self) -> Path:
        return self.vhome / "traces"

    def build(self) -> Host:
        os.chmod(self.base, 0o755)  # vLLM's user passes through, as to /var/lib/kimi-supervisor
        for d, owner, mode in (
            (self.state, 0, 0o700),
            (self.secret, 0, 0o700),
            (self.others, OTHER_UID, 0o755),
            (self.vhome, VLLM_UID, 0o755),
            (self.traces, VLLM_UID, 0o755),
        ):
            d.mkdir()
            os.chown(d, owner, owner)
            os.chmod(d, mode)
        for d, names in ((self.state, ("state.json", "history.jsonl", "lock")),
                         (self.secret, ("shadow",)), (self.others, ("notes.txt",))):  # fmt: skip
            for n in names:
                (d / n).write_text(f"{d.name}/{n}\n")
                os.chown(d / n, os.stat(d).st_uid, os.stat(d).st_uid)
        return self

    def untouched(self) -> list[str]:
        """What of root's and the other user's files changed (empty: none did)."""
        wrong = []
        for d in (self.state, self.secret, self.others):
            for f in sorted(d.iterdir()):
                st = os.lstat(f)
                if not stat.S_ISREG(st.st_mode) or f.read_text() != f"{d.name}/{f.name}\n":
                    wrong.append(f"{f}: changed")
                if st.st_uid != os.stat(d).st_uid:
                    wrong.append(f"{f}: chowned to {st.st_uid}")
        expected = {"state": 3, "root-only": 1, "others": 1}
        for d in (self.state, self.secret, self.others):
            if len(list(d.iterdir())) != expected[d.name]:
                wrong.append(f"{d}: {sorted(os.listdir(d))}")
        return wrong


@pytest.fixture
def host() -> Iterator[Host]:
    base = Path(tempfile.mkdtemp(prefix="kimi-trust-", dir="/tmp"))
    try:
        yield Host(base).build()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_user(uid: int, code: str, *args: str) -> None:
    """Run `code` (Python) as `uid`, as that user would: no capability of root's."""
    subprocess.run(
        [PYTHON, "-c", code, *args], user=uid, group=uid, extra_groups=[], check=True,
        timeout=60,
    )  # fmt: skip


SWAP = """
import os, sys
folder, target = sys.argv[1], sys.argv[2]
os.rename(folder, folder + ".moved")
os.symlink(target, folder)
"""


# -- the rows: each sets its case up on `host`, lets the other party cheat, and returns what
# the daemon did, in a word; the table says which word is right.


def swapped_for_a_link_to(target: str) -> Callable[[Host], str]:
    def case(h: Host) -> str:
        (h.traces / "rank0.pt.trace.json").write_text("{}")
        os.chown(h.traces / "rank0.pt.trace.json", VLLM_UID, VLLM_UID)
        with TraceDir.open(h.traces, VLLM_UID) as t:
            as_user(VLLM_UID, SWAP, str(h.traces), str(getattr(h, target)))
            why = t.replaced()
            listed = t.files()  # still the folder judged, wherever it was renamed to
        assert set(listed) == {"rank0.pt.trace.json"}, listed
        return "nothing taken" if why else "taken"

    return case


def link_at_the_start(h: Host) -> str:
    h.traces.rmdir()
    as_user(VLLM_UID, "import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(h.state),
            str(h.traces))  # fmt: skip
    return opened(h)


def opened(h: Host) -> str:
    try:
        TraceDir.open(h.traces, VLLM_UID).close()
    except Untrusted:
        return "refused"
    return "entered"


def parent_writable_by_others(h: Host) -> str:
    os.chmod(h.vhome, 0o777)
    return opened(h)


def sticky_parent(h: Host) -> str:
    os.chmod(h.vhome, 0o1777)  # as /tmp: nobody else may rename vLLM's user's folder in it
    return opened(h)


def sticky_trace_folder(h: Host) -> str:
    os.chmod(h.traces, 0o1777)  # /tmp itself as the trace folder: anyone fills it with names
    return opened(h)


def owned_by_another_user(h: Host) -> str:
    os.chown(h.traces, OTHER_UID, OTHER_UID)
    return opened(h)


def link_placed_by_vllms_user_above(h: Host) -> str:
    (h.vhome / "real").mkdir()
    os.chown(h.vhome / "real", VLLM_UID, VLLM_UID)
    h.traces.rename(h.vhome / "real" / "traces")
    as_user(VLLM_UID, "import os, sys; os.symlink(sys.argv[1], sys.argv[2])",
            str(h.vhome / "real"), str(h.vhome / "shortcut"))  # fmt: skip
    try:
        TraceDir.open(h.vhome / "shortcut" / "traces", VLLM_UID).close()
    except Untrusted:
        return "refused"
    return "entered"


def relative_link_root_placed(h: Host) -> str:
    """A link root placed in a folder only root can change, relative and through `..`
    (Fedora's /var/run -> ../run): followed back to the folder judged before."""
    lib = h.base / "lib"
    lib.mkdir(mode=0o755)
    (lib / "run").symlink_to("../vllm-home")  # root's, in root's folder
    try:
        TraceDir.open(lib / "run" / "traces", VLLM_UID).close()
    except Untrusted:
        return "refused"
    return "entered"


def unknown_vllm_user(h: Host) -> str:
    try:
        TraceDir.open(h.traces, None).close()
    except Untrusted:
        return "refused"
    return "entered"


def handed_over(h: Host, name: str) -> str:
    """What happens to `name` in the trace folder when a capture takes it."""
    capture = h.base / "capture"
    capture.mkdir()
    with TraceDir.open(h.traces, VLLM_UID) as t:
        listed = t.files()
        if name not in listed:
            return "not listed"
        fd = os.open(capture, os.O_RDONLY | os.O_DIRECTORY)
        try:
            why = _move_into(t, name, listed[name][2], dir_fd=fd, uid=ASKER_UID, gid=ASKER_UID)
        finally:
            os.close(fd)
    return "handed over" if not why else "left where it was"


def roots_file_linked_in(h: Host) -> str:
    os.link(h.state / "state.json", h.traces / "state.json")  # as root could; protected_hardlinks
    return handed_over(h, "state.json")


def roots_file_put_in(h: Host) -> str:
    shutil.copy(h.secret / "shadow", h.traces / "rank1.pt.trace.json")  # root's, one name
    return handed_over(h, "rank1.pt.trace.json")


def vllms_own_trace(h: Host) -> str:
    as_user(VLLM_UID, "import sys; open(sys.argv[1], 'w').write('{}')",
            str(h.traces / "rank0.pt.trace.json"))  # fmt: skip
    return handed_over(h, "rank0.pt.trace.json")


def fifo_in_the_folder(h: Host) -> str:
    as_user(VLLM_UID, "import os, sys; os.mkfifo(sys.argv[1])", str(h.traces / "rank0.json"))
    return handed_over(h, "rank0.json")


def sparse_trace_copied_across_file_systems(h: Host) -> str:
    """vLLM's user's trace folder on another file system (tmpfs) than the capture's: the trace
    is copied, and a sparse one of a gibibyte must cost neither the space nor the time."""
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kimi-trust-"))
    try:
        os.chown(shm, VLLM_UID, VLLM_UID)
        os.chmod(shm, 0o755)
        as_user(VLLM_UID, "import sys\nf = open(sys.argv[1], 'wb'); f.write(b'{}')\n"
                "f.truncate(1 << 30)", str(shm / "rank0.pt.trace.json"))  # fmt: skip
        capture = h.base / "capture"
        capture.mkdir()
        with TraceDir.open(shm, VLLM_UID) as t:
            listed = t.files()
            fd = os.open(capture, os.O_RDONLY | os.O_DIRECTORY)
            try:
                why = _move_into(t, "rank0.pt.trace.json", listed["rank0.pt.trace.json"][2],
                                 dir_fd=fd, uid=ASKER_UID, gid=ASKER_UID)  # fmt: skip
            finally:
                os.close(fd)
        assert why == "", why
        st = os.stat(capture / "rank0.pt.trace.json")
        assert st.st_size == 1 << 30 and st.st_uid == ASKER_UID
        with open(capture / "rank0.pt.trace.json", "rb") as f:
            assert f.read(2) == b"{}"
        return "holes kept" if st.st_blocks * 512 < (1 << 20) else f"{st.st_blocks} blocks"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def sparse_terabyte_in_a_capture(h: Host) -> str:
    captures = h.base / "captures"
    captures.mkdir()
    made = ["20261201T100000.000Z", "20261201T110000.000Z", "20261201T120000.000Z"]
    for name in made:
        (captures / name).mkdir()
        (captures / name / "rank0.json").write_bytes(b"x" * 4096)
        retention.record(captures, name)
    as_user(0, "import sys; open(sys.argv[1], 'wb').truncate(1 << 40)",
            str(captures / made[1] / "huge"))  # fmt: skip
    removed = retention.retention(captures, keep=10, max_total_gb=1.0, newest=made[2])
    return "removed others" if removed else "nothing removed"


def a_file_linked_two_thousand_times_in_a_capture(h: Host) -> str:
    captures = h.base / "captures"
    captures.mkdir()
    made = ["20261201T100000.000Z", "20261201T110000.000Z", "20261201T120000.000Z"]
    for name in made:
        (captures / name).mkdir()
        os.chown(captures / name, ASKER_UID, ASKER_UID)  # the asker owns their capture
        (captures / name / "rank0.json").write_bytes(b"x" * 4096)
        retention.record(captures, name)
    as_user(ASKER_UID, "import os, sys\nopen(sys.argv[1] + '/big', 'wb').write(b'x' * (1 << 20))\n"
            "for i in range(2000): os.link(sys.argv[1] + '/big', f'{sys.argv[1]}/l{i}')",
            str(captures / made[1]))  # fmt: skip
    removed = retention.retention(captures, keep=10, max_total_gb=0.1, newest=made[2])
    return "removed others" if removed else "nothing removed"


def out_of_another_user(h: Host) -> str:
    fd = os.open(h.others, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return "refused" if check_out(fd, ASKER_UID) else "accepted"
    finally:
        os.close(fd)


def cache_writable_by_others(h: Host) -> str:
    cache = h.vhome / "cache"
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    return "refused" if launcher.cache_untrusted(cache) else "used"


def localhost_with_two_addresses(_h: Host) -> str:
    """Debian's /etc/hosts: `::1 localhost` beside `127.0.0.1 localhost`."""

    def debian(host: str, *_a: object, **_k: object) -> list[tuple[object, ...]]:
        assert host == "localhost"
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]  # fmt: skip

    with pytest.MonkeyPatch.context() as m:
        m.setattr(socket, "getaddrinfo", debian)
        try:
            one_address("localhost")
        except ValueError as e:
            assert "127.0.0.1, ::1" in str(e), e
            return "refused"
    return "accepted"


LISTENER = """
import socket, sys
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(family)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if sys.argv[4:] == ["defer"]:  # no accept until the client speaks: a request socket till then
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 30)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("ready", flush=True)
got = 0
s.settimeout(30)
while True:
    try:
        c, _ = s.accept()
    except OSError:
        break
    c.settimeout(2)
    try:
        while data := c.recv(65536):
            got += len(data)
            if b"\\r\\n\\r\\n" in data:
                c.sendall(b"HTTP/1.1 503 Service Unavailable\\r\\nContent-Length: 0\\r\\n\\r\\n")
                break
    except OSError:
        pass
    c.close()
    open(sys.argv[3], "w").write(str(got))
"""


@contextlib.contextmanager
def listener(
    uid: int, address: str, port: int, got: Path, *how: str
) -> Iterator[subprocess.Popen[str]]:
    """A listener of `uid`'s on address:port that answers 503 and counts what it receives
    (`how`: "defer" defers its accepts until the client speaks)."""
    got.write_text("0")
    os.chmod(got, 0o666)
    p = subprocess.Popen(
        [PYTHON, "-c", LISTENER, address, str(port), str(got), *how], user=uid, group=uid,
        extra_groups=[], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()  # our own child, by its PID
        p.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def another_users_listener_on_the_address(h: Host) -> str:
    port, got = free_port(), h.base / "got"
    with listener(OTHER_UID, "127.0.0.1", port, got):
        r = request(f"http://127.0.0.1:{port}/health", timeout_s=10, peer_uid=VLLM_UID)
    assert got.read_text() == "0", "the intruder received bytes"
    return "not believed" if r.intruder and r.status == 0 else f"believed ({r.status})"


def another_users_deferred_listener_while_vllm_runs_as_root(h: Host) -> str:
    """vLLM as root (no User=): a listener that defers its accept leaves a request socket on
    the connection's other end, which sock_diag says is root's."""
    port, got = free_port(), h.base / "got"
    with listener(OTHER_UID, "127.0.0.1", port, got, "defer"):
        r = request(f"http://127.0.0.1:{port}/health", timeout_s=10, peer_uid=0)
    assert got.read_text() == "0", "the intruder received bytes"
    return "not believed" if r.intruder else f"believed ({r.status})"


def vllms_users_listener(h: Host) -> str:
    port, got = free_port(), h.base / "got"
    with listener(VLLM_UID, "127.0.0.1", port, got):
        r = request(f"http://127.0.0.1:{port}/health", timeout_s=10, peer_uid=VLLM_UID)
    return f"believed ({r.status})" if not r.intruder else "not believed"


def another_users_listener_on_ipv6_loopback(h: Host) -> str:
    """vLLM at its one literal 127.0.0.1; a local user listens on [::1] at the same port."""
    port, got = free_port(), h.base / "got"
    with (
        listener(VLLM_UID, "127.0.0.1", port, h.base / "vllm-got"),
        listener(OTHER_UID, "::1", port, got),
    ):
        r = request(f"http://{one_address('127.0.0.1')}:{port}/health", timeout_s=10,
                    peer_uid=VLLM_UID)  # fmt: skip
    assert got.read_text() == "0", "the intruder on [::1] received bytes"
    return f"believed ({r.status})" if not r.intruder else "not believed"


NAMED = """
import sys, time
open("/proc/self/comm", "w").write(sys.argv[1])
print("ready", flush=True)
time.sleep(60)
"""


def a_process_named_to_inject_a_notify_field(h: Host) -> str:
    """A port holder's comm reaches the STUCK status line, which goes to sd_notify: a name with
    a newline would add a field of its own (MAINPID=, STOPPING=), believed as root's."""
    from kimi_supervisor.ports.notify import Notifier
    from kimi_supervisor.ports.processes import comm_of

    p = subprocess.Popen(
        [PYTHON, "-c", NAMED, "\nMAINPID=1\n."], user=OTHER_UID, group=OTHER_UID,
        extra_groups=[], stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.bind(str(h.base / "notify"))
            s.settimeout(10)
            with pytest.MonkeyPatch.context() as m:
                m.setenv("NOTIFY_SOCKET", str(h.base / "notify"))
                Notifier().status(f"STUCK: PID {p.pid} ({comm_of(p.pid)}) listens on the port")
            fields = s.recv(4096).decode().split("\n")
    finally:
        p.kill()  # our own child, by its PID
        p.wait(30)
    return "one field" if len(fields) == 1 and fields[0].startswith("STATUS=") else str(fields)


Row = Callable[..., str]

TABLE = [
    # (what the daemon does there | how it verifies), the cheat, the expected outcome
    pytest.param(swapped_for_a_link_to("state"), "nothing taken",
                 id="the trace folder swapped for a link to the state folder: nothing is taken"),
    pytest.param(swapped_for_a_link_to("secret"), "nothing taken",
                 id="the trace folder swapped for a link to a root-only folder: nothing is taken"),
    pytest.param(swapped_for_a_link_to("others"), "nothing taken",
                 id="the trace folder swapped for a link to another user's folder: none taken"),
    pytest.param(link_at_the_start, "refused",
                 id="a trace folder that is a link at the capture's start is refused"),
    pytest.param(parent_writable_by_others, "refused",
                 id="a folder above the trace folder that anyone can write is refused"),
    pytest.param(sticky_parent, "entered",
                 id="a sticky folder above vLLM's user's trace folder is entered as /tmp is"),
    pytest.param(sticky_trace_folder, "refused",
                 id="a trace folder anyone can write, sticky as /tmp, is refused"),
    pytest.param(owned_by_another_user, "refused",
                 id="a trace folder owned by neither root nor vLLM's user is refused"),
    pytest.param(link_placed_by_vllms_user_above, "refused",
                 id="a link vLLM's user placed on the way to the trace folder is not followed"),
    pytest.param(relative_link_root_placed, "entered",
                 id="a relative link root placed through '..' is followed as root meant"),
    pytest.param(unknown_vllm_user, "refused",
                 id="with vLLM's user unknown no trace folder is judged and none entered"),
    pytest.param(roots_file_linked_in, "left where it was",
                 id="root's state hard-linked into the trace folder is never handed over"),
    pytest.param(roots_file_put_in, "left where it was",
                 id="a file of root's in the trace folder is never handed over"),
    pytest.param(fifo_in_the_folder, "not listed",
                 id="a FIFO in the trace folder is not listed and never opened"),
    pytest.param(vllms_own_trace, "handed over",
                 id="a trace vLLM's user wrote is handed over to the asker"),
    pytest.param(sparse_trace_copied_across_file_systems, "holes kept",
                 id="a sparse trace copied across file systems keeps its holes"),
    pytest.param(sparse_terabyte_in_a_capture, "nothing removed",
                 id="a sparse terabyte in one capture removes no other capture"),
    pytest.param(a_file_linked_two_thousand_times_in_a_capture, "nothing removed",
                 id="a file linked 2000 times in one capture counts once and removes nothing"),
    pytest.param(out_of_another_user, "refused",
                 id="an --out folder of another user is refused"),
    pytest.param(cache_writable_by_others, "refused",
                 id="a vLLM cache folder anyone can write is not used"),
    pytest.param(localhost_with_two_addresses, "refused",
                 id="vllm.host localhost with ::1 and 127.0.0.1 is refused by the config"),
    pytest.param(another_users_listener_on_the_address, "not believed",
                 id="another user's listener on vLLM's address gets nothing and is not believed"),
    pytest.param(another_users_listener_on_ipv6_loopback, "believed (503)",
                 id="another user's listener on ::1 gets nothing while vLLM's address answers"),
    pytest.param(another_users_deferred_listener_while_vllm_runs_as_root, "not believed",
                 id="a listener deferring its accepts is judged by its owner, not as root's"),
    pytest.param(vllms_users_listener, "believed (503)",
                 id="vLLM's user's own listener is believed"),
    pytest.param(a_process_named_to_inject_a_notify_field, "one field",
                 id="a process named with a newline reaches sd_notify as one escaped field"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "expected"), TABLE)
def test_root_acts_only_on_what_it_verified(case: Row, expected: str, host: Host) -> None:
    assert case(host) == expected
    assert host.untouched() == []


# -- a whole capture against a vLLM that cheats during its flush

FAKE_VLLM = r"""
import http.server, json, os, sys, time
traces, port, swap_to = sys.argv[1], int(sys.argv[2]), sys.argv[3]
METRICS = b'vllm:generation_tokens_total{engine="0"} 7\n'
class H(http.server.BaseHTTPRequestHandler):
    def _send(self, body=b""):
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self._send(METRICS if self.path == "/metrics" else b"")
    def do_POST(self):
        if self.path == "/stop_profile":
            for r in (0, 1):
                with open(os.path.join(traces, f"1-rank-{r}.1.pt.trace.json"), "w") as f:
                    f.write(json.dumps({"traceEvents": []}))
            if swap_to:
                os.rename(traces, traces + ".moved")
                os.symlink(swap_to, traces)
                try:  # vLLM's later writes follow the link: where its user may not write
                    open(os.path.join(traces, "late.pt.trace.json"), "w").write("{}")
                except OSError:
                    pass
        self._send(b"{}")
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def capture_config(h: Host, port: int) -> Config:
    c = config_for(h.base / "daemon")
    return c.model_copy(
        update={
            "vllm": c.vllm.model_copy(update={"port": port}),
            "profiling": c.profiling.model_copy(
                update={
                    "vllm_trace_dir": h.traces,
                    "start_timeout_s": 30.0,
                    "summarize": False,
                    "stall_after_s": 0.0,
                }
            ),
        }
    )


def run_capture(h: Host, swap_to: str, out: Path | None) -> tuple[Capture, Config]:
    port = free_port()
    vllm = subprocess.Popen(
        [PYTHON, "-c", FAKE_VLLM, str(h.traces), str(port), swap_to], user=VLLM_UID,
        group=VLLM_UID, extra_groups=[],
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60  # a loaded host starts an interpreter slowly
        while request(f"http://127.0.0.1:{port}/health", timeout_s=2).status != 200:
            assert time.monotonic() < deadline and vllm.poll() is None, "the fake vLLM's start"
            time.sleep(0.05)
        config = capture_config(h, port)
        out_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY) if out is not None else None
        spec = CaptureSpec(
            seconds=0.1, then="stay", out=out, by="test", out_fd=out_fd, uid=ASKER_UID,
            gid=ASKER_UID, mode=Mode.PROFILE, vllm_uid=VLLM_UID,
        )  # fmt: skip
        done = threading.Event()
        c = Capture(
            config, spec, lambda _e: None, on_done=lambda _c: done.set(), log=lambda *_a, **_k: None
        )
        c.start()
        assert done.wait(120), "the capture's end"
        return c, config
    finally:
        vllm.kill()  # our own child, by its PID
        vllm.wait(30)


@pytest.mark.parametrize("with_out", [False, True], ids=["into captures_dir", "with --out"])
@pytest.mark.parametrize(
    "target",
    ["state", "secret", "others"],
    ids=["to the state folder", "to a root-only folder", "to another user's folder"],
)
def test_a_trace_folder_swapped_for_a_link_during_the_flush_takes_nothing_and_says_why(
    host: Host, target: str, with_out: bool
) -> None:
    out = None
    if with_out:
        out = host.base / "asker-out"
        out.mkdir()
        os.chown(out, ASKER_UID, ASKER_UID)
    c, config = run_capture(host, str(getattr(host, target)), out)
    assert not c.ok, c.message
    assert "was replaced during the capture" in c.message and "nothing was taken" in c.message
    assert host.untouched() == []
    # Nothing made, moved or chowned on the capture's side; vLLM's traces stay where it wrote.
    where = out if out is not None else config.profiling.captures_dir
    assert not [p for p in where.iterdir() if not p.name.startswith(".")], list(where.iterdir())
    moved = Path(f"{host.traces}.moved")
    assert sorted(os.listdir(moved)) == ["1-rank-0.1.pt.trace.json", "1-rank-1.1.pt.trace.json"]
    assert {os.stat(p).st_uid for p in moved.iterdir()} == {VLLM_UID}


def test_a_capture_nobody_cheats_on_hands_vllms_traces_to_the_asker(host: Host) -> None:
    c, config = run_capture(host, "", None)
    assert c.ok, c.message
    assert c.folder is not None and c.folder.parent == config.profiling.captures_dir
    names = sorted(os.listdir(c.folder))
    assert names == ["1-rank-0.1.pt.trace.json", "1-rank-1.1.pt.trace.json"], names
    assert {os.stat(c.folder / n).st_uid for n in names} == {ASKER_UID}
    assert os.listdir(host.traces) == [] and host.untouched() == []
    json.loads((c.folder / names[0]).read_text())
