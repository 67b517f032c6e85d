"""The output contract every kimi-mode command keeps (docs/control-protocol.md, "kimi-mode's
output"). The exit codes they share: cli/exits.py.

`-o json` (or `--json`): JSON Lines on stdout, nothing else there. Every line is one object with
`"v"` (this contract's version) and `"type"`; a command that answers once prints one line, a list
one line per item, a stream (a followed switch, a capture, `wait`, `status --watch`, `logs -f`)
a line per message as it comes. A switch's and a capture's lines are the control protocol's own
messages (`reply`, `event`, `end`), which carry the same `v`. A command that fails prints one
`error` line with its exit code, and says it on stderr too. The shapes are pydantic models in
OUTPUT_TYPES, exported as a JSON Schema (docs/kimi-mode-output.schema.json) that a test
checks every command's output against.

`-o text` (the default): what a person reads; no promise about its form.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, Literal, TextIO

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from kimi_supervisor.cli.exits import Exit
from kimi_supervisor.messages import PROTOCOL_VERSION, End, Event, Reply
from kimi_supervisor.status import Status


# ------------------------------------------------------------------------------ the JSON shapes
class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")
    v: Literal[1] = PROTOCOL_VERSION


class StatusOut(Status):
    """`status`, `wait`'s last line, each line of `status --watch`: the daemon's status
    (kimi_supervisor/status.py's Status, whose fields sit beside `v` and `type`)."""

    v: Literal[1] = PROTOCOL_VERSION
    type: Literal["status"] = "status"


class IsServingOut(_Out):
    type: Literal["is_serving"] = "is_serving"
    serving: bool
    state: str
    mode: str | None
    waiting_for: str | None = None


class RecordOut(_Out):
    """`history`: one past switch, teardown, capture or incident per line, oldest first."""

    type: Literal["record"] = "record"
    kind: str


class SummaryOut(_Out):
    """`capture --summarize`: the capture's summary (summary.json's content)."""

    type: Literal["summary"] = "summary"
    ranks: list[dict[str, Any]]
    across_ranks: dict[str, Any] | None = None


class CompareRow(BaseModel):
    what: str  # a figure ("step p50", "all_reduce wait", ...) or a kernel's name
    a: float | None  # ms per step, mean over the ranks; None where that capture lacks it
    b: float | None
    delta: float | None  # b - a


class CompareOut(_Out):
    """`capture --compare A B`: two captures' summaries side by side, one step kind."""

    type: Literal["compare"] = "compare"
    a: str
    b: str
    kind: str
    rows: list[CompareRow]
    top: list[CompareRow]
    verdict: str
    notes: list[str]


class LogOut(_Out):
    """`logs`: one journal entry of vLLM's unit or the daemon's."""

    type: Literal["log"] = "log"
    unit: str
    at: str | None
    priority: int | None
    pid: int | None
    message: str
    fields: dict[str, str] = Field(default_factory=dict)


class CheckOut(BaseModel):
    name: str
    ok: bool | None  # None: could not be checked here (said in `message`)
    message: str
    fix: str = ""


class DoctorOut(_Out):
    type: Literal["doctor"] = "doctor"
    ok: bool
    checks: list[CheckOut]


class VerdictOut(_Out):
    """`wait MODE`'s last line: whether MODE serves, and if not what held it back (`verdict`:
    serving, failed, rolled_back, stuck, not_asked, timeout, unreachable, interrupted), with the
    exit it ends with."""

    type: Literal["verdict"] = "verdict"
    mode: str
    ok: bool
    verdict: str
    exit: int
    message: str


class ErrorOut(_Out):
    """A command that failed before or instead of its own output."""

    type: Literal["error"] = "error"
    exit: int
    code: str
    message: str


OutputLine = Annotated[
    StatusOut
    | IsServingOut
    | RecordOut
    | SummaryOut
    | CompareOut
    | LogOut
    | DoctorOut
    | VerdictOut
    | ErrorOut
    | Reply
    | Event
    | End,
    Field(discriminator="type"),
]
OUTPUT_TYPES: tuple[type[BaseModel], ...] = (
    StatusOut,
    IsServingOut,
    RecordOut,
    SummaryOut,
    CompareOut,
    LogOut,
    DoctorOut,
    VerdictOut,
    ErrorOut,
    Reply,
    Event,
    End,
)


def schema() -> dict[str, Any]:
    """The JSON Schema of one output line (docs/kimi-mode-output.schema.json; regenerate with
    `python -m kimi_supervisor.cli.output > docs/kimi-mode-output.schema.json`)."""
    s = TypeAdapter(OutputLine).json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kimi-mode -o json: one line",
        **s,
    }


# ------------------------------------------------------------------------------ printing
class Output:
    """Where a command's results go: JSON lines, or text for a person."""

    def __init__(self, fmt: str, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.json = fmt == "json"
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def line(self, obj: dict[str, Any] | BaseModel) -> None:
        """One JSON line (json mode only)."""
        if isinstance(obj, BaseModel):
            text = obj.model_dump_json()
        else:
            text = json.dumps(obj, separators=(",", ":"))
        self.out.write(text + "\n")
        self.out.flush()

    def raw(self, raw: bytes) -> None:
        """A protocol message as the daemon sent it (it carries v and type)."""
        self.out.write(raw.decode() + "\n")
        self.out.flush()

    def text(self, text: str) -> None:
        if not self.json:
            print(text, file=self.out, flush=True)

    def fail(self, code: Exit, message: str, kind: str = "") -> Exit:
        """Say why the command failed (stderr; and an `error` line in json mode); its exit."""
        print(f"kimi-mode: {message}", file=self.err, flush=True)
        if self.json:
            self.line(ErrorOut(exit=code, code=kind or code.label, message=message))
        return code


if __name__ == "__main__":
    print(json.dumps(schema(), indent=2))
