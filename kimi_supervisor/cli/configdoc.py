"""kimi-supervisor.toml(5), generated from the config model (kimi_supervisor/config.py) so that
it cannot drift: every section and key the daemon accepts, with its type, its default and its
description. A key's description is the comment block just above it in config.py; a test
fails for a key without one.

`python -m kimi_supervisor.cli.manpage OUTDIR` writes it with the other pages.
"""

from __future__ import annotations

import ast
import inspect
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from kimi_supervisor import config as config_module
from kimi_supervisor.config import Config
from kimi_supervisor.tomlwrite import to_toml
from kimi_supervisor.version import package_version


def _comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment block above the field in config.py."""
    source = inspect.getsource(config_module)
    lines = source.splitlines()
    out: dict[tuple[str, str], str] = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            block: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                block.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            out[(cls.name, node.target.id)] = " ".join(block)
    return out


def _type(annotation: Any) -> str:
    """A TOML reader's name for the type: string, integer, float, path, list of …, one of …"""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return "one of " + ", ".join(f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return " or ".join(_type(a) for a in kept) + (", or unset" if len(kept) < len(args) else "")
    if origin is list:
        return f"list of {_type(args[0])}s"
    if origin is dict:
        return f"table of {_type(args[1])}s"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "(required)"
    value = field.default_factory() if field.default_factory else field.default
    if value is None:
        return "(unset)"
    if isinstance(value, BaseModel):
        return "(see its keys)"
    return to_toml_value(value)


def to_toml_value(value: Any) -> str:
    text = to_toml(_Wrap(v=value)).strip()
    return text.split("=", 1)[1].strip() if "=" in text else text


class _Wrap(BaseModel):
    v: Any


def keys() -> list[tuple[str, str, str, str, str]]:
    """(section, key, type, default, description) for every key the config accepts."""
    comments = _comments()
    rows = []
    for section, f in Config.model_fields.items():
        model = f.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):  # [modes.production]
                for subname, subfield in sub.model_fields.items():
                    what = comments.get((sub.__name__, subname), "")
                    kind, default = _type(subfield.annotation), _default(subfield)
                    rows.append((f"{section}.{name}", subname, kind, default, what))
                continue
            what = comments.get((model.__name__, name), "")
            rows.append((section, name, _type(field.annotation), _default(field), what))
    return rows


def esc(text: str) -> str:
    """Text for roff: backslashes and hyphens escaped, no line read as a request, ASCII."""
    text = text.replace("\\", "\\e").replace("-", "\\-").replace("…", "...")
    return "\n".join("\\&" + ln if ln.startswith((".", "'")) else ln for ln in text.split("\n"))


EXAMPLE = """[vllm]
command = ["/opt/vllm/bin/vllm", "serve", "/models/Kimi-K2.5-INT4",
           "--tensor-parallel-size", "8", "--trust-remote-code"]

[modes.production]
args = ["--max-model-len", "131072"]

[modes.profile]
args = ["--max-model-len", "131072",
        "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/var/tmp/traces"}']

[metrics]
address = "0.0.0.0"   # and let the fleet's Prometheus in (docs/operations.md)"""


def render() -> str:
    lines = [
        f'.TH KIMI-SUPERVISOR.TOML 5 "" "kimi-supervisor {package_version()}"',
        ".nh",
        ".ad l",
        ".SH NAME",
        "kimi\\-supervisor.toml \\- the configuration of kimi\\-supervisor",
        ".SH SYNOPSIS",
        "\\fI/etc/kimi\\-supervisor/kimi\\-supervisor.toml\\fR",
        ".SH DESCRIPTION",
        ".PP",
        esc(
            "A TOML file. Only [vllm] command and the two modes' args are required; every "
            "other key has the default shown. An unknown key is an error (check its spelling). "
            "`kimi-supervisor check-config FILE` validates a file, prints the effective "
            "configuration with every default, and checks this host against it; `systemctl "
            "reload kimi-supervisor` makes the daemon read it again (a changed vLLM argv is "
            "then applied only by `kimi-mode MODE --apply`)."
        ),
    ]
    section = ""
    for sec, key, typ, default, what in keys():
        if sec != section:
            section = sec
            lines += [f".SS [{esc(sec)}]"]
        lines += [".TP", f"\\fB{esc(key)}\\fR = {esc(default)}  ({esc(typ)})", esc(what)]
    lines += [".SH EXAMPLES", ".PP", "A host's file, the rest left at its defaults:", ".PP",
              ".nf", esc(EXAMPLE), ".fi"]  # fmt: skip
    lines += [".SH SEE ALSO", "\\fBkimi\\-supervisor\\fR(8), \\fBkimi\\-mode\\fR(1)"]
    return "\n".join(lines) + "\n"
