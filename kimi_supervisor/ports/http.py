"""The HTTP port: vLLM's /health and profiler endpoints on localhost. Plain urllib, short
timeouts; every failure becomes a status code or a message, never an exception upwards."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpResult:
    status: int  # 0: no answer (refused, timed out, reset)
    body: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def request(url: str, method: str = "GET", timeout_s: float | None = 2.0) -> HttpResult:
    """`timeout_s` None waits as long as the server takes (a profiler flush)."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return HttpResult(int(r.status), r.read(4096).decode(errors="replace"))
    except urllib.error.HTTPError as e:
        body = e.read(4096).decode(errors="replace") if e.fp else ""
        return HttpResult(int(e.code), body, f"HTTP {e.code}")
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return HttpResult(0, "", str(reason) or type(e).__name__)
