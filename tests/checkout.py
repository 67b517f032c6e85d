"""The checkout's files as a clone has them: tracked and not ignored. In a git checkout git
lists them; a release tree (a copy with no .git, as the fresh booted host gets, or a machine
without git) is walked, leaving out what .gitignore names, so that the tests read the same
files either way."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def files(root: Path = ROOT) -> list[str]:
    """Every file of the checkout at `root`, as paths relative to it, sorted."""
    if (root / ".git").exists() and shutil.which("git"):
        names = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root, capture_output=True, check=True,
        ).stdout.split(b"\0")  # fmt: skip
        return sorted({n.decode() for n in names if n})
    return sorted(_walk(root, _ignored(root)))


def _ignored(root: Path) -> list[str]:
    """.gitignore's patterns (this project's are names and `/`-anchored names, no negation)."""
    path = root / ".gitignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [".git/", *(s for line in lines if (s := line.strip()) and not s.startswith("#"))]


def _matches(rel: str, is_dir: bool, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for p in patterns:
        if p.endswith("/") and not is_dir:
            continue
        p = p.rstrip("/")
        if p.startswith("/"):
            if fnmatch.fnmatchcase(rel, p[1:]):
                return True
        elif fnmatch.fnmatchcase(name, p) or ("/" in p and fnmatch.fnmatchcase(rel, p)):
            return True
    return False


def _self_ignored(folder: Path) -> bool:
    """A cache folder that ignores itself (its own .gitignore says `*`: pytest's, ruff's)."""
    try:
        return "*" in (folder / ".gitignore").read_text().split()
    except OSError:
        return False


def _walk(root: Path, patterns: list[str]) -> list[str]:
    out: list[str] = []
    for top, dirs, names in os.walk(root):
        base = Path(top).relative_to(root).as_posix()
        rel = "" if base == "." else base + "/"
        keep = [d for d in dirs if not _matches(rel + d, True, patterns)]
        dirs[:] = [d for d in keep if not _self_ignored(Path(top, d))]
        out += [rel + n for n in names if not _matches(rel + n, False, patterns)]
    return out
