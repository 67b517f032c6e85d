"""How a mode's argv reaches vLLM byte for byte.

The daemon writes the exact argv as a JSON array into the argv file; the unit's ExecStart runs
`kimi-supervisor launch-vllm --argv-file %t/kimi-supervisor/vllm-argv.json`, which execs it.
No shell and no systemd quoting rules stand in between, so JSON arguments with quotes and
spaces arrive unchanged, and the exec keeps the unit's MainPID.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from supervisor.config import Config
from supervisor.model import Mode, utcnow


class LaunchError(Exception):
    pass


def write_argv_file(config: Config, mode: Mode) -> Path:
    path = config.vllm.argv_file
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "mode": mode.value,
        "argv": config.launch_argv(mode),
        "written_at": utcnow().isoformat(),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_argv_file(path: Path) -> list[str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LaunchError(
            f"{path} does not exist: vLLM is started by kimi-supervisor, which writes this file "
            "first. Use `kimi-mode production` instead of starting the unit by hand."
        ) from None
    except (OSError, ValueError) as e:
        raise LaunchError(f"{path} is unreadable or not JSON ({e})") from None
    argv = data.get("argv") if isinstance(data, dict) else None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise LaunchError(f"{path}: 'argv' must be a non-empty list of strings")
    return argv


def exec_vllm(path: Path) -> None:
    argv = read_argv_file(path)
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        raise LaunchError(f"cannot execute {argv[0]}: {e}") from None
