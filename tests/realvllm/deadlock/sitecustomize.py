"""A real deadlock for real vLLM 0.16, for the real-vLLM tier (on vLLM's PYTHONPATH): while the
file named by KIMI_DEADLOCK_FILE exists, the engine core begins no step; where the file names a
PID, only the engine core whose parent (the API server, the unit's MainPID) it is. So a test
keeps the old vLLM deadlocked until the new one serves: released at the verdict, the old
engine answered its queued clients before its teardown, and the clients' outage read short
(an outside review). It waits asleep (state
S, no CPU) with requests running, as an engine stuck on a lock or in a collective that sleeps
does; its API server goes on answering /health with 200. Every process of vLLM reads this file
at start; only the engine core's module is patched, as it is imported, before the engine's
step is bound."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
from typing import Any

FILE = os.environ.get("KIMI_DEADLOCK_FILE", "")
TARGET = "vllm.v1.engine.core"


def _patch(module: Any) -> None:
    cls = module.EngineCore
    for name in ("step", "step_with_batch_queue"):
        original = getattr(cls, name)

        def held(self: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            while _deadlocked():
                time.sleep(0.05)
            return _original(self, *args, **kw)

        setattr(cls, name, held)


def _deadlocked() -> bool:
    try:
        with open(FILE, encoding="ascii") as f:
            named = f.read(32).strip()
    except (OSError, ValueError):
        return False
    return not named or named == str(os.getppid())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module  # type: ignore[union-attr]

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[union-attr,method-assign]
        return spec


if FILE:
    sys.meta_path.insert(0, _Finder())
