"""vLLM's start-up, read from its output: safetensors shard %, weights loaded, CUDA graph
capture, the API server, ready.

Pure parsing; where the lines come from is the output port's business. tqdm bars arrive as
one line with carriage returns between updates: the last update counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SHARDS = re.compile(r"Loading safetensors checkpoint shards:\s*(\d+)%")
_GRAPHS = re.compile(r"Capturing CUDA graphs?[^:]*:\s*(\d+)%")
# vLLM 0.16 after the last shard: "Loading weights took 0.12 seconds" (every build), then on GPUs
# "Model loading took 1.2 GiB memory and 3.4 seconds"; engine init (profile run, KV cache,
# compile, warm-up) follows.
_LOADED = re.compile(r"Loading weights took|Model loading took")
_API = re.compile(r"Starting vLLM API server|Application startup complete")

PHASES = ("starting", "loading", "loaded", "graphs", "api", "ready")


@dataclass(frozen=True)
class Progress:
    phase: str = "starting"  # one of PHASES
    percent: int | None = None
    line: str = ""

    def describe(self) -> str:
        words = {
            "starting": "starting vLLM",
            "loading": "loading safetensors shards",
            "loaded": "weights loaded; initializing the engine (profile, KV cache, compile)",
            "graphs": "capturing CUDA graphs",
            "api": "starting the API server",
            "ready": "ready",
        }[self.phase]
        return f"{words} {self.percent}%" if self.percent is not None else words


def advance(current: Progress, line: str) -> Progress:
    """The progress after one more line of output (it never goes back a phase)."""
    update = line.rsplit("\r", 1)[-1].strip() or line.strip()
    found: Progress | None = None
    if m := _SHARDS.search(update):
        found = Progress("loading", int(m.group(1)), update)
    elif _LOADED.search(update):
        found = Progress("loaded", None, update)
    elif m := _GRAPHS.search(update):
        found = Progress("graphs", int(m.group(1)), update)
    elif _API.search(update):
        found = Progress("api", None, update)
    if found is None or PHASES.index(found.phase) < PHASES.index(current.phase):
        return current
    return found


def weights_loaded(p: Progress) -> bool:
    """The weights are in: the shard bar at 100 %, or any later phase."""
    i = PHASES.index(p.phase)
    return i > PHASES.index("loading") or (p.phase == "loading" and p.percent == 100)
