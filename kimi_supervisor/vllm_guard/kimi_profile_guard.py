"""vLLM's profiler routes, for the daemon only: an ASGI middleware vLLM 0.16 loads itself.

vLLM started with --profiler-config serves POST /start_profile and /stop_profile on its serving
port, open to every client (--api-key guards only /v1/*). The launcher (ports/launcher.py) starts
an armed vLLM with `--middleware kimi_profile_guard.ProfileGuard`, this folder on its PYTHONPATH
and the secret of this start in its environment (KIMI_PROFILE_TOKEN). The guard answers 403 to
any request for those routes that does not carry the secret in X-Kimi-Profile-Token; the
daemon's capture (capture/job.py) sends it. Without a secret it refuses them all: fail closed.

A route is any path with `start_profile` or `stop_profile` in it, whatever comes before or after
it (a --root-path, `//start_profile`, `/start_profile/`, a decoded `%0A`) and whatever the
method. vLLM serves no other path with those names.

Standard library only, and nothing of kimi_supervisor: vLLM's own Python imports it. The fake
vLLM (sandbox/fake_api.py) imports it the same way and asks `admits`, so both answer alike.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

HEADER = "X-Kimi-Profile-Token"
ENV = "KIMI_PROFILE_TOKEN"
GUARDED = frozenset({"start_profile", "stop_profile"})
REFUSAL = {
    "error": {
        "message": "the profiler's routes take orders from kimi-supervisor only "
        "(`kimi-mode capture`)",
        "type": "Forbidden",
        "code": 403,
    }
}

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def guarded(path: str) -> bool:
    """Whether a request for `path` (as the server decoded it) may reach a profiler route: the
    name anywhere in it. Not a segment's whole: uvicorn decodes `/start_profile%0A` to a path
    ending in a newline, which Starlette's route pattern (`^/start_profile$`: Python's `$`
    matches before a final newline) still takes (found by an outside review)."""
    return any(name in path for name in GUARDED)


def secret_of(environ: Mapping[str, str]) -> bytes | None:
    """The secret of this start, None when there is none (every guarded request is refused)."""
    value = environ.get(ENV, "").strip()
    return value.encode() if value else None


def admits(path: str, token: bytes | None, secret: bytes | None) -> bool:
    """Whether a request for `path` carrying `token` (None: no header) goes through."""
    if not guarded(path):
        return True
    if secret is None or token is None:
        return False
    return hmac.compare_digest(token, secret)


class ProfileGuard:
    """The ASGI middleware: vLLM adds it with `app.add_middleware(ProfileGuard)`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.secret = secret_of(os.environ)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        name = HEADER.lower().encode()
        tokens = [v for k, v in scope.get("headers", []) if bytes(k).lower() == name]
        # Two headers: refused, whichever a server behind would read.
        token = bytes(tokens[0]) if len(tokens) == 1 else None
        if admits(path, token, self.secret):
            await self.app(scope, receive, send)
            return
        body = json.dumps(REFUSAL).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 403,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
