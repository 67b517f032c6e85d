"""A pydantic model written back as TOML (`kimi-supervisor check-config` prints the effective
configuration this way): sub-models become [tables], everything else a key = value line."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return json.dumps(str(v), ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def to_toml(model: BaseModel, prefix: str = "") -> str:
    """Sub-models become [tables]; everything else is a key = value line. Unset optionals are
    left out (TOML has no null)."""
    lines: list[str] = []
    tables: list[tuple[str, BaseModel]] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            tables.append((f"{prefix}.{name}" if prefix else name, value))
        elif value is not None:
            lines.append(f"{name} = {_toml_value(value)}")
    out = ([f"[{prefix}]", *lines, ""] if prefix else [*lines, ""]) if lines else []
    for table_name, sub in tables:
        out.append(to_toml(sub, table_name))
    return "\n".join(out)
