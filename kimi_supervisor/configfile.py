"""The configuration file read and parsed into kimi_supervisor/config.py's models: only a
regular file, at most MAX_CONFIG_BYTES, every error naming the file, the key path and the
reason."""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

from pydantic import ValidationError

from kimi_supervisor.config import Config, ConfigError
from kimi_supervisor.paths import nul_at


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _reason(err: dict[str, object]) -> str:
    kind = err.get("type")
    if kind == "extra_forbidden":
        return "unknown key (check its spelling; `kimi-supervisor check-config` prints every key)"
    if kind == "missing":
        return "required key is missing"
    msg = str(err.get("msg", "invalid"))
    return msg.removeprefix("Value error, ")


def parse_config(text: str, source: str = "<config>") -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a configuration") from None
    try:
        nul = nul_at(raw)
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply to be a configuration") from None
    if nul is not None:
        raise ConfigError(f"{source}: {_loc(nul)}: a NUL byte (\\u0000) in a string: remove it")
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(err["loc"])
            # A model_validator's error has no location of its own; name the section instead.
            lines.append(f"{source}: {_loc(loc)}: {_reason(dict(err))}")
        raise ConfigError("\n".join(lines)) from None


# A configuration file is a page or two; past this it is not one (`/dev/zero`, a log).
MAX_CONFIG_BYTES = 1 << 20


def load_config(path: Path | str) -> Config:
    """The file at `path`, parsed. Only a regular file is read, opened without blocking (a FIFO
    or a device given by mistake is refused at once, never waited on) and at most
    MAX_CONFIG_BYTES of it."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file (pass --config PATH)") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{p}: not a regular file (a FIFO or a device?): give the TOML file")
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"{p}: cannot read: {e}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: more than {MAX_CONFIG_BYTES} bytes: not a configuration file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: cannot read: {e}") from None
    return parse_config(text, str(p))
