"""The control protocol: newline-delimited JSON over a Unix stream socket, one request per
connection. Every message carries the protocol version `v`.

Requests (client -> daemon):
    {"v": 1, "cmd": "status"}
    {"v": 1, "cmd": "history", "n": 20}
    {"v": 1, "cmd": "switch", "mode": "profile", "follow": true, "force": false}
    {"v": 1, "cmd": "subscribe"}
    {"v": 1, "cmd": "capture", "seconds": 30, "then": "production"}
    {"v": 1, "cmd": "capture_stop"}

Answers (daemon -> client), each one line:
    {"v": 1, "type": "reply", "ok": true, "code": "accepted", "message": "...", "data": {...}}
    {"v": 1, "type": "event", "event": "step_finished", "at": "...", "transition": "t-...",
     "data": {...}}
    {"v": 1, "type": "end", "ok": true, "outcome": "ready", "message": "...", "data": {...}}

A request gets exactly one reply. `switch` with follow and `subscribe` then stream events; a
followed switch ends with one `end` message. Errors are replies with ok=false and a code from
ERROR_CODES. This module imports only pydantic: the client stays light.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kimi_supervisor.messages import PROTOCOL_VERSION, End, Event, Reply, _Msg

__all__ = ["PROTOCOL_VERSION", "End", "Event", "ProtocolError", "Reply", "encode", "parse_request"]


# Reply codes. ok: accepted, joined, already, status, history, subscribed.
ERROR_CODES = {
    "bad_json": "the line is not JSON",
    "bad_request": "the request does not match the protocol (see docs/control-protocol.md)",
    "unsupported_version": "the client speaks another protocol version",
    "too_long": "the request line is longer than control.max_line_bytes",
    "idle": "no request arrived within control.idle_timeout_s",
    "forbidden": "the caller is neither root nor in the control group",
    "busy": "another switch is in progress",
    "too_many_clients": "control.max_clients connections are open",
    "stopping": "the daemon is shutting down",
    "state_error": "the daemon cannot persist the request (a full disk?); nothing was changed",
    "internal": "the daemon failed to answer; see its log",
}


# Numbers from the wire are finite and bounded (allow_inf_nan=False; JSON's Infinity and NaN,
# which Python's json accepts, are refused): profile mode for at most 366 days, a capture for a day.
MAX_PROFILE_S = 366 * 86400.0
MAX_CAPTURE_S = 86400.0


class _Request(_Msg):
    model_config = ConfigDict(**{**_Msg.model_config, "allow_inf_nan": False})


class StatusRequest(_Request):
    cmd: Literal["status"] = "status"


class HistoryRequest(_Request):
    cmd: Literal["history"] = "history"
    n: int = Field(default=20, ge=1, le=10_000)


class SwitchRequest(_Request):
    cmd: Literal["switch"] = "switch"
    mode: Literal["production", "profile"]
    follow: bool = True
    # Take over from a switch in progress instead of being refused; cut a capture's flush short.
    force: bool = False
    # Restart the mode that serves when it runs an earlier config's argv (after a reload).
    apply: bool = False
    # profile only: go back to production after this long (asking again extends it).
    for_s: float | None = Field(default=None, gt=0, le=MAX_PROFILE_S)


class CaptureRequest(_Request):
    cmd: Literal["capture"] = "capture"
    seconds: float | None = Field(default=None, gt=0, le=MAX_CAPTURE_S)  # None: until stopped
    then: Literal["production", "stay"] = "production"
    out: str | None = Field(default=None, max_length=4096)  # an absolute directory for the files


class CaptureStopRequest(_Request):
    cmd: Literal["capture_stop"] = "capture_stop"


class SubscribeRequest(_Request):
    cmd: Literal["subscribe"] = "subscribe"


AnyRequest = (
    StatusRequest
    | HistoryRequest
    | SwitchRequest
    | SubscribeRequest
    | CaptureRequest
    | CaptureStopRequest
)
Request = Annotated[AnyRequest, Field(discriminator="cmd")]
_REQUEST = TypeAdapter(Request)


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_request(line: bytes) -> AnyRequest:
    try:
        raw = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError("bad_json", f"the request is not JSON: {e}") from None
    except RecursionError:
        raise ProtocolError(
            "bad_json", "the request is nested too deeply to be a request"
        ) from None
    if not isinstance(raw, dict):
        raise ProtocolError("bad_request", "the request must be a JSON object")
    if raw.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        raise ProtocolError(
            "unsupported_version",
            f"protocol version {raw.get('v')!r} is not supported; this daemon speaks "
            f"{PROTOCOL_VERSION}: use the kimi-mode installed with it",
        )
    try:
        return _REQUEST.validate_python(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'request'}: {err['msg']}" for err in e.errors()
        )
        raise ProtocolError("bad_request", f"bad request: {problems}") from None


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json().encode() + b"\n"
