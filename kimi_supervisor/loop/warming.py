"""Warming: before a switch's teardown, while the old mode still serves, the next mode's model
files are read into the page cache, so that the new vLLM reads its weights from memory during
the downtime instead of from disk (decide/warmset.py says which files and how many fit).

It runs on the switch's job thread, before the teardown, and reports through the inbox
(`Warmed`). The reading itself is done by a reader process (ports/pagecache.py), moved into a
scope of its own, and this thread only listens to it, never longer than POLL_S at a time: a
read stuck in a hung mount can never hold the switch, a stop or a --force. The warming gives up
at `warm.timeout_s`, when a --force switch takes over, at a stop, and when the old vLLM exits
(the loop sets `stop`): the reader is killed, and one the kernel keeps (its reads stuck) is
left where it is, counted as `abandoned`, never waited for. While such a reader is left, no
other warming starts (say so, and skip): at most one reader is ever left. What it found, read,
refused and left is in the status, the live display, the log and the switch's history record.
"""

from __future__ import annotations

import os
import pwd
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kimi_supervisor.config import WarmConfig
from kimi_supervisor.decide import warmset
from kimi_supervisor.model import shown
from kimi_supervisor.ports import pagecache
from kimi_supervisor.ports.clock import Clock
from kimi_supervisor.ports.systemd import SystemdError, SystemdPort
from kimi_supervisor.status import WarmStatus

GB = 1e9
REPORT_S = 0.5  # progress at most this often
POLL_S = 0.05  # the longest this thread listens before it looks at the stop and the deadline
# How long a killed reader has to end before it counts as stuck in the kernel: a reader that is
# not stuck ends within milliseconds of its SIGKILL.
KILL_WAIT_S = 0.5


def warm(
    config: WarmConfig,
    argv: list[str],
    stop: threading.Event,
    *,
    clock: Clock,
    report: Callable[[WarmStatus], None],
    adopt: Callable[[int], str] = lambda _pid: "",
    why: Callable[[], str] = lambda: "",
    env: Mapping[str, str] | None = None,
    home: str | None = None,
) -> WarmStatus:
    """Read the files vLLM started with `argv` will read; the last report is returned.
    `adopt(pid)` moves the reader into a scope of its own and says where ("" if it could not);
    `why()` says what set `stop`."""
    t0 = clock.monotonic()
    src = warmset.source_of(argv)
    if src is None:
        return WarmStatus(under_way=False, text="nothing warmed: vLLM's argv names no model")
    left = pagecache.stuck_readers()
    if left:
        return WarmStatus(
            under_way=False,
            text=f"nothing warmed: the reader an earlier warming left (PID {left[0]}) is still "
            "stuck in the kernel (a hung mount?); no other reader starts until it returns",
        )
    looks = warmset.candidates(
        src,
        os.environ if env is None else env,
        os.path.expanduser("~") if home is None else home,
    )
    try:
        reader = pagecache.Reader.start()
    except OSError as e:
        return WarmStatus(under_way=False, text=f"nothing warmed: the reader did not start: {e}")
    return _Warden(config, reader, stop, clock=clock, report=report, why=why, t0=t0).run(
        looks, adopt(reader.pid)
    )


def vllm_env(systemd: SystemdPort, unit: str) -> tuple[dict[str, str], str | None]:
    """The environment and home vLLM's unit gives it, where the hub's cache is looked for
    (`HF_HUB_CACHE`, `HF_HOME`, else ~/.cache/huggingface/hub): its `Environment=`, and the
    home of its `User=` (systemd sets HOME from it). The package's unit runs vLLM as kimi-vllm,
    whose cache is under /var/lib/kimi-vllm, not root's. None for the home when the user cannot
    be said (DynamicUser=, no such user, no bus): then the daemon's own is looked at, which
    `--download-dir` in the argv avoids. On the loop's thread (a D-Bus read)."""
    try:
        env = systemd.environment(unit)
        uid = systemd.run_as(unit)
    except SystemdError:
        return {}, None
    if "HOME" in env:
        return env, env["HOME"]
    try:
        return env, (pwd.getpwuid(uid).pw_dir if uid is not None else None)
    except KeyError:
        return env, None


# The refusals said by name (status, the history, the journal); past them, a count.
MAX_REFUSED = 20


class _Warden:
    """Listens to the reader with a deadline, and gives it up."""

    def __init__(
        self,
        config: WarmConfig,
        reader: pagecache.Reader,
        stop: threading.Event,
        *,
        clock: Clock,
        report: Callable[[WarmStatus], None],
        why: Callable[[], str],
        t0: float,
    ) -> None:
        self.config, self.reader, self.stop, self.clock = config, reader, stop, clock
        self.report, self.why, self.t0 = report, why, t0
        self.deadline = t0 + config.timeout_s
        self.status = WarmStatus(under_way=True, text="warming the page cache: listing the files")
        self.picked: set[str] = set()
        self.refused: list[str] = []
        self._refused_set: set[str] = set()
        self.refused_more = 0  # refusals past MAX_REFUSED, counted only
        self.read_bytes = 0
        self.reading = 0

    def run(self, looks: list[dict[str, str]], left_in: str) -> WarmStatus:
        self.reader.ask({"find": looks})
        self.report(self.status)
        last_report = time.monotonic()  # pacing only, on the real clock: no deadline
        end = ""  # why it ended before its reader said "done"
        while True:
            now = self.clock.monotonic()
            if self.stop.is_set() or now >= self.deadline:
                return self._give_up("aborted" if self.stop.is_set() else "timeout", left_in)
            msg = self.reader.next(min(POLL_S, self.deadline - now))
            if msg is not None:
                end = self._heard(msg)
                if end:
                    break
            if self.status.files and time.monotonic() - last_report >= REPORT_S:
                last_report = time.monotonic()
                self.report(self._said("", True))
        self.reader.end(KILL_WAIT_S)
        if end == "done":
            return self._said("", False)
        return self.status.model_copy(update={"under_way": False, "text": end})

    def _heard(self, msg: dict[str, Any]) -> str:
        """One message of the reader's; what ended the warming ("done", or why not), or ""."""
        if "listed" in msg:
            return self._plan(msg["listed"])
        if "progress" in msg or "done" in msg:
            p = msg.get("progress") or msg["done"]
            self.read_bytes, self.reading = int(p["read_bytes"]), int(p["reading"])
            self._refuse(p["refused"])
            return "done" if "done" in msg else ""
        if "error" in msg:
            return f"nothing warmed: {msg['error']}"
        code = msg.get("eof")
        return f"nothing warmed: the reader ended early (exit {code})"

    def _plan(self, listed: dict[str, Any]) -> str:
        files = {name: int(size) for name, size in listed["files"]}
        picked = warmset.pick(list(files))
        self.picked = set(picked) | set(warmset.pick([n for n, _why in listed["refused"]]))
        self._refuse(listed["refused"])
        try:
            mem = pagecache.memory()
        except pagecache.PageCacheError as e:
            return f"nothing warmed: {e}"
        plan = warmset.plan([(n, files[n]) for n in picked], mem.available,
                            self.config.max_ram_share)  # fmt: skip
        self.status = WarmStatus(
            under_way=True,
            folder=shown(listed["folder"]),
            files=len(plan.read),
            bytes=plan.read_bytes,
            skipped=[shown(n) for n, _ in plan.skipped],
            skipped_bytes=plan.skipped_bytes,
            budget_bytes=plan.budget,
            text="",
        )
        if not plan.read:
            return "done"
        self.reader.ask({"read": [n for n, _ in plan.read], "threads": self.config.threads})
        return ""

    def _refuse(self, refused: list[list[str]]) -> None:
        """Each refusal of a file vLLM reads, said once (another entry is not vLLM's), up to
        MAX_REFUSED: a folder of 80,000 links is a count, not 5 MB of status."""
        for name, why in refused:
            said = f"{shown(name)}: {why}"
            if name not in self.picked or said in self._refused_set:
                continue
            self._refused_set.add(said)
            if len(self.refused) < MAX_REFUSED:
                self.refused.append(said)
            else:
                self.refused_more += 1

    def _give_up(self, stopped: str, left_in: str) -> WarmStatus:
        ended = self.reader.end(KILL_WAIT_S)
        out = self._said(stopped, False)
        if ended:
            return out
        # The kernel keeps it: its reads are stuck (or, before a listing, its open or list).
        stuck = max(self.reading, 1)
        where = left_in or "the daemon's own unit (no scope could be made for it)"
        text = (
            f"{out.text}; {stuck} read(s) stuck in the kernel abandoned: the reader (PID "
            f"{self.reader.pid}) is left in {where} until they return (a hung mount?)"
        )
        return out.model_copy(
            update={"abandoned": stuck, "reader_pid": self.reader.pid, "left_in": left_in,
                    "text": text}
        )  # fmt: skip

    def _said(self, stopped: str, under_way: bool) -> WarmStatus:
        s, read, took = self.status, self.read_bytes, self.clock.monotonic() - self.t0
        rate = f" at {read / took / GB:.2f} GB/s" if took > 0 and read >= GB / 100 else ""
        text = (
            f"warmed {read / GB:.2f} of {s.bytes / GB:.2f} GB ({s.files} files) in {took:.1f} s"
            f"{rate}"
        )
        if not s.folder:
            text = "nothing warmed: the model's folder was not listed yet"
        if under_way:
            text = f"warming the page cache: {read / GB:.2f} of {s.bytes / GB:.2f} GB"
        if stopped == "aborted":
            text += f"; stopped: {self.why() or 'the switch goes on without waiting for it'}"
        elif stopped == "timeout":
            text += f"; stopped at warm.timeout_s ({self.config.timeout_s:g} s)"
        if s.skipped:
            text += (
                f"; skipped {len(s.skipped)} file(s), {s.skipped_bytes / GB:.2f} GB: they do not "
                f"fit in warm.max_ram_share of MemAvailable ({s.budget_bytes / GB:.2f} GB); vLLM "
                "reads them from disk"
            )
        if self.refused:
            more = f"; and {self.refused_more} more" if self.refused_more else ""
            text += f"; not opened (not the files judged): {'; '.join(self.refused)}{more}"
        return s.model_copy(
            update={"read_bytes": read, "took_s": round(took, 2), "stopped": stopped,
                    "under_way": under_way, "refused": list(self.refused), "text": text}
        )  # fmt: skip
