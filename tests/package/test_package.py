"""The Debian package as built (`make deb`): what it holds, what it depends on, where things go,
lintian, and the lock it is built from. Installing, upgrading and removing it on a booted host
are in tests/booted/."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests import checkout, debs

ROOT = Path(__file__).resolve().parents[2]


def contents(deb: Path) -> dict[str, str]:
    """Each path in the package (without the leading ./) and, for a symlink, its target."""
    out = subprocess.run(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True
    ).stdout
    listing = subprocess.run(
        ["tar", "-tv"], input=out, capture_output=True, check=True
    ).stdout.decode()
    paths = {}
    for line in listing.splitlines():
        name = line.split(None, 5)[5]
        target = ""
        if " -> " in name:
            name, target = name.split(" -> ", 1)
        paths[name.removeprefix("./").rstrip("/")] = target
    return paths


def member(deb: Path, path: str) -> str:
    out = subprocess.run(
        ["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True
    ).stdout
    return subprocess.run(
        ["tar", "-xO", f"./{path}"], input=out, capture_output=True, check=True
    ).stdout.decode()


def test_the_package_depends_on_what_the_daemon_runs_with_and_nothing_else(
    debian_package: Path,
) -> None:
    depends = {d.split()[0] for d in debs.field(debian_package, "Depends").split(", ")}
    py = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print('python%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    # libc6 and libgcc-s1 come from the compiled modules (dpkg-shlibdeps), libsystemd0 from
    # pystemd's; dbus and systemd are the daemon's way to systemd; the interpreter is named.
    assert depends == {"dbus", "systemd", py, "libc6", "libgcc-s1", "libsystemd0"}, depends
    assert not depends & {"gcc", "make", "python3-pip", "python3-venv", "prometheus"}


def test_the_package_puts_each_file_where_debian_puts_it(debian_package: Path) -> None:
    paths = contents(debian_package)
    version = debs.field(debian_package, "Version")
    lib = "usr/lib/kimi-supervisor"
    assert paths[f"{lib}/current"] == version
    for cmd in ("kimi-supervisor", "kimi-mode"):
        assert paths[f"usr/bin/{cmd}"] == f"../lib/kimi-supervisor/current/bin/{cmd}"
        assert member(debian_package, f"{lib}/{version}/bin/{cmd}").startswith(
            f"#!/{lib}/current/bin/python3\n"
        )
    for path in (
        "lib/systemd/system/kimi-supervisor.service",
        "lib/systemd/system/vllm-kimi-k25.service",
        "etc/kimi-supervisor/kimi-supervisor.toml",
        "usr/lib/sysusers.d/kimi-supervisor.conf",
        "usr/lib/tmpfiles.d/kimi-supervisor.conf",
        "usr/share/man/man1/kimi-mode.1.gz",
        "usr/share/man/man8/kimi-supervisor.8.gz",
        "usr/share/man/man5/kimi-supervisor.toml.5.gz",
        "usr/share/bash-completion/completions/kimi-mode",
        "usr/share/zsh/vendor-completions/_kimi-mode",
        "usr/share/doc/kimi-supervisor/operations.md",
        "usr/share/doc/kimi-supervisor/examples/prometheus/kimi-supervisor-alerts.yml",
    ):
        assert path in paths, path
    unit = member(debian_package, "lib/systemd/system/kimi-supervisor.service")
    assert "ExecStart=/usr/bin/kimi-supervisor run" in unit
    assert "Documentation=man:kimi-supervisor(8)" in unit
    # Nothing of the build tools, and nothing under /usr/local, /opt or /etc/systemd.
    assert not [p for p in paths if re.search(r"/(pip|setuptools|wheel|Cython)[-/]|/activate", p)]
    assert not [p for p in paths if p.startswith(("usr/local", "opt", "etc/systemd"))]


def test_only_the_configuration_is_a_conffile(debian_package: Path, tmp_path: Path) -> None:
    subprocess.run(["dpkg-deb", "-e", str(debian_package), str(tmp_path)], check=True)
    assert (tmp_path / "conffiles").read_text().split() == [
        "/etc/kimi-supervisor/kimi-supervisor.toml"
    ]


def test_nothing_in_the_package_names_the_machine_it_was_built_on(
    debian_package: Path, tmp_path: Path
) -> None:
    tree = tmp_path / "tree"
    subprocess.run(["dpkg-deb", "-x", str(debian_package), str(tree)], check=True)
    build_dir = str(debian_package.parent)
    named = subprocess.run(
        ["grep", "-rlF", "--", build_dir, str(tree)], capture_output=True, text=True
    ).stdout.split()
    assert named == [], named


def test_lintian_passes_with_each_override_explained(debian_package: Path) -> None:
    if shutil.which("lintian") is None:
        pytest.skip("lintian is not installed (sh scripts/setup-system.sh --package)")
    r = subprocess.run(
        ["lintian", "--fail-on", "error,warning", str(debian_package)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    overrides = (ROOT / "debian/kimi-supervisor.lintian-overrides").read_text().splitlines()
    reason = False  # each override (or group of them) comes after the comment that explains it
    for line in overrides:
        if line.startswith("#"):
            reason = True
        elif not line.strip():
            reason = False
        else:
            assert reason, f"no reason given for: {line}"


def _lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "packaging/lock" / name).read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^ ]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_the_lock_pins_every_dependency_of_pyproject_within_its_range_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _lock("requirements.lock")
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not in packaging/lock/requirements.lock"
        assert req.specifier.contains(pins[name]), f"{name}=={pins[name]} is not {req.specifier}"
    text = (ROOT / "packaging/lock/requirements.lock").read_text()
    blocks = re.split(r"\n(?=[a-z])", text)
    for block in blocks:
        if "==" in block:
            assert "--hash=sha256:" in block, block.splitlines()[0]


def test_an_upgrade_switches_current_only_after_every_file_of_the_new_version(
    debian_package: Path,
) -> None:
    """dpkg renames the unpacked files into place in the archive's order: `current` must come
    after every file of the version it points at, so that it never names a half-made tree."""
    order = list(contents(debian_package))
    version = debs.field(debian_package, "Version")
    lib = "usr/lib/kimi-supervisor"
    last_file = max(i for i, p in enumerate(order) if p.startswith(f"{lib}/{version}/"))
    assert order.index(f"{lib}/current") > last_file


def test_the_licence_is_apache_2_0_stated_the_same_everywhere_with_its_full_text() -> None:
    licence = (ROOT / "LICENSE").read_text()
    assert licence == Path("/usr/share/common-licenses/Apache-2.0").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pyproject["license"] == "Apache-2.0" and pyproject["license-files"] == ["LICENSE"]
    galaxy = (ROOT / "ansible/ansible_collections/kimi/supervisor/galaxy.yml").read_text()
    assert re.search(r"^license:\n  - Apache-2.0\n", galaxy, re.M), galaxy
    copyright_ = (ROOT / "debian/copyright").read_text()
    assert re.findall(r"^License: (\S+)", copyright_, re.M) == ["Apache-2.0", "Apache-2.0"]
    assert "/usr/share/common-licenses/Apache-2.0" in copyright_
    readme = (ROOT / "README.md").read_text()
    assert "Apache License 2.0" in readme and "GPL" not in galaxy + copyright_ + readme
    # The collection ships on its own (ansible-galaxy): with the licence's text, and every file
    # that states a licence states this one (the module's headers said GPL-3.0+).
    collection = ROOT / "ansible/ansible_collections/kimi/supervisor"
    assert (collection / "LICENSE").read_text() == licence
    tracked = checkout.files(ROOT)
    other = re.compile(r"General Public License|\bGPL-?\d|gpl-\d|\bMIT License|\bBSD-\d")
    files = [ROOT / f for f in tracked if f != "tests/package/test_package.py"]
    stated = [f for f in files if f.is_file() and other.search(f.read_text(errors="replace"))]
    assert stated == [], stated


def purge(root: Path, **env: str) -> str:
    """The package's postrm at `apt purge`, on a host whose file system is under `root`."""
    r = subprocess.run(
        ["sh", str(ROOT / "debian/kimi-supervisor.postrm"), "purge"],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "DPKG_ROOT": str(root),
                                             **env},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def host_with_captures(root: Path) -> Path:
    for d in (
        "etc/kimi-supervisor",
        "var/cache/kimi-supervisor",
        "var/lib/kimi-vllm",
        "run/kimi-supervisor",
        "var/lib/kimi-supervisor/captures/2026-12-03T10-00-00",
    ):
        (root / d).mkdir(parents=True)  # fmt: skip
    state = root / "var/lib/kimi-supervisor"
    (state / "state.json").write_text("{}")
    (state / "captures/2026-12-03T10-00-00/rank-0.pt.trace.json.gz").write_bytes(b"x" * 4096)
    return state


def test_purge_says_what_it_removes_and_keeps_the_captures_saying_how_to_remove_them(
    tmp_path: Path,
) -> None:
    state = host_with_captures(tmp_path)
    said = purge(tmp_path)
    assert "purge removes /etc/kimi-supervisor (the configuration)," in said
    assert "KEPT the captures in /var/lib/kimi-supervisor/captures" in said
    assert "KIMI_SUPERVISOR_PURGE_CAPTURES=yes" in said
    assert all(len(line) <= 80 for line in said.splitlines()), said
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["var/lib/kimi-supervisor/captures/2026-12-03T10-00-00/rank-0.pt.trace.json.gz"]
    for gone in (
        "etc/kimi-supervisor",
        "var/cache/kimi-supervisor",
        "var/lib/kimi-vllm",
        "run/kimi-supervisor",
    ):
        assert not (tmp_path / gone).exists(), gone  # fmt: skip
    assert not (state / "state.json").exists()


def test_purge_asked_to_removes_the_captures_and_says_so_and_a_linked_folder_is_not_followed(
    tmp_path: Path,
) -> None:
    state = host_with_captures(tmp_path)
    said = purge(tmp_path, KIMI_SUPERVISOR_PURGE_CAPTURES="yes")
    assert "removing the captures\n  in /var/lib/kimi-supervisor/captures" in said
    assert not state.exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "trace").write_text("x")
    state.mkdir(parents=True)
    (state / "captures").symlink_to(elsewhere)
    said = purge(tmp_path)
    assert "KEPT" not in said and not state.exists() and (elsewhere / "trace").exists()


BUNDLE = "var/lib/kimi-supervisor/incidents/incident-20261204T180123.620132Z-stuck.txt"
TRACE = "var/lib/kimi-supervisor/captures/2026-12-03T10-00-00/rank-0.pt.trace.json.gz"


@pytest.mark.parametrize(
    ("env", "kept", "said"),
    [
        pytest.param({}, [TRACE, BUNDLE],
                     ["KEPT the captures in /var/lib/kimi-supervisor/captures",
                      "KEPT the incident bundles in /var/lib/kimi-supervisor/incidents",
                      "KIMI_SUPERVISOR_PURGE_INCIDENTS=yes in its environment."],
                     id="nothing asked: both kept, and said"),
        pytest.param({"KIMI_SUPERVISOR_PURGE_CAPTURES": "yes"}, [BUNDLE],
                     ["removing the captures\n  in /var/lib/kimi-supervisor/captures",
                      "KEPT the incident bundles in /var/lib/kimi-supervisor/incidents"],
                     id="the captures asked for: the bundles still kept"),
        pytest.param({"KIMI_SUPERVISOR_PURGE_INCIDENTS": "yes"}, [TRACE],
                     ["KEPT the captures in /var/lib/kimi-supervisor/captures",
                      "removing the incident bundles\n  in /var/lib/kimi-supervisor/incidents"],
                     id="the bundles asked for: the captures still kept"),
        pytest.param({"KIMI_SUPERVISOR_PURGE_CAPTURES": "yes",
                      "KIMI_SUPERVISOR_PURGE_INCIDENTS": "yes"}, [],
                     ["removing the captures", "removing the incident bundles"],
                     id="both asked for: nothing left, each said"),
    ],
)  # fmt: skip
def test_purge_keeps_the_incident_bundles_as_it_keeps_the_captures_unless_asked(
    env: dict[str, str], kept: list[str], said: list[str], tmp_path: Path
) -> None:
    state = host_with_captures(tmp_path)
    (state / "incidents").mkdir(mode=0o700)
    (tmp_path / BUNDLE).write_text("trigger:   stuck\n")
    out = purge(tmp_path, **env)
    assert all(s in out for s in said), out
    assert all(len(line) <= 80 for line in out.splitlines()), out
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted(kept), left
    assert not (state / "state.json").exists()
    assert state.exists() == bool(kept)
