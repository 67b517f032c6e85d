"""`kimi-mode logs [-f] [-n N] [--daemon]`: vLLM's output, or the daemon's, where the unit's
output goes: the journal on a host (`journalctl -u UNIT`, as an operator would type it; the
text is journalctl's own), or the file a sandbox's config names (vllm.log_file,
daemon.log_file). In json mode each entry is one `log` line of the output contract.

Reading another's file is bounded: at most MAX_TAIL_BYTES from the end of a file, and each line
at most MAX_LINE bytes, whatever the writer put there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kimi_supervisor.cli.exits import Exit
from kimi_supervisor.cli.output import LogOut, Output
from kimi_supervisor.ports.output import MAX_LINE  # the daemon's own bound on a line

DAEMON_UNIT = "kimi-supervisor.service"
DEFAULT_VLLM_UNIT = "vllm-kimi-k25.service"
MAX_TAIL_BYTES = 4 << 20
FOLLOW_POLL_S = 0.25  # a file followed (the sandbox): how often it is read again


def show_logs(args: argparse.Namespace, config: Any, o: Output) -> int:
    """`config`: the loaded config, or None (then the system journal and the default units)."""
    unit = DAEMON_UNIT if args.daemon else (config.service.unit if config else DEFAULT_VLLM_UNIT)
    log_file = None
    if config is not None:
        log_file = config.daemon.log_file if args.daemon else config.vllm.log_file
    if log_file is not None:
        return _file(Path(log_file), unit, args, o=o)
    scope = config.systemd.scope if config is not None else "system"
    return _journal(unit, scope, args, o=o)


def _journal(unit: str, scope: str, args: argparse.Namespace, *, o: Output) -> int:
    exe = shutil.which("journalctl")
    if exe is None:
        return o.fail(Exit.FAILED, "journalctl is not installed here: no journal to read")
    which = ["--user-unit", unit] if scope == "user" else ["--unit", unit]
    argv = [exe, *which, "--lines", str(args.lines), "--no-pager"]
    if args.follow:
        argv.append("--follow")
    if not o.json:
        # journalctl's own text, on our stdout: what `journalctl -u` shows, colours and all.
        try:
            rc = subprocess.run(argv, check=False).returncode
            return Exit.OK if rc == 0 else Exit.FAILED
        except KeyboardInterrupt:
            return Exit.OK
    proc = subprocess.Popen([*argv, "--output", "json"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        for raw in proc.stdout:
            try:
                entry = json.loads(raw[: 1 << 20])
            except ValueError:
                continue
            o.line(_journal_entry(unit, entry))
    except KeyboardInterrupt:
        pass
    finally:
        proc.terminate()
        proc.wait()
    return Exit.OK if proc.returncode in (0, -15) else Exit.FAILED


def _text(value: Any) -> str:
    """A journal field's value: a string, or (binary) a list of byte values."""
    if isinstance(value, list):
        return bytes(v for v in value if isinstance(v, int) and 0 <= v < 256).decode(
            errors="replace"
        )
    return str(value)


def _journal_entry(unit: str, e: dict[str, Any]) -> LogOut:
    at = None
    if str(e.get("__REALTIME_TIMESTAMP", "")).isdigit():
        at = datetime.fromtimestamp(int(e["__REALTIME_TIMESTAMP"]) / 1e6, UTC).isoformat()
    prio = str(e.get("PRIORITY", ""))
    pid = str(e.get("_PID", ""))
    return LogOut(
        unit=unit,
        at=at,
        priority=int(prio) if prio.isdigit() else None,
        pid=int(pid) if pid.isdigit() else None,
        message=_text(e.get("MESSAGE", ""))[:MAX_LINE],
        fields={k: _text(v)[:MAX_LINE] for k, v in e.items() if k.startswith("KIMI_")},
    )


def _file(path: Path, unit: str, args: argparse.Namespace, *, o: Output) -> int:
    try:
        f = open(path, "rb")  # noqa: SIM115 (followed until Ctrl-C)
    except FileNotFoundError:
        return o.fail(Exit.FAILED, f"{path} does not exist yet: {unit} has written nothing")
    except OSError as e:
        return o.fail(Exit.USAGE, f"cannot read {path}: {e.strerror}")
    with f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(size - MAX_TAIL_BYTES, 0))
        data = f.read(MAX_TAIL_BYTES)
        *lines, partial = data.split(b"\n")
        for line in lines[-args.lines :]:
            _file_line(o, unit, line)
        if not args.follow:
            if partial:
                _file_line(o, unit, partial)
            return Exit.OK
        try:
            while True:
                chunk = f.read(MAX_TAIL_BYTES)
                if not chunk:
                    if os.fstat(f.fileno()).st_size < f.tell():
                        f.seek(0)  # truncated: from its start again
                    time.sleep(FOLLOW_POLL_S)
                    continue
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    _file_line(o, unit, line)
                if len(partial) > MAX_LINE:
                    _file_line(o, unit, partial)
                    partial = b""
        except KeyboardInterrupt:
            return Exit.OK


def _file_line(o: Output, unit: str, line: bytes) -> None:
    text = line[:MAX_LINE].decode(errors="replace")
    if o.json:
        o.line(LogOut(unit=unit, at=None, priority=None, pid=None, message=text))
    else:
        print(text, file=o.out, flush=True)
