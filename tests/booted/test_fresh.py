"""The README's two commands on a freshly debootstrapped Debian 12 (`debootstrap bookworm`, no
package added), as root, from a checkout in root's 0700 home: `./dev demo`, then `./dev test`.
They run as a service of the booted host's systemd (Delegate=yes: the demo's user manager makes
cgroups below it), as an operator's root shell would run them in its session."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .host import BootedHost, Unavailable, network, rootfs, unavailable

pytestmark = pytest.mark.booted

CHECKOUT = "/root/kimi-supervisor"
# The whole suite already runs on this machine; inside, the test command runs its lint and
# type checks and a sample of tests that need what the set-up installed: a systemd user manager
# and its bus, another user reaching the checkout in the 0700 home, systemd-analyze, tmux (the
# live display at two widths), promtool (the alert rules) and the package's build tools
# (the .deb built there, and lintian on it).
SAMPLE = (
    "-m 'not booted' -k 'outside_the_control_group or passes_systemd_analyze_verify or "
    "in_a_real_terminal or promtool or ansible_lint or rolling_capture_visits or lintian'"
)


@pytest.fixture(scope="module")
def fresh() -> Iterator[tuple[BootedHost, dict[str, str]]]:
    why = unavailable()
    if why:
        pytest.skip(f"no booted host: {why}")
    work = Path(tempfile.mkdtemp(prefix="kimi-fresh-"))
    h: BootedHost | None = None
    try:
        try:
            base = rootfs(None)
            h = BootedHost(work, base)
            subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(h.root)], check=True)
            h.copy_checkout(CHECKOUT)
            h.binds, env = network()
            h.boot()
        except Unavailable as e:
            pytest.skip(f"no booted host: {e}")
        yield h, env
    finally:
        if h is not None:
            h.poweroff()
        shutil.rmtree(work, ignore_errors=True)


def as_root(h: BootedHost, env: dict[str, str], cmd: str, timeout: float) -> str:
    """`cmd` as a transient service, its output and exit status kept in files: a fresh host
    has no D-Bus, so systemd-run cannot --wait (it talks to PID 1 on its private socket)."""
    setenv = " ".join(f"-E {k}={v}" for k, v in env.items())
    h.sh("rm -f /root/out.log /root/out.rc")
    h.sh(
        f"systemd-run --quiet --collect -p Delegate=yes {setenv} --working-directory={CHECKOUT} "
        f"sh -c {shlex.quote('{ ' + cmd + '; } >/root/out.log 2>&1; echo $? >/root/out.rc')}"
    )
    deadline = time.monotonic() + timeout
    while h.sh("test -s /root/out.rc", check=False).returncode != 0:
        assert time.monotonic() < deadline, h.sh("tail -40 /root/out.log").stdout
        time.sleep(1)
    rc, out = h.sh("cat /root/out.rc").stdout.strip(), h.sh("cat /root/out.log").stdout
    assert rc == "0", f"`{cmd}` exited {rc}:\n{out[-4000:]}"
    return out


def test_a_fresh_debian_12_lacks_what_the_set_up_installs(
    fresh: tuple[BootedHost, dict[str, str]],
) -> None:
    h, _ = fresh
    assert h.sh("stat -c %a /root").stdout.strip() == "700"
    for tool in ("command -v make", "test -e /usr/lib/systemd/user/dbus.socket",
                 "command -v tmux", "command -v promtool", "command -v dh"):  # fmt: skip
        assert h.sh(tool, check=False).returncode != 0, f"the set-up must bring it: {tool}"


def test_the_readmes_demo_command_sets_up_the_machine_and_runs_the_demo(
    fresh: tuple[BootedHost, dict[str, str]],
) -> None:
    h, env = fresh
    out = as_root(h, env, "./dev demo", 1200)
    assert "setup: installing" in out
    assert "ghost" in out and "CLEAN" in out, out[-3000:]


def test_the_readmes_test_command_then_passes_there(
    fresh: tuple[BootedHost, dict[str, str]],
) -> None:
    h, env = fresh
    out = as_root(h, env, f'PYTEST_ADDOPTS="{SAMPLE}" ./dev test', 1200)
    assert "All checks passed" in out  # ruff
    # The sample's size grows with the suite (13 on 2026-12-07, in two sessions: the unit tier's
    # terminal tests, then the rest): at least the 8 it began with, and none failed.
    passed = sum(int(n) for n in re.findall(r"\b(\d+) passed", out))
    assert passed >= 8, out[-3000:]
    assert not re.search(r"\b\d+ (failed|errors?)\b", out), out[-3000:]
