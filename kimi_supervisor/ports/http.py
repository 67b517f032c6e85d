"""The HTTP port: vLLM's /health, /metrics, profiler and completion endpoints on localhost.
Plain urllib, short timeouts; every failure becomes a status code or a message, never an
exception upwards."""

from __future__ import annotations

import json
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

    @property
    def timed_out(self) -> bool:
        """No answer within the timeout: slow, which alone says nothing of a hang."""
        return self.status == 0 and "timed out" in self.error


def request(
    url: str,
    method: str = "GET",
    timeout_s: float | None = 2.0,
    json_body: dict[str, object] | None = None,
    max_bytes: int = 4096,
) -> HttpResult:
    """`timeout_s` None waits as long as the server takes (a profiler flush); it bounds each
    wait for the server, as urllib's does. At most `max_bytes` of the answer are read."""
    data = json.dumps(json_body).encode() if json_body is not None else None
    if data is None and method == "POST":
        data = b""
    headers = {"Content-Type": "application/json"} if json_body is not None else {}
    req = urllib.request.Request(url, method=method, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return HttpResult(int(r.status), r.read(max_bytes).decode(errors="replace"))
    except urllib.error.HTTPError as e:
        body = e.read(4096).decode(errors="replace") if e.fp else ""
        return HttpResult(int(e.code), body, f"HTTP {e.code}")
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return HttpResult(0, "", str(reason) or type(e).__name__)
