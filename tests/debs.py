"""The Debian package for the tests: built once per session from this checkout
(scripts/build-deb.sh), and later builds made from it for the upgrade tests.

A later build is the first one repacked (dpkg-deb -R, then -b) under a higher version: its
virtualenv moves to the new version's directory, `current` points there, and `edit` may change
the tree (a note in the README, a new default config, or a module broken on purpose). Building
from source again would take a minute more per version for the same files."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = "usr/lib/kimi-supervisor"


def unavailable() -> str | None:
    for tool in ("dpkg-buildpackage", "dh", "fakeroot", "dpkg-deb"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (sh scripts/setup-system.sh --package)"
    if not Path("/usr/bin/python3").exists():
        return "no /usr/bin/python3 (the package is built for Debian's own Python)"
    return None


def build(out: Path) -> Path:
    """The package of this checkout, in `out`."""
    r = subprocess.run(
        ["sh", "scripts/build-deb.sh", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    if r.returncode != 0:
        raise AssertionError(f"build-deb.sh exited {r.returncode}:\n{r.stdout}{r.stderr}")
    return Path(r.stdout.split()[-1])


def field(deb: Path, name: str) -> str:
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True
    ).stdout.strip()


def repack(deb: Path, version: str, out: Path, edit: Callable[[Path], None] | None = None) -> Path:
    """`deb` as version `version`, in `out`, after `edit(tree)`."""
    old = field(deb, "Version")
    tree = out / f"tree-{version}"
    shutil.rmtree(tree, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True)
    (tree / LIB / old).rename(tree / LIB / version)
    (tree / LIB / "current").unlink()
    (tree / LIB / "current").symlink_to(version)
    if edit is not None:
        edit(tree)
    control = tree / "DEBIAN/control"
    control.write_text(control.read_text().replace(f"Version: {old}\n", f"Version: {version}\n"))
    conffiles_path = tree / "DEBIAN/conffiles"
    conffiles = set(conffiles_path.read_text().split()) if conffiles_path.exists() else set()
    sums = []  # as dh_md5sums writes them: every plain file but the conffiles
    for path in sorted(tree.rglob("*")):
        rel = path.relative_to(tree)
        if rel.parts[0] == "DEBIAN" or path.is_symlink() or not path.is_file():
            continue
        if f"/{rel}" in conffiles:
            continue
        sums.append(f"{hashlib.md5(path.read_bytes()).hexdigest()}  {rel}\n")
    (tree / "DEBIAN/md5sums").write_text("".join(sums))
    dest = out / f"kimi-supervisor_{version}_{field(deb, 'Architecture')}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zxz", "-b", str(tree), str(dest)],
        check=True, capture_output=True,
    )  # fmt: skip
    shutil.rmtree(tree)
    return dest


def site_packages(tree: Path, version: str) -> Path:
    return next((tree / LIB / version / "lib").glob("python3*/site-packages"))


def break_module(tree: Path, version: str, module: str) -> None:
    """A build whose `module` (kimi_supervisor/...) fails to import: its source raises and its
    byte code is gone (the shipped .pyc are unchecked: they would be used instead)."""
    src = site_packages(tree, version) / f"{module}.py"
    src.write_text('raise ImportError("a broken build, made by the test")\n')
    for pyc in (src.parent / "__pycache__").glob(f"{src.stem}.*.pyc"):
        pyc.unlink()
