"""The messages the daemon's core publishes: a reply to a request, an event of a transition, and
the end of one. Plain pydantic data; the control protocol (kimi_supervisor/control/protocol.py)
carries them on the wire, and the core never imports the protocol.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION: Literal[1] = 1


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")
    v: Literal[1] = PROTOCOL_VERSION


class Reply(_Msg):
    type: Literal["reply"] = "reply"
    ok: bool
    code: str
    message: str = ""
    data: dict[str, Any] = Field(default_factory=dict)


class Event(_Msg):
    type: Literal["event"] = "event"
    event: str
    at: datetime
    transition: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class End(_Msg):
    type: Literal["end"] = "end"
    ok: bool
    outcome: str
    message: str = ""
    data: dict[str, Any] = Field(default_factory=dict)
