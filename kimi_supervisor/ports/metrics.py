"""Prometheus metrics on a localhost port (prometheus-client's registry, our own server thread).

Named as Prometheus asks (base units: `_bytes`, `_seconds`; counters `_total`). Per-GPU series
carry `gpu` (the index) and `uuid`, the label dcgm-exporter uses, so the two join. The shipped
alert rules (config/prometheus/kimi-supervisor-alerts.yml) and dashboard
(config/grafana/kimi-supervisor.json) query these names; a test checks each against a live
/metrics.

The loop sets them; the exporter thread only reads. Off when metrics.enabled is false.

The server (`MetricsServer`) is one thread that never blocks on a client: any local user may
connect, and one idle connection to a server that answered one request at a time with no timeout
blinded every scrape. Every connection is non-blocking and has one deadline for its
whole exchange (`timeout_s` from its accept: the request whole, then the answer taken), so a
client that trickles a byte a second is closed at it too. At most `max_connections` are held:
a new one closes the oldest. A request that came with its connection, as a scraper's does, is
answered in the same pass as its accept, before any later connection can push it out. The
answer is prometheus-client's own WSGI app's (formats, gzip, `name[]`). The thread sleeps in
select until a connection or a deadline: nothing wakes an idle daemon (prometheus-client's own
server wakes twice a second to check for shutdown, which alone cost 0.5% of a core).
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import platform
import re
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)

from kimi_supervisor.model import STALL_WINDOWS, Evidence, Mode, Step
from kimi_supervisor.version import package_version

MIB = 1 << 20

# One connection's whole exchange, from its accept: its request whole, then its answer taken.
# Prometheus sends its request at once and reads the answer at once.
TIMEOUT_S = 10.0
# Connections held at once; a new one beyond them closes the oldest. Each costs a descriptor of
# the daemon's (whose soft limit is 1024) and at most one request and one answer in memory.
MAX_CONNECTIONS = 128
# A request's line and headers, at most (Prometheus sends about 250 bytes).
MAX_REQUEST_BYTES = 8192
# What a client sends after its request is read (and dropped) this much at a time.
DRAIN_BYTES = 65536
# Connections the kernel queues until the thread accepts them. Past it, a client's SYN is dropped
# and sent again a second later: under a flood of connections, 128 cost root's scrapes that second.
BACKLOG = 1024
# Connections accepted per pass, at most: between batches, the requests that have come are read
# first, so that a flood of new connections pushes out none that has asked.
ACCEPT_BATCH = 8
# An answer rendered is reused this long for the same request (a scraper every 15 s never sees
# one this old; a flood of requests costs one render per interval), and so many kept at most.
RENDER_REUSE_S = 0.5
MAX_RENDERED = 16
RENDER_KEY = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "HTTP_ACCEPT", "HTTP_ACCEPT_ENCODING")
# accept(2) errors that say the daemon is out of a resource: tried again after a doubling wait.
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
# The end of a request's headers (a bare LF is taken, as from `printf | nc`).
_HEAD_END = re.compile(rb"\r?\n\r?\n")
# The thread ends at close(): it wakes at once; this only bounds the join.
CLOSE_JOIN_S = 2.0


# Every labelled counter's label values, made at 0 when the daemon starts: a panel or an alert
# over `increase()` reads 0, not "no data", until the first event.
KILL_STEPS = (Step.KILL_CGROUP, Step.KILL_STRAYS, Step.KILL_GPU_HOLDERS)
TRANSITION_OUTCOMES = (
    "ready", "preempted", "rolled_back", "failed", "intruded", "stuck", "stopped"
)  # fmt: skip
PERSISTED_FILES = ("state.json", "history.jsonl")
DROP_REASONS = ("timeout", "evicted", "too_large")
CAPTURE_OUTCOMES = ("ok", "failed")
# The liveness verdict, as kimi_supervisor_liveness{verdict} says it: `progress` (serving, no
# sign against it), `doubt` (one sign says no progress, the other not: never restarted),
# `not_judged` (not serving, a capture holds the verdict, or no reading).
LIVENESS_VERDICTS = ("progress", "doubt", "not_judged")
# A GPU's health signals, as kimi_supervisor_gpu_health{signal} says them: named after the
# DCGM field that carries each (DCGM_FI_DEV_XID_ERRORS, _ROW_REMAP_PENDING, _ROW_REMAP_FAILURE,
# _RETIRED_PENDING, _ECC_DBE_VOL_TOTAL), lower case, so that a fleet joins the two;
# nvlink_errors sums the CRC, replay and recovery counts DCGM keeps apart.
GPU_HEALTH_SIGNALS = (
    "xid_errors", "row_remap_pending", "row_remap_failure", "retired_pending",
    "ecc_dbe_vol_total", "nvlink_errors",
)  # fmt: skip


def evidence_label(e: Evidence) -> str:
    """The short label value of an evidence (`vllm_signature`); the sentence stays in the
    journal, the history and status."""
    return e.name.lower()


def _counter_at_0(
    registry: CollectorRegistry, name: str, doc: str, *, label: str, values: Iterable[str]
) -> Counter:
    """A counter with one label, present at 0 for each of its values from the start."""
    c = Counter(name, doc, [label], registry=registry)
    for v in values:
        c.labels(v)
    return c


class Metrics:
    def __init__(self) -> None:
        # No `X_created` series beside each counter: a family nothing reads (the classic text
        # format exports each as a gauge of its own).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        r = self.registry = CollectorRegistry(auto_describe=True)
        ns = "kimi_supervisor"
        self.desired_mode = Gauge(
            f"{ns}_desired_mode", "1 for the desired mode", ["mode"], registry=r
        )
        self.mode = Gauge(f"{ns}_mode", "1 for the mode vLLM serves in now", ["mode"], registry=r)
        self.state = Gauge(f"{ns}_state", "1 for the daemon's current state", ["state"], registry=r)
        self.gpu_used = Gauge(
            f"{ns}_gpu_used_bytes", "memory used per GPU (NVML)", ["gpu", "uuid"], registry=r
        )
        self.gpu_baseline = Gauge(
            f"{ns}_gpu_baseline_bytes",
            "baseline footprint per GPU: what it uses with nothing running",
            ["gpu", "uuid"],
            registry=r,
        )
        self.start_seconds = Histogram(
            f"{ns}_start_duration_seconds",
            "from starting vLLM's unit to /health 200 (the model load), by mode",
            ["mode"],
            buckets=(10, 30, 60, 120, 300, 600, 900, 1200, 1800, 2400, 3600, 5400, 7200, 10800),
            registry=r,
        )
        self.switch_downtime = Histogram(
            f"{ns}_switch_downtime_seconds",
            "a switch's unavailable window: from the old vLLM's last /health 200 to the new "
            "one's first, by target mode",
            ["target"],
            buckets=(5, 15, 30, 60, 120, 300, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200),
            registry=r,
        )
        self.switch_downtime_part = Gauge(
            f"{ns}_switch_downtime_part_seconds",
            "the last switch's unavailable window, by part (old_exit, teardown, to_weights, "
            "engine_init, to_ready; earlier: transitions and waits before the last one)",
            ["target", "part"],
            registry=r,
        )
        self.start_eta = Gauge(
            f"{ns}_start_eta_seconds",
            "while vLLM loads: the time left by the median of past loads of the same mode and "
            "argv (0 when none is known or nothing loads)",
            registry=r,
        )
        self.stuck_since = Gauge(
            f"{ns}_stuck_since_timestamp_seconds",
            "when the STUCK episode under way began (Unix time; 0 when not STUCK): it lasts "
            "through its retries, until a teardown makes the GPUs clean",
            registry=r,
        )
        self.stuck_retries = Gauge(
            f"{ns}_stuck_retries",
            "teardowns tried again in the STUCK episode under way (0 when not STUCK)",
            registry=r,
        )
        self.restart_needed = Gauge(
            f"{ns}_restart_needed",
            "1 while the serving vLLM runs an earlier config's argv (vllm.command edited and "
            "reloaded): `kimi-mode MODE --apply` restarts it with the config's",
            registry=r,
        )
        self.hangs = Counter(
            f"{ns}_vllm_hangs_total",
            "times a serving vLLM was found doing no work (requests running and no token, or "
            "an idle canary unanswered) and restarted",
            registry=r,
        )
        self.liveness_doubt_since = Gauge(
            f"{ns}_liveness_doubt_since_timestamp_seconds",
            "since when (Unix time) one sign says the serving vLLM makes no progress (requests "
            "pending and no step, a canary or /health unanswered) and its processes are busy "
            "(not hung, never restarted; an engine spinning on a GPU that never answers looks "
            "so), with no proof of progress since; 0 if none",
            registry=r,
        )
        self.bundles = Counter(
            f"{ns}_incident_bundles_total",
            "incident bundles written (at a STUCK, a FAILED or a hang restart): one file each "
            "under state.dir/incidents, named by `kimi-mode status`",
            registry=r,
        )
        self.bundle_failures = Counter(
            f"{ns}_incident_bundle_failures_total",
            "incident bundles that could not be written (a full, read-only or hung state "
            "folder; its reason in the journal and `kimi-mode status`)",
            registry=r,
        )
        self.last_bundle = Gauge(
            f"{ns}_incident_bundle_last_timestamp_seconds",
            "when the newest incident bundle was written (Unix time; 0 if none since the "
            "daemon started)",
            registry=r,
        )
        self.gpu_health = Gauge(
            f"{ns}_gpu_health",
            "1 where the GPU's health signal, read before vLLM's last load (gpus.health_check), "
            "says it will fail a load: xid_errors (an Xid that needs a reset, since boot), "
            "row_remap_pending, row_remap_failure, retired_pending, ecc_dbe_vol_total "
            "(uncorrected ECC since the driver loaded), nvlink_errors; 0 where it does not, and "
            "from the first reading of the GPU's memory until its health is read (as DCGM's "
            "fields are 0 until a fault); NaN where a reading could not say (the GPU does not "
            "keep that signal, the reading failed)",
            ["gpu", "uuid", "signal"],
            registry=r,
        )
        self._health_gpus: set[tuple[str, str]] = set()
        # process_*: the daemon's own CPU, memory and descriptors (read from /proc/self).
        ProcessCollector(registry=r)
        self.build_info = Gauge(
            f"{ns}_build_info", "1, labelled with the version running", ["version", "python"],
            registry=r,
        )  # fmt: skip
        self.build_info.labels(package_version(), platform.python_version()).set(1)
        self.spared = Counter(
            f"{ns}_spared_holders_total",
            "protected processes (nvidia-persistenced, DCGM, ...) found holding a managed GPU "
            "during a teardown and left alone",
            registry=r,
        )
        self.teardown_seconds = Histogram(
            f"{ns}_teardown_duration_seconds",
            "teardown duration",
            ["outcome"],
            buckets=(0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.kills = Counter(
            f"{ns}_kills_total",
            "SIGKILLs sent, by teardown step and the evidence that named the process (unit_cgroup, "
            "escaped_unit, listens_on_port, vllm_signature, respawns, nvml_listed, "
            "open_and_mapped: the Evidence enum's names; its sentence is in the journal)",
            ["step", "evidence"],
            registry=r,
        )
        for step in KILL_STEPS:
            for e in Evidence:
                self.kills.labels(step.value, evidence_label(e))
        self.intrusions = Counter(
            f"{ns}_gpu_intrusions_total",
            "processes outside vLLM's unit found on a managed GPU while vLLM loaded, by GPU",
            ["gpu"],
            registry=r,
        )
        self.transitions = Counter(
            f"{ns}_transitions_total",
            "mode transitions, by target mode and outcome",
            ["target", "outcome"],
            registry=r,
        )
        for m in Mode:
            for outcome in TRANSITION_OUTCOMES:
                self.transitions.labels(m.value, outcome)
        self.persist_failures = _counter_at_0(
            r,
            f"{ns}_persist_failures_total",
            "writes of state.json or history.jsonl that failed (a full disk, a bad state dir)",
            label="file",
            values=PERSISTED_FILES,
        )
        self.captures = _counter_at_0(
            r,
            f"{ns}_captures_total",
            "captures ended, by outcome: ok (traces flushed and handed over) or failed",
            label="outcome",
            values=CAPTURE_OUTCOMES,
        )
        # What the last capture cost serving (capture/stall.py): NaN where not measured.
        self.capture_tokens = Gauge(
            f"{ns}_capture_serving_tokens_per_second",
            "vLLM's generated tokens per second around the last capture, by window: before it, "
            "while recording, in the flush, after it (NaN: not measured; see the capture's record)",
            ["window"],
            registry=r,
        )
        self.capture_window = Gauge(
            f"{ns}_capture_window_seconds",
            "how long each window of the last capture lasted (the flush: how long vLLM wrote its "
            "traces; NaN: not measured)",
            ["window"],
            registry=r,
        )
        for w in STALL_WINDOWS:
            self.capture_tokens.labels(w).set(math.nan)
            self.capture_window.labels(w).set(math.nan)
        self.capture_failed = Counter(
            f"{ns}_capture_failed_requests_total",
            "requests vLLM failed (HTTP 5xx, or ended with an error) during captures, from the "
            "profiler's start to the capture's last reading",
            registry=r,
        )
        self.liveness = Gauge(
            f"{ns}_liveness",
            "1 for the liveness verdict on the serving vLLM now: progress, doubt (one sign says "
            "no progress and the other does not: never restarted), not_judged (not serving, a "
            "capture holds the verdict, or no reading)",
            ["verdict"],
            registry=r,
        )
        self.set_liveness("not_judged")
        self.dropped = _counter_at_0(
            r,
            f"{ns}_metrics_connections_dropped_total",
            "connections to this /metrics closed unanswered: `timeout` (the request not whole, "
            "or the answer not taken, within metrics.timeout_s), `evicted` (the oldest, closed "
            "for a new one past metrics.max_connections), `too_large` (a request over 8 KiB)",
            label="reason",
            values=DROP_REASONS,
        )
        self._server: MetricsServer | None = None

    def serve(
        self,
        address: str,
        port: int,
        timeout_s: float = TIMEOUT_S,
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> int:
        """Listen and answer on a thread of its own; the port listened on (`port` 0: any).
        OSError if it cannot listen."""
        server = MetricsServer(
            make_wsgi_app(self.registry),
            address,
            port,
            timeout_s=timeout_s,
            max_connections=max_connections,
            dropped=lambda reason: self.dropped.labels(reason).inc(),
        )
        self._server = server
        return server.port

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()

    def set_modes(self, desired: Mode, actual: Mode | None) -> None:
        for m in Mode:
            self.desired_mode.labels(m.value).set(1 if m is desired else 0)
            self.mode.labels(m.value).set(1 if m is actual else 0)

    def set_state(self, state: str, all_states: list[str]) -> None:
        for s in all_states:
            self.state.labels(s).set(1 if s == state else 0)

    def set_capture_stall(self, stall: dict[str, Any]) -> None:
        """The last capture's cost to serving, as its record says it (capture/stall.py)."""
        for w in STALL_WINDOWS:
            rate, seconds = stall[w]["tokens_per_s"], stall[w]["seconds"]
            self.capture_tokens.labels(w).set(math.nan if rate is None else rate)
            self.capture_window.labels(w).set(math.nan if seconds is None else seconds)
        if stall["failed"]:
            self.capture_failed.inc(stall["failed"])

    def set_liveness(self, verdict: str) -> None:
        for v in LIVENESS_VERDICTS:
            self.liveness.labels(v).set(1 if v == verdict else 0)

    def set_gpu(self, index: int, uuid: str, used_mib: int, *, baseline_mib: int) -> None:
        self.gpu_used.labels(str(index), uuid).set(used_mib * MIB)
        self.gpu_baseline.labels(str(index), uuid).set(baseline_mib * MIB)
        self.intrusions.labels(str(index))  # at 0 from the first reading of each managed GPU
        if (str(index), uuid) not in self._health_gpus:
            # Present from the start, at 0 as DCGM's fields are, until a reading says otherwise.
            self._health_gpus.add((str(index), uuid))
            for signal in GPU_HEALTH_SIGNALS:
                self.gpu_health.labels(str(index), uuid, signal).set(0)

    def gpu_health_unread(self) -> None:
        for gpu, uuid in self._health_gpus:
            for signal in GPU_HEALTH_SIGNALS:
                self.gpu_health.labels(gpu, uuid, signal).set(math.nan)

    def set_gpu_health(self, index: int, uuid: str, flags: dict[str, bool | None]) -> None:
        """One GPU's health signals as last read (None: not read, NaN)."""
        self._health_gpus.add((str(index), uuid))
        for signal in GPU_HEALTH_SIGNALS:
            flag = flags.get(signal)
            self.gpu_health.labels(str(index), uuid, signal).set(
                math.nan if flag is None else float(flag)
            )


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Exchange:
    """One connection: its request as it arrives, then its answer as the client takes it."""

    __slots__ = ("answer", "deadline", "request", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.request = bytearray()
        # None while the request comes; then what is left to send; empty once sent.
        self.answer: memoryview | None = None


class MetricsServer:
    """HTTP/1.1 GET on one thread, every connection non-blocking with one deadline for its
    whole exchange, at most `max_connections` held (the module's docstring says why)."""

    def __init__(
        self,
        app: WsgiApp,
        address: str,
        port: int,
        *,
        timeout_s: float = TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        dropped: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self._app = app
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._dropped = dropped
        family, _, _, _, where = socket.getaddrinfo(
            address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(where)
            listener.listen(BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port: int = listener.getsockname()[1]
        self._name = (address, str(self.port))
        # Ordered by accept, so the first is the oldest and has the earliest deadline.
        self._open: dict[int, _Exchange] = {}
        self._rendered: dict[tuple[str, ...], tuple[float, bytes]] = {}  # request -> answer
        self._closing = False
        self._accept_backoff_s = 0.0
        self._accept_again_at: float | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, daemon=True, name="metrics")
        self._thread.start()

    def open_connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        """Stop listening and close every connection (the thread wakes at once)."""
        self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(CLOSE_JOIN_S)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _serve(self) -> None:
        try:
            while not self._closing:
                accept = False
                for key, _events in self._selector.select(self._wait_s()):
                    if key.fileobj is self._listener:
                        accept = True
                    elif isinstance(key.data, _Exchange):
                        self._guarded(key.data)
                # After the connections that were ready: a burst of new ones never pushes out
                # one whose request is there to be answered.
                if accept:
                    self._accept()
                self._expire(time.monotonic())
        finally:
            for ex in list(self._open.values()):
                self._drop(ex)
            self._selector.close()
            self._listener.close()

    def _guarded(self, ex: _Exchange) -> None:
        """One connection's step; a failure of its own (a bug) closes it, never the server."""
        try:
            self._step(ex)
        except Exception:
            self._drop(ex)

    def _wait_s(self) -> float | None:
        """Until the oldest connection's deadline, or the end of an accept backoff; None (no
        timer at all) with nothing open."""
        due = [t for t in (self._accept_again_at,) if t is not None]
        if self._open:
            due.append(next(iter(self._open.values())).deadline)
        if not due:
            return None
        return max(0.0, min(due) - time.monotonic())

    def _accept(self) -> None:
        # A batch at most per pass: a flood of connections never starves the open ones.
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno in OUT_OF_RESOURCES:
                    self._back_off()
                break
            self._accept_backoff_s = 0.0
            sock.setblocking(False)
            if len(self._open) >= self.max_connections:
                self._dropped("evicted")
                self._drop(next(iter(self._open.values())))
            ex = _Exchange(sock, time.monotonic() + self.timeout_s)
            self._open[sock.fileno()] = ex
            self._selector.register(sock, selectors.EVENT_READ, ex)
            self._guarded(ex)  # a scraper's request came with its connection: answered now

    def _back_off(self) -> None:
        """Out of descriptors: stop accepting for a doubling while (the kernel queues the
        connections meanwhile), rather than spin on a listener that stays readable."""
        self._accept_backoff_s = min(
            max(self._accept_backoff_s * 2, ACCEPT_BACKOFF_S), ACCEPT_BACKOFF_MAX_S
        )
        self._accept_again_at = time.monotonic() + self._accept_backoff_s
        self._selector.unregister(self._listener)

    def _expire(self, now: float) -> None:
        if self._accept_again_at is not None and now >= self._accept_again_at:
            self._accept_again_at = None
            self._selector.register(self._listener, selectors.EVENT_READ)
        while self._open:
            ex = next(iter(self._open.values()))
            if ex.deadline > now:
                break
            if ex.answer is None or ex.answer:  # not drained: its request or answer unfinished
                self._dropped("timeout")
            self._drop(ex)

    def _drop(self, ex: _Exchange) -> None:
        if self._open.pop(ex.sock.fileno(), None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(ex.sock)
        ex.sock.close()

    def _step(self, ex: _Exchange) -> None:
        """Read what came, send what the client will take, or drain what it sends after its
        answer; never waits."""
        try:
            if ex.answer:  # being sent
                sent = ex.sock.send(ex.answer)
                ex.answer = ex.answer[sent:]
                if not ex.answer:
                    self._sent(ex)
                return
            want = DRAIN_BYTES if ex.answer is not None else MAX_REQUEST_BYTES + 1 - len(ex.request)
            data = ex.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(ex)
            return
        if not data:
            self._drop(ex)  # the client closed: before asking, or after its answer
            return
        if ex.answer is not None:
            return  # sent after its request: read and dropped
        ex.request += data
        end = _HEAD_END.search(ex.request)
        if end is not None:
            self._answer(ex, self._respond(bytes(ex.request[: end.start()])))
        elif len(ex.request) > MAX_REQUEST_BYTES:
            self._dropped("too_large")
            self._answer(ex, _plain("431 Request Header Fields Too Large"))

    def _sent(self, ex: _Exchange) -> None:
        """The whole answer is the kernel's to deliver: the end is said (FIN), and what the
        client sent beyond its request is read until it closes, within the same deadline.
        Closed with that unread, the kernel would reset the connection, and the client could
        lose its answer (a lingering close, as Apache's)."""
        with contextlib.suppress(OSError):
            ex.sock.shutdown(socket.SHUT_WR)
        self._selector.modify(ex.sock, selectors.EVENT_READ, ex)

    def _answer(self, ex: _Exchange, answer: bytes) -> None:
        ex.request = bytearray()
        ex.answer = memoryview(answer)
        self._selector.modify(ex.sock, selectors.EVENT_WRITE, ex)
        self._step(ex)

    def _respond(self, head: bytes) -> bytes:
        """The whole HTTP answer to a request's line and headers."""
        lines = head.decode("latin-1").split("\n")
        parts = lines[0].strip().split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _plain("400 Bad Request")
        method, target, protocol = parts
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method,
            "SCRIPT_NAME": "",
            "SERVER_NAME": self._name[0],
            "SERVER_PORT": self._name[1],
            "SERVER_PROTOCOL": protocol,
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": False,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        try:
            url = urlsplit(target)
        except ValueError:
            return _plain("400 Bad Request")
        environ["PATH_INFO"] = unquote(url.path, "latin-1")
        environ["QUERY_STRING"] = url.query
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name.strip():
                return _plain("400 Bad Request")
            key = name.strip().upper().replace("-", "_")
            if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                key = f"HTTP_{key}"
            environ[key] = value.strip()
        # A flood of complete requests from any local user would have the one thread render
        # the registry for each (an outside review: root's scrapes then took up to 1.6 s): an
        # answer is reused for RENDER_REUSE_S for the same request.
        asked = tuple(str(environ.get(k, "")) for k in RENDER_KEY)
        now = time.monotonic()
        cached = self._rendered.get(asked)
        if cached is not None and now - cached[0] < RENDER_REUSE_S:
            return cached[1]
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
            started[:] = [status, headers]

        try:
            body = b"".join(self._app(environ, start_response))
        except Exception as e:  # a collector that fails: the scraper is told, the server goes on
            return _plain("500 Internal Server Error", f"{type(e).__name__}: {e}\n".encode())
        status, headers = started
        answer = _head(status, headers, len(body)) + body
        if len(self._rendered) >= MAX_RENDERED:
            self._rendered.clear()
        self._rendered[asked] = (now, answer)
        return answer


def _head(status: str, headers: list[tuple[str, str]], length: int) -> bytes:
    own = {"content-length", "connection"}
    lines = [f"HTTP/1.1 {status}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in own]
    lines += [f"Content-Length: {length}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _plain(status: str, body: bytes | None = None) -> bytes:
    text = body if body is not None else f"{status}\n".encode()
    return _head(status, [("Content-Type", "text/plain; charset=utf-8")], len(text)) + text
