"""What real vLLM 0.16 shows the liveness rule (decide/liveness.py), measured: its CPU build at
tensor parallel 2, as the real-vLLM tier runs it, sampled from outside every 0.5 s the way the
daemon's probe reads it (its /metrics, and its processes' CPU time and state from /proc).

Phases, on one vLLM started with a profiler and one long prefill's room (`--max-model-len` and
`--max-num-batched-tokens` 8448, a copy of the tier's tiny model with 16384 positions):
- idle: what an idle, healthy engine uses of the CPU (the floor `cpu_idle_fraction` must sit
  under, with VLLM_SLEEP_WHEN_IDLE=1 as the tier runs it);
- a 4096- and an 8192-token prompt alone: how long /metrics stands still (no step ends) while
  the prefill runs, what it says meanwhile, and what the engine uses of the CPU;
- a capture under load: /start_profile, 3 s of requests, /stop_profile: how long the flush
  holds the engine (counters still, requests waiting) and its CPU;
then vLLM again with `--disable-log-stats`: which series /metrics still has.

The fake vLLM copies these (sandbox/fake_api.py, sandbox/fake_vllm.py); the figures go to
bench/results/liveness-real-*.json and docs/performance.md.

    .venv/bin/python -m bench.liveness_real --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

from bench.common import machine, poll, write_section
from bench.downtime_bench import stop, vllm_env
from kimi_supervisor.decide.liveness import parse
from kimi_supervisor.loop.liveness import engine_cpu
from kimi_supervisor.ports.http import request
from tests.realvllm import env
from tests.realvllm.env import long_model

RESULTS = Path(__file__).parent / "results"
PORT = 18720
READY_S = 900
MAX_LEN = 8448


class Sampler:
    """/metrics and the processes' CPU every `every_s`, on a thread of its own."""

    def __init__(self, base: str, pid: int, every_s: float = 0.5) -> None:
        self.base, self.pid, self.every_s = base, pid, every_s
        self.rows: list[dict[str, Any]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.is_set():
            t = time.monotonic()
            r = request(f"{self.base}/metrics", timeout_s=5, max_bytes=4 << 20)
            work = parse(r.body) if r.ok else None
            cpu = engine_cpu(self.pid)
            self.rows.append({"t": t, "metrics_s": round(time.monotonic() - t, 3),
                              "work": work, "cpu": cpu})  # fmt: skip
            self.done.wait(max(self.every_s - (time.monotonic() - t), 0))

    def between(self, t0: float, t1: float) -> list[dict[str, Any]]:
        return [r for r in self.rows if t0 <= r["t"] <= t1 and r["work"] and r["cpu"]]

    def stop(self) -> None:
        self.done.set()
        self.thread.join(10)


def still(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The longest run of readings whose counters did not move, what the gauges said then, and
    the processes' CPU over it (share of one core)."""
    best: dict[str, Any] = {"still_s": 0.0}
    start = 0
    for i in range(1, len(rows) + 1):
        moved = i == len(rows) or rows[i]["work"].counters() != rows[start]["work"].counters()
        if not moved:
            continue
        a, b = rows[start], rows[i - 1]
        span = b["t"] - a["t"]
        if span > best["still_s"]:
            took = b["cpu"].at - a["cpu"].at
            best = {
                "still_s": round(span, 1),
                "running": sorted({r["work"].running for r in rows[start:i]}),
                "waiting": sorted({r["work"].waiting for r in rows[start:i]}),
                "cpu_share": round((b["cpu"].seconds - a["cpu"].seconds) / took, 3)
                if took
                else None,
                "stopped": sorted({s for r in rows[start:i] for s in r["cpu"].stopped}),
            }
        start = i
    return best


def cpu_share(rows: list[dict[str, Any]]) -> float | None:
    if len(rows) < 2:
        return None
    a, b = rows[0]["cpu"], rows[-1]["cpu"]
    return round((b.seconds - a.seconds) / (b.at - a.at), 4)


def complete(
    base: str, model: str, prompt: str, tokens: int, timeout_s: float = 900
) -> dict[str, Any]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens,
                       "min_tokens": tokens, "ignore_eos": True}).encode()  # fmt: skip
    req = urllib.request.Request(
        f"{base}/v1/completions", body, {"content-type": "application/json"}
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        usage = json.loads(r.read())["usage"]
    return {"took_s": round(time.monotonic() - t0, 2), "prompt_tokens": usage["prompt_tokens"]}


def tokens(base: str, model: str, prompt: str) -> int:
    """How many tokens vLLM makes of `prompt` (its /tokenize)."""
    body = json.dumps({"model": model, "prompt": prompt}).encode()
    req = urllib.request.Request(f"{base}/tokenize", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return int(json.loads(r.read())["count"])


def start(venv: Path, model: Path, root: Path, extra: list[str]) -> subprocess.Popen[bytes]:
    prof = json.dumps({"profiler": "torch", "torch_profiler_dir": str(root / "traces"),
                       "torch_profiler_with_stack": False})  # fmt: skip
    argv = [str(venv / "bin" / "vllm"), "serve", str(model), "--tensor-parallel-size", "2",
            "--dtype", "bfloat16", "--block-size", "16", "--max-model-len", str(MAX_LEN),
            "--max-num-batched-tokens", str(MAX_LEN), "--host", "127.0.0.1",
            "--port", str(PORT), "--profiler-config", prof, *extra]  # fmt: skip
    e = {**os.environ, **vllm_env(root), "VLLM_CACHE_ROOT": str(env.CACHE / "bench-long-cache")}
    log = open(root / "vllm.log", "ab")  # noqa: SIM115
    p = subprocess.Popen(argv, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    base = f"http://127.0.0.1:{PORT}"
    poll(lambda: request(f"{base}/health", timeout_s=1).status == 200 or p.poll() is not None,
         READY_S, 0.25)  # fmt: skip
    if p.poll() is not None:
        raise RuntimeError((root / "vllm.log").read_text()[-3000:])
    return p


def measure() -> dict[str, Any]:
    venv = env.venv()
    model = long_model(venv)
    root = Path(tempfile.mkdtemp(prefix="kimi-liveness-"))
    (root / "tmp").mkdir()
    (root / "traces").mkdir()
    base, name = f"http://127.0.0.1:{PORT}", str(model)
    out: dict[str, Any] = {
        "vllm": env.VLLM,
        "model": "tests/realvllm/make_model.py, 16384 positions",
    }
    p = start(venv, model, root, [])
    s = Sampler(base, p.pid)
    try:
        complete(base, name, "hello world", 8)  # warm-up
        t0 = time.monotonic()
        time.sleep(8)
        out["idle"] = {"cpu_share": cpu_share(s.between(t0, time.monotonic()))}
        per_word = tokens(base, name, " ".join(["a"] * 100)) / 100
        for size in (4096, 8192):
            prompt = " ".join(["a"] * int((size - 8) / per_word))
            t0 = time.monotonic()
            got = complete(base, name, prompt, 4)
            time.sleep(1)
            out[f"prefill_{size}"] = got | still(s.between(t0 - 0.5, time.monotonic()))
        # A capture under load: 4 clients, the profiler started, 3 s, stopped (the flush).
        stop_load = threading.Event()

        def load() -> None:
            while not stop_load.is_set():
                complete(base, name, "hello world the kimi", 32, 600)

        threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for th in threads:
            th.start()
        time.sleep(3)
        assert request(f"{base}/start_profile", "POST", timeout_s=60).status == 200
        time.sleep(3)
        t0 = time.monotonic()
        assert request(f"{base}/stop_profile", "POST", timeout_s=None).status == 200
        flush_s = time.monotonic() - t0
        time.sleep(2)
        out["flush_under_load"] = {"stop_profile_s": round(flush_s, 1)} | still(
            s.between(t0 - 0.5, time.monotonic())
        )
        stop_load.set()
        for th in threads:
            th.join(120)
    finally:
        s.stop()
        stop(p)
    p = start(venv, model, root, ["--disable-log-stats"])
    try:
        text = request(f"{base}/metrics", timeout_s=10, max_bytes=4 << 20).body
        families = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE")}
        out["disable_log_stats"] = {
            "vllm_series": sorted(f for f in families if f.startswith("vllm:")),
            "families": len(families),
            "parsed": parse(text) is not None,
        }
    finally:
        stop(p)
        shutil.rmtree(root, ignore_errors=True)
    return out


def render(m: dict[str, Any]) -> str:
    rows = [
        (
            "the 8 s after a request, idle (VLLM_SLEEP_WHEN_IDLE=1)",
            "-",
            "-",
            f"{m['idle']['cpu_share']:.1%}",
        ),
    ]
    for key, what in (("prefill_4096", "a 4096-token prompt alone"),
                      ("prefill_8192", "an 8192-token prompt alone"),
                      ("flush_under_load", "a capture's /stop_profile under load")):  # fmt: skip
        r = m[key]
        said = f"running {r.get('running')}, waiting {r.get('waiting')}" if r["still_s"] else "-"
        share = f"{r['cpu_share']:.0%}" if r.get("cpu_share") is not None else "-"
        rows.append((what, f"{r['still_s']:.1f} s", said, share))
    lines = [
        f"Measured {machine()}, {m['vllm']} at tensor parallel 2 (bench/liveness_real.py), "
        "/metrics and /proc sampled every 0.5 s from outside, as the daemon's probe reads them; "
        "the CPU is the tree's, summed (one core: 100 %), over the time /metrics stood still.",
        "",
        "| what vLLM does | /metrics still for | its gauges then | its processes' CPU |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
        "",
        f"The prompts took {m['prefill_4096']['took_s']} s ({m['prefill_4096']['prompt_tokens']} "
        f"tokens) and {m['prefill_8192']['took_s']} s ({m['prefill_8192']['prompt_tokens']} "
        f"tokens); /stop_profile took {m['flush_under_load']['stop_profile_s']} s. With "
        f"`--disable-log-stats`, /metrics keeps {m['disable_log_stats']['families']} families, "
        f"of them vLLM's: {', '.join(m['disable_log_stats']['vllm_series']) or 'none'}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="docs/performance.md: its section is replaced")
    ap.add_argument("--from", dest="source", type=Path, help="render a saved run's JSON")
    args = ap.parse_args()
    if args.source:
        m = json.loads(args.source.read_text())
    else:
        m = measure()
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"liveness-real-{date.today()}.json"
        out.write_text(json.dumps(m, indent=1) + "\n")
    text = render(m)
    print(text)
    if args.write:
        write_section(args.write, "liveness-real", text)


if __name__ == "__main__":
    main()
