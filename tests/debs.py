"""The Debian package for the tests: built from this checkout (scripts/build-deb.sh) once per
tree on a machine (cached by the hash of what it is made from), and later builds made from it for
the upgrade tests.

A later build is the first one repacked (dpkg-deb -R, then -b) under a higher version: its
virtualenv moves to the new version's directory, `current` points there, and `edit` may change
the tree (a note in the README, a new default config, or a module broken on purpose). Building
from source again would take a minute more per version for the same files."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests import checkout

ROOT = Path(__file__).resolve().parents[1]
LIB = "usr/lib/kimi-supervisor"
# Builds kept by the hash of what they are made from; the booted hosts' root file systems are
# cached there too (tests/booted/host.py).
CACHE = Path("/var/cache/kimi-supervisor-tests")
BUILT_WITH = ("python3", "libsystemd-dev", "debhelper", "dpkg-dev", "gcc")


def unavailable() -> str | None:
    for tool in ("dpkg-buildpackage", "dh", "fakeroot", "dpkg-deb"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (sh scripts/setup-system.sh --package)"
    if not Path("/usr/bin/python3").exists():
        return "no /usr/bin/python3 (the package is built for Debian's own Python)"
    return None


def tree_key() -> str:
    """What a build of this checkout is made from: the files build-deb.sh takes (tracked and
    not ignored, as a clone has them), each name and content, and the versions of the build
    tools and of what pystemd is compiled against."""
    h = hashlib.sha256()
    for rel in checkout.files(ROOT):
        path, name = ROOT / rel, rel.encode()
        if path.is_file() and not path.is_symlink():
            h.update(name + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        elif path.is_symlink():
            h.update(name + b"\0->" + os.readlink(path).encode())
    tools = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package} ${Version}\n", *BUILT_WITH],
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    h.update(tools.encode())
    return h.hexdigest()[:16]


def build(out: Path) -> Path:
    """The package of this checkout, in `out`: built once per tree (tree_key) on this machine,
    and taken from CACHE after (the package's, booted and install tests of every later run)."""
    cached = CACHE / f"deb-{tree_key()}"
    debs = sorted(cached.glob("*.deb")) if cached.is_dir() else []
    if len(debs) == 1:
        shutil.copy2(debs[0], out / debs[0].name)
        return out / debs[0].name
    r = subprocess.run(
        ["sh", "scripts/build-deb.sh", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    if r.returncode != 0:
        raise AssertionError(f"build-deb.sh exited {r.returncode}:\n{r.stdout}{r.stderr}")
    deb = Path(r.stdout.split()[-1])
    with contextlib.suppress(OSError):  # no cache is a build next time, nothing worse
        tmp = CACHE / f".deb-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shutil.copy2(deb, tmp / deb.name)
        tmp.rename(cached)  # whole or not at all; a build beside this one may have won
    shutil.rmtree(CACHE / f".deb-{os.getpid()}", ignore_errors=True)
    return deb


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
