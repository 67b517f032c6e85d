"""The bound on a doubt and a hang's own grace, measured in the sandbox (the whole daemon, the
fake vLLM under 4 clients' load):

- a collective stuck on the GPU (no step, a thread of the engine spinning a core, the simulated
  GPUs reading a spinning kernel: sandbox/simreader.COUNTERS): seconds from the fault to the
  verdict, against liveness.hang_bound_s plus one metrics interval; with the sandbox's values
  and with the shipped ones over SCALED;
- a hang's teardown, the API server holding its clients' open requests for 30 s before it
  exits (as real vLLM 0.16's did: 30.2 s of a 95-127 s outage): the unavailable window the
  daemon reports, with the hang's grace at teardown.term_grace_s (30 s: before) and at the
  shipped liveness.hang_term_grace_s (after).

    .venv/bin/python -m bench.liveness_bound [RUNS]   # about 4 min a run; writes JSON

The verdict's time is told apart from the restart's: the evidence read between them (vLLM's
stacks: py-spy where installed) is the incident's `evidence_read_s`.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import date, datetime
from pathlib import Path
from typing import Any

from bench.common import machine, poll
from bench.liveness_bench import hang_teardown_s, incidents, load, serving, status
from kimi_supervisor.config import LivenessConfig, TeardownConfig
from kimi_supervisor.sandbox.fake_options import FakeOptions
from kimi_supervisor.sandbox.sandbox import Sandbox

RESULTS = Path(__file__).parent / "results"
SCALED = 30
SHIPPED, TEARDOWN = LivenessConfig(), TeardownConfig()
KEYS = ("metrics_interval_s", "stall_s", "canary_interval_s", "canary_timeout_s",
        "hang_bound_s", "hang_term_grace_s")  # fmt: skip
VALUES: dict[str, dict[str, Any]] = {
    "sandbox": {},
    f"shipped / {SCALED}": {
        "liveness": {k: getattr(SHIPPED, k) / SCALED for k in KEYS},
        "teardown": {"term_grace_s": TEARDOWN.term_grace_s / SCALED},
    },
}
HOLD_S = 30.0  # the API server's stop with open requests (real vLLM 0.16: 30.2 s)


def boxed(
    overrides: dict[str, Any], fake: Callable[[Path], FakeOptions], act: Any
) -> dict[str, Any]:
    """`act(sandbox, its root)` in a sandbox of its own, its fake vLLM started with `fake`."""
    root = Path(tempfile.mkdtemp(prefix="kimi-bound-"))
    sb = Sandbox.up(root, gpus=2, daemon=False, overrides=overrides or None)
    try:
        sb.set_fake_options(fake(root))
        sb.start_daemon()
        serving(sb, 120)
        return act(sb, root)  # type: ignore[no-any-return]
    finally:
        sb.down()
        shutil.rmtree(root, ignore_errors=True)


def under_load(sb: Sandbox, fault: Path) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """Seconds from `fault` made under load to the verdict; the incident; the status once a
    new vLLM serves."""
    before = len(incidents(sb))
    main = status(sb)["unit"]["main_pid"]
    done = threading.Event()
    threads = load(sb, done)
    try:
        poll(lambda: ((status(sb).get("liveness") or {}).get("running") or 0) > 0, 30)
        time.sleep(2)
        t0, wall0 = time.monotonic(), time.time()
        fault.touch()
        poll(lambda: len(incidents(sb)) > before, 600, every_s=0.05)
        took = time.monotonic() - t0
        # The incident's own time (the daemon's), not this poll's: the verdict is handed on
        # once its evidence is read (`evidence_read_s`), and recorded then.
        at = datetime.fromisoformat(incidents(sb)[-1]["at"]).timestamp() - wall0
        fault.unlink()
        sb.set_fake_options(FakeOptions())  # the next vLLM without the fault
        poll(lambda: status(sb)["state"] == "serving" and status(sb)["unit"]["main_pid"] != main,
             120)  # fmt: skip
    finally:
        fault.unlink(missing_ok=True)
        done.set()
        for th in threads:
            th.join(35)
    return took, {**incidents(sb)[-1], "recorded_s": round(at, 2)}, status(sb)


def bound(name: str) -> dict[str, Any]:
    def act(sb: Sandbox, root: Path) -> dict[str, Any]:
        c = sb.config().liveness
        took, incident, _st = under_load(sb, root / "stuck")
        kept = float(incident.get("evidence_read_s") or 0.0)
        judged = incident["recorded_s"] - kept
        return {
            "values": name, "hang_bound_s": c.hang_bound_s,
            "metrics_interval_s": c.metrics_interval_s, "seen_by_the_bench_s": round(took, 2),
            "recorded_s": incident["recorded_s"], "evidence_read_s": kept,
            "judged_s": round(judged, 2),
            "within": judged <= c.hang_bound_s + c.metrics_interval_s,
            "doubt_s": incident.get("doubt_s"), "what": incident["what"][:160],
        }  # fmt: skip

    return boxed(VALUES[name], lambda root: FakeOptions(stuck_collective_file=str(root / "stuck")),
                 act)  # fmt: skip


def grace(hang_grace_s: float) -> dict[str, Any]:
    overrides = {"teardown": {"term_grace_s": TEARDOWN.term_grace_s},
                 "liveness": {"hang_term_grace_s": hang_grace_s}}  # fmt: skip

    def act(sb: Sandbox, root: Path) -> dict[str, Any]:
        took, _incident, st = under_load(sb, root / "deadlock")
        return {
            "hang_term_grace_s": hang_grace_s, "term_grace_s": TEARDOWN.term_grace_s,
            "api_holds_s": HOLD_S, "verdict_s": round(took, 1),
            "teardown_s": round(hang_teardown_s(sb), 2),
            "window_s": (st.get("downtime") or {}).get("window_s"),
        }  # fmt: skip

    def fake(root: Path) -> FakeOptions:
        return FakeOptions(deadlock_file=str(root / "deadlock"), shutdown_delay_s=HOLD_S)

    return boxed(overrides, fake, act)


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    result: dict[str, Any] = {"machine": machine(), "date": str(date.today())}
    result["bound"] = [bound(name) for name in VALUES for _ in range(runs)]
    result["grace"] = [grace(TEARDOWN.term_grace_s), grace(SHIPPED.hang_term_grace_s)]
    out = RESULTS / f"liveness-bound-{date.today()}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
