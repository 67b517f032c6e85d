"""A Chrome trace JSON file (gzipped or not) read as a stream: the objects of its `traceEvents`
array decoded one at a time from a window of the unpacked text (a few MB however large the
file), with a bound on any one value so that a malformed or hostile file is refused at once."""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterator
from typing import IO, Any, cast

CHUNK = 1 << 20
MAX_VALUE = 16 << 20  # one event or top-level value; kineto's are under a few KB
_SKIP = re.compile(r"\s*")
_SKIP_COMMA = re.compile(r"[\s,]*")


class TraceError(Exception):
    """The file is not a readable Chrome trace: the message says what was found."""


def open_text(raw: IO[bytes]) -> IO[str]:
    """The trace's text, unpacked as it is read when it is gzipped (by its magic bytes, not its
    name: tensorboard_trace_handler writes both)."""
    buffered = cast(io.BufferedReader, raw)
    if not hasattr(raw, "peek"):
        buffered = io.BufferedReader(cast(io.RawIOBase, raw))
    stream: IO[bytes] = buffered
    if buffered.peek(2)[:2] == b"\x1f\x8b":
        stream = cast(IO[bytes], gzip.GzipFile(fileobj=buffered))
    return io.TextIOWrapper(stream, encoding="utf-8", errors="replace")


def events(text: IO[str], meta: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """The objects of the trace's `traceEvents` array, one at a time. The other top-level keys
    (small: distributedInfo, deviceProperties) go into `meta`."""
    dec = json.JSONDecoder()
    buf, i = "", 0
    eof = False

    def more() -> bool:
        nonlocal buf, i, eof
        if eof:
            return False
        chunk = text.read(CHUNK)
        if not chunk:
            eof = True
            return False
        buf, i = buf[i:] + chunk, 0
        return True

    def skip(chars: str) -> str:
        """Skips whitespace and `chars`; the next character ('' at the end)."""
        nonlocal i
        pattern = _SKIP_COMMA if chars else _SKIP
        while True:
            i = pattern.match(buf, i).end()  # type: ignore[union-attr]
            if i < len(buf):
                return buf[i]
            if not more():
                return ""

    def value() -> Any:
        nonlocal i
        skip("")
        while True:
            try:
                v, i = dec.raw_decode(buf, i)
                return v
            except json.JSONDecodeError as e:
                # Incomplete (read on), or malformed: a value never grows past MAX_VALUE, so
                # a broken or hostile file costs a bounded window, not the whole file.
                if len(buf) - i > MAX_VALUE:
                    raise TraceError(
                        f"malformed JSON, or a value over {MAX_VALUE >> 20} MB ({e.msg})"
                    ) from None
                if not more():
                    raise TraceError(f"the trace ends inside a value ({e.msg})") from None

    if skip("") != "{":
        raise TraceError("not a Chrome trace: it does not start with a JSON object")
    i += 1
    seen_events = False
    while True:
        c = skip(",")
        if c == "}":
            break
        if c != '"':
            raise TraceError("not a Chrome trace: a malformed top-level key" if c else "truncated")
        key = value()
        if skip("") != ":":
            raise TraceError(f"not a Chrome trace: no value after {key!r}")
        i += 1
        if key != "traceEvents":
            v = value()
            if meta is not None:
                meta[key] = v
            continue
        if skip("") != "[":
            raise TraceError("not a Chrome trace: traceEvents is not a list")
        i += 1
        seen_events = True
        while True:
            c = skip(",")
            if c == "]":
                i += 1
                break
            if not c:
                raise TraceError("the trace is truncated inside traceEvents")
            ev = value()
            if isinstance(ev, dict):
                yield ev
    if not seen_events:
        raise TraceError("not a Chrome trace: no traceEvents")
