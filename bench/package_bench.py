"""The Debian package's cost: its build time, its size, and the time of an install, an upgrade
(the daemon reloaded while vLLM serves) and a removal (a teardown) on a booted Debian 12 host
with no package index (tests/booted/host.py).

    .venv/bin/python -m bench.package_bench [--runs 1] [--write docs/performance.md]

Each run builds the package from this checkout (scripts/build-deb.sh), then boots one host and
times each apt command in it; the second version is the first repacked (tests/debs.py)."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import machine, main
from tests import debs
from tests.booted.host import APT, CONFIGURE, BootedHost, unavailable


def _timed(host: BootedHost, command: str) -> float:
    t0 = time.monotonic()
    host.sh(command, timeout=600)
    return time.monotonic() - t0


def _serving(host: BootedHost, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while host.sh("kimi-mode is-serving -q", check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the booted host did not serve")
        time.sleep(0.2)


def one_run(work: Path) -> dict[str, float]:
    t0 = time.monotonic()
    deb = debs.build(work)
    built = time.monotonic() - t0
    second = debs.repack(deb, "0.1.0-2", work)
    tree = work / "tree"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    venv = next((tree / "usr/lib/kimi-supervisor").glob("0*"))
    files = [p for p in venv.rglob("*") if p.is_file() and not p.is_symlink()]
    venv_bytes = sum(p.stat().st_size for p in files)
    out = {
        "build_s": built,
        "deb_mb": deb.stat().st_size / 1e6,
        "installed_mb": int(debs.field(deb, "Installed-Size")) / 1000,
        "venv_mb": venv_bytes / 1e6,
    }
    host = BootedHost(work / "host")
    (work / "host").mkdir()
    try:
        host.prepare(debs=(deb, second))
        host.boot()
        out["install_s"] = _timed(host, f"{APT} install /root/debs/{deb.name}")
        host.sh(" ".join(CONFIGURE))
        host.sh("systemctl start kimi-supervisor")
        _serving(host)
        vllm = host.sh("systemctl show -p MainPID --value vllm-kimi-k25").stdout
        out["upgrade_s"] = _timed(host, f"{APT} install /root/debs/{second.name}")
        _serving(host)
        assert host.sh("systemctl show -p MainPID --value vllm-kimi-k25").stdout == vllm
        out["remove_s"] = _timed(host, f"{APT} remove kimi-supervisor")
        out["purge_s"] = _timed(host, f"{APT} purge kimi-supervisor")
    finally:
        host.poweroff()
    return out


def run(runs: int) -> str:
    why = debs.unavailable() or unavailable()
    if why:
        raise SystemExit(f"package_bench: {why}")
    results = []
    for _ in range(runs):
        work = Path(tempfile.mkdtemp(prefix="kimi-package-bench-"))
        try:
            results.append(one_run(work))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in results)

    rows = [
        ("build (`make deb`: the virtualenv from the locks, pystemd compiled, dpkg-buildpackage)",
         f"{med('build_s'):.0f} s"),
        ("the .deb", f"{med('deb_mb'):.1f} MB"),
        ("installed (Installed-Size)", f"{med('installed_mb'):.1f} MB"),
        ("of which the virtualenv", f"{med('venv_mb'):.1f} MB"),
        ("`apt install` on a host with no index (the daemon enabled, not started)",
         f"{med('install_s'):.1f} s"),
        ("`apt install` of the next version while vLLM serves (the reload included)",
         f"{med('upgrade_s'):.1f} s"),
        ("`apt remove` (the daemon's teardown of vLLM included)", f"{med('remove_s'):.1f} s"),
        ("`apt purge`", f"{med('purge_s'):.1f} s"),
    ]  # fmt: skip
    body = f"Measured {machine()}, median of {runs} run(s) (`python -m bench.package_bench`).\n\n"
    body += "| what | figure |\n|---|---|\n"
    body += "".join(f"| {what} | {fig} |\n" for what, fig in rows)
    return body


if __name__ == "__main__":
    main("package_bench", run, runs=1)
