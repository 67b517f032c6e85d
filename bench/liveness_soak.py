"""The liveness rule against real vLLM 0.16 under what must never be called hung: the product's
own probe and judge (loop/liveness.py's `Liveness`, its probe thread, its canary, its /proc
reads; decide/liveness.py's `Judge`), run twice side by side on one real vLLM, once with the
shipped values (metrics every 15 s, stall 120 s, canary every 300 s with 60 s to answer) and
once with the real-vLLM tier's scaled ones (2, 5, 10, 30 s), counting verdicts and doubts.

Phases, each on a real vLLM 0.16 (its CPU build, tensor parallel 2, the tier's tiny model with
16384 positions, `--max-model-len` 8448):
- stats off (`--disable-log-stats`): 8 clients without a pause for `--minutes` (default 10),
  one of them sending 4096- and 8192-token prompts in turn;
- stats on: a 4096- and an 8192-token prompt alone, then the same saturation for a third of
  the time.
Every verdict in these phases is a false one.

    .venv/bin/python -m bench.liveness_soak --write docs/performance.md   # about 20 minutes
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

from bench.common import machine, write_section
from bench.downtime_bench import stop
from bench.liveness_real import PORT, complete, start, tokens
from kimi_supervisor.config import Config
from kimi_supervisor.loop.liveness import Liveness, Reading
from tests.realvllm import env
from tests.realvllm.env import long_model

RESULTS = Path(__file__).parent / "results"
VALUES = {
    "shipped": {},
    "scaled": {"metrics_interval_s": 2, "stall_s": 5, "canary_interval_s": 10,
               "canary_timeout_s": 30},
}  # fmt: skip


class Judges:
    """Both liveness configurations watching one vLLM, each as the daemon's loop drives it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.live: dict[str, Liveness] = {}
        self.inbox: dict[str, queue.Queue[Reading]] = {}
        self.tally: dict[str, dict[str, Any]] = {}
        for name, values in VALUES.items():
            config = Config.model_validate({
                "vllm": {"command": ["vllm", "serve", "m"], "port": PORT},
                # Told apart by their argv (check-config refuses two equal ones); unused here.
                "modes": {"production": {"args": []}, "profile": {"args": ["--profile"]}},
                "liveness": values,
            })  # fmt: skip
            self.inbox[name] = q = queue.Queue[Reading]()
            self.live[name] = Liveness(config, q.put)
            self.tally[name] = {"readings": 0, "canaries": 0, "canaries_answered": 0,
                                "verdicts": [], "doubts": 0, "longest_doubt_s": 0.0,
                                "metrics": set()}  # fmt: skip
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.done.is_set():
            now = time.monotonic()
            for name, live in self.live.items():
                live.serving(self.pid, now, capturing=False)
                try:
                    reading = self.inbox[name].get_nowait()
                except queue.Empty:
                    continue
                t = self.tally[name]
                hang = live.seen(reading, time.monotonic())
                t["readings"] += 1
                t["metrics"].add(reading.metrics)
                if reading.canary is not None:
                    t["canaries"] += 1
                    t["canaries_answered"] += reading.canary.answered
                if hang is not None:
                    t["verdicts"].append(hang.reason)
                j = live.judge
                if j.doubt_since is not None:
                    t["doubts"] += 1
                    t["longest_doubt_s"] = max(t["longest_doubt_s"], now - j.doubt_since)
            self.done.wait(0.1)

    def stop(self) -> dict[str, Any]:
        self.done.set()
        self.thread.join(30)
        return {n: t | {"metrics": sorted(t["metrics"]),
                        "longest_doubt_s": round(t["longest_doubt_s"], 1)}
                for n, t in self.tally.items()}  # fmt: skip


def saturate(base: str, model: str, seconds: float, long: list[str]) -> dict[str, Any]:
    """8 clients without a pause; client 0 sends the long prompts in turn."""
    end = time.monotonic() + seconds
    answered, failed, longest = [0], [0], [0.0]

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < end:
            prompt = long[n % len(long)] if i == 0 and long else "hello world the kimi"
            n += 1
            try:
                got = complete(base, model, prompt, 16 + 4 * i, 900)
                answered[0] += 1
                longest[0] = max(longest[0], got["took_s"])
            except OSError:
                failed[0] += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(seconds + 960)
    return {"seconds": seconds, "answered": answered[0], "failed": failed[0],
            "longest_request_s": longest[0]}  # fmt: skip


def measure(minutes: float) -> dict[str, Any]:
    venv = env.venv()
    model = long_model(venv)
    root = Path(tempfile.mkdtemp(prefix="kimi-soak-"))
    (root / "tmp").mkdir()
    (root / "traces").mkdir()
    base, name = f"http://127.0.0.1:{PORT}", str(model)
    out: dict[str, Any] = {"vllm": env.VLLM, "minutes": minutes, "values": VALUES}
    try:
        p = start(venv, model, root, ["--disable-log-stats"])
        try:
            per_word = tokens(base, name, " ".join(["a"] * 100)) / 100
            long = [" ".join(["a"] * int((n - 8) / per_word)) for n in (4096, 8192)]
            judges = Judges(p.pid)
            load = saturate(base, name, minutes * 60, long)
            out["stats_off"] = {"load": load, "judges": judges.stop()}
        finally:
            stop(p)
        p = start(venv, model, root, [])
        try:
            judges = Judges(p.pid)
            prefill = {
                n: complete(base, name, prompt, 4)
                for n, prompt in zip((4096, 8192), long, strict=True)
            }
            load = saturate(base, name, minutes * 20, long)
            out["stats_on"] = {"prefill": prefill, "load": load, "judges": judges.stop()}
        finally:
            stop(p)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def render(m: dict[str, Any]) -> str:
    rows = []
    for phase, what in (("stats_off", "saturated, `--disable-log-stats`, long prompts mixed in"),
                        ("stats_on", "8192/4096-token prompts alone, then saturated")):  # fmt: skip
        r = m[phase]
        for name in VALUES:
            j = r["judges"][name]
            rows.append(
                f"| {what} | {name} | {r['load']['seconds'] / 60:.1f} min, {r['load']['answered']}"
                f" answered, {r['load']['failed']} failed, longest {r['load']['longest_request_s']}"
                f" s | {j['readings']} ({', '.join(j['metrics'])}) | {j['canaries_answered']} of "
                f"{j['canaries']} | {len(j['verdicts'])} | {j['longest_doubt_s']} s |"
            )
    return "\n".join([
        f"Measured {machine()}, {m['vllm']} at tensor parallel 2 (bench/liveness_soak.py): the "
        "product's probe and judge, with the shipped values and the tier's scaled ones, side by "
        "side on one real vLLM. Every verdict here is a false one.",
        "",
        "| what vLLM does | values | load | readings (metrics) | canaries answered | verdicts "
        "| longest doubt |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]) + "\n"  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--write", type=Path, help="docs/performance.md: its section is replaced")
    ap.add_argument("--from", dest="source", type=Path, help="render a saved run's JSON")
    args = ap.parse_args()
    if args.source:
        m = json.loads(args.source.read_text())
    else:
        m = measure(args.minutes)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"liveness-soak-{date.today()}.json").write_text(json.dumps(m, indent=1))
    text = render(m)
    print(text)
    if args.write:
        write_section(args.write, "liveness-soak", text)


if __name__ == "__main__":
    main()
