"""What a failed start's output says went wrong: the lines an operator would look for first.

vLLM's own failures end in a Python traceback, often two: the engine core's root cause (for
example `torch.OutOfMemoryError: CUDA out of memory …`), then the API server's `RuntimeError:
Engine core initialization failed. See root cause above.` The launcher's own failure is one
line (`cannot execute …`). So: the exception lines of the tail, the first and the last of
them; else the last line that says error; else the last line at all.
"""

from __future__ import annotations

import re

# `torch.OutOfMemoryError: …`, `ValueError: …`, `SystemExit: …`, and the launcher's own line.
EXCEPTION = re.compile(r"^\s*(?:[\w.]+(?:Error|Exception|Exit|Interrupt)\b:?|cannot execute )")
ERRORISH = re.compile(r"\b(?:ERROR|Error|error:|FATAL|Killed|No such file|Permission denied)")
MAX_CHARS = 300


def _clean(line: str) -> str:
    line = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line)  # colours
    line = "".join(c if c.isprintable() else " " for c in line).strip()
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 3] + "..."


def explain(tail: list[str]) -> list[str]:
    """At most two lines of `tail` (vLLM's last output) that say why it failed, cleaned."""
    lines = [c for c in (_clean(x) for x in tail) if c]
    found = [x for x in lines if EXCEPTION.match(x)]
    if found:
        return list(dict.fromkeys([found[0], found[-1]]))
    errors = [x for x in lines if ERRORISH.search(x)]
    if errors:
        return [errors[-1]]
    return lines[-1:]
