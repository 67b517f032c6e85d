"""Which paths the daemon, running as root, may be told to act on, checked before anything uses
them: a scratch directory whose entries it removes, and strings with no NUL byte."""

from __future__ import annotations

import os
from pathlib import Path

# Directories a leftovers folder may never be: what the system and its users keep there is not
# vLLM's scratch, whatever its name.
SYSTEM_DIRS = frozenset(
    {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32",
     "/media", "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/usr",
     "/var", "/var/lib", "/var/log", "/var/cache", "/usr/lib", "/usr/local", "/usr/bin"}
)  # fmt: skip


def scratch_dir(d: Path) -> Path:
    """`d`, normalised, if the daemon may remove entries there as root (ValueError if not): a
    relative path would depend on its working directory, and a system directory holds what
    nobody may remove by a name pattern."""
    if not d.is_absolute():
        raise ValueError(f"{str(d)!r} is relative: give an absolute path such as /dev/shm")
    if "\0" in str(d):
        raise ValueError("a path with a NUL byte")
    norm = os.path.normpath(str(d))
    if norm in SYSTEM_DIRS or norm.startswith(("/proc/", "/sys/")):
        raise ValueError(
            f"{norm!r} is a system directory: name the scratch directory vLLM writes to "
            "(/dev/shm for shared memory, vLLM's TMPDIR for its sockets)"
        )
    return Path(norm)


def nul_at(value: object, where: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Where a string with a NUL byte is in parsed TOML or JSON (a path cannot hold one)."""
    if isinstance(value, str):
        return where if "\0" in value else None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return None
    for k, v in items:
        found = nul_at(v, (*where, k))
        if found is not None:
            return found
    return None
