"""Prometheus metrics on a localhost port (prometheus-client, its own registry and thread).

Named as Prometheus asks (base units: `_bytes`, `_seconds`; counters `_total`). Per-GPU series
carry `gpu` (the index) and `uuid`, the label dcgm-exporter uses, so the two join. The shipped
alert rules (config/prometheus/kimi-supervisor-alerts.yml) and dashboard
(config/grafana/kimi-supervisor.json) query these names; a test checks each against a live
/metrics.

The loop sets them; the exporter thread only reads. Off when metrics.enabled is false. The
exporter blocks until a scrape arrives (prometheus-client's own server wakes twice a second to
check for shutdown, which alone cost 0.5% of a core on an idle daemon).
"""

from __future__ import annotations

import contextlib
import platform
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from kimi_supervisor.model import Mode
from kimi_supervisor.version import package_version

MIB = 1 << 20


class Metrics:
    def __init__(self) -> None:
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
            "since when (Unix time) one sign says the serving vLLM makes no progress and the "
            "other says it is busy (not hung, never restarted; an engine spinning on a GPU "
            "that never answers looks so), with no proof of progress since; 0 if none",
            registry=r,
        )
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
            "SIGKILLs sent, by teardown step and the evidence that named the process",
            ["step", "evidence"],
            registry=r,
        )
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
        self.persist_failures = Counter(
            f"{ns}_persist_failures_total",
            "writes of state.json or history.jsonl that failed (a full disk, a bad state dir)",
            ["file"],
            registry=r,
        )
        self._server: Any = None

    def serve(self, address: str, port: int) -> None:
        server = make_server(
            address, port, make_wsgi_app(self.registry), WSGIServer, handler_class=_Quiet
        )
        server.timeout = None  # handle_request blocks until a scrape arrives

        def serve() -> None:
            with contextlib.suppress(OSError, ValueError):  # the socket was closed: done
                while self._server is server:
                    server.handle_request()

        self._server = server
        threading.Thread(target=serve, daemon=True, name="metrics").start()

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.server_close()

    def set_modes(self, desired: Mode, actual: Mode | None) -> None:
        for m in Mode:
            self.desired_mode.labels(m.value).set(1 if m is desired else 0)
            self.mode.labels(m.value).set(1 if m is actual else 0)

    def set_state(self, state: str, all_states: list[str]) -> None:
        for s in all_states:
            self.state.labels(s).set(1 if s == state else 0)

    def set_gpu(self, index: int, uuid: str, used_mib: int, baseline_mib: int) -> None:
        self.gpu_used.labels(str(index), uuid).set(used_mib * MIB)
        self.gpu_baseline.labels(str(index), uuid).set(baseline_mib * MIB)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass
