"""`make install` (the development install) staged with DESTDIR: the virtualenv from the locks,
the commands, the units under /usr/local with their paths pointed there, sysusers.d and
tmpfiles.d, the config and the docs; a second install (an upgrade) that keeps the operator's
config; and `make uninstall`, which removes all of it but the config."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/opt/kimi-supervisor"


UNITDIR = "/usr/local/lib/systemd/system"
DIRS = [PREFIX, "/usr/local/bin", UNITDIR, "/etc", "/usr/local/share/man"]


def _install(dest: Path) -> subprocess.CompletedProcess[str]:
    d = DIRS
    return subprocess.run(
        ["sh", "scripts/install.sh", str(dest), *d[:4], "/usr/bin/python3", d[4]],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip


@pytest.fixture(scope="module")
def staged() -> Iterator[Path]:
    dest = Path(tempfile.mkdtemp(prefix="kimi-install-"))
    try:
        r = _install(dest)
        assert r.returncode == 0, r.stdout + r.stderr
        yield dest
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def test_make_install_stages_the_package_commands_units_and_config(staged: Path) -> None:
    from kimi_supervisor.version import package_version

    for path in (
        "usr/local/lib/systemd/system/kimi-supervisor.service",
        "usr/local/lib/systemd/system/vllm-kimi-k25.service",
        "usr/local/lib/sysusers.d/kimi-supervisor.conf",
        "usr/local/lib/tmpfiles.d/kimi-supervisor.conf",
        "etc/kimi-supervisor/kimi-supervisor.toml",
        "opt/kimi-supervisor/docs/operations.md",  # the units' Documentation=
    ):
        assert (staged / path).is_file(), path
    for cmd in ("kimi-supervisor", "kimi-mode"):
        link = staged / "usr/local/bin" / cmd
        assert link.is_symlink() and str(link.readlink()) == f"{PREFIX}/bin/{cmd}"
        script = staged / PREFIX.lstrip("/") / "bin" / cmd
        assert script.read_text().splitlines()[0].startswith(f"#!{PREFIX}/bin/python")
    venv_python = staged / PREFIX.lstrip("/") / "bin" / "python3"
    r = subprocess.run(
        [str(venv_python), "-m", "kimi_supervisor.cli.admin", "--version"],
        capture_output=True,
        text=True,
    )
    assert r.stdout.strip() == f"kimi-supervisor {package_version()}", r.stderr
    r = subprocess.run(
        [str(venv_python), "-m", "kimi_supervisor.cli.admin", "check-config",
         str(staged / "etc/kimi-supervisor/kimi-supervisor.toml")],
        capture_output=True, text=True,
    )  # fmt: skip
    # Valid; of this host's checks only what a stage cannot have fails: no vLLM was installed,
    # and the group comes with sysusers at a real install.
    assert r.returncode == 1 and "# FAIL vllm executable" in r.stdout, r.stdout + r.stderr
    failed = {line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("# FAIL")}
    assert failed <= {"# FAIL vllm executable", "# FAIL control group"}, r.stdout
    assert "g kimi" in (staged / "usr/local/lib/sysusers.d/kimi-supervisor.conf").read_text()
    # The units name the commands and the docs where this install put them.
    unit = (staged / UNITDIR.lstrip("/") / "kimi-supervisor.service").read_text()
    assert "ExecStart=/usr/local/bin/kimi-supervisor run" in unit
    assert f"file://{PREFIX}/docs/operations.md" in unit and "/usr/bin/" not in unit


def test_make_install_creates_vllms_own_user_and_its_unit_runs_vllm_as_that_user(
    staged: Path,
) -> None:
    users = (staged / "usr/local/lib/sysusers.d/kimi-supervisor.conf").read_text().splitlines()
    assert 'u kimi-vllm - "vLLM, run by kimi-supervisor" /var/lib/kimi-vllm' in users
    unit = (staged / UNITDIR.lstrip("/") / "vllm-kimi-k25.service").read_text().splitlines()
    assert {"User=kimi-vllm", "Group=kimi-vllm", "SupplementaryGroups=video"} <= set(unit)
    # The launch record is written as root, by this install's command.
    assert (
        "ExecStartPost=-+/usr/local/bin/kimi-supervisor launch-record "
        "--argv-file %t/kimi-supervisor/vllm-argv.json --pid $MAINPID"
    ) in unit
    tmpfiles = (staged / "usr/local/lib/tmpfiles.d/kimi-supervisor.conf").read_text()
    assert "d /var/lib/kimi-supervisor 0751 root root -" in tmpfiles.splitlines()


def test_an_upgrade_keeps_the_operators_config_and_ships_the_new_one_beside_it(
    staged: Path,
) -> None:
    conf = staged / "etc/kimi-supervisor/kimi-supervisor.toml"
    conf.write_text(conf.read_text() + "\n# the operator's edit\n")
    r = _install(staged)
    assert r.returncode == 0, r.stdout + r.stderr
    assert conf.read_text().endswith("# the operator's edit\n")
    assert (conf.parent / "kimi-supervisor.toml.dist").is_file()
    assert "kept your" in r.stdout


def rendered(path: Path) -> str:
    """A man page as `man` shows it, checked to render with no warning (roff's text when
    there is no `man`)."""
    assert path.is_file(), path
    if not shutil.which("man"):
        import gzip

        return gzip.decompress(path.read_bytes()).decode().replace("\\-", "-")
    r = subprocess.run(
        ["man", "--warnings", "-l", str(path)],
        capture_output=True, text=True, env={"MANWIDTH": "100", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    return r.stdout


def test_the_man_pages_are_installed_render_cleanly_and_name_every_command(staged: Path) -> None:
    import argparse

    from kimi_supervisor.cli import admin, kimi_mode

    for page, parser in (
        ("man1/kimi-mode.1.gz", kimi_mode.build_parser()),
        ("man8/kimi-supervisor.8.gz", admin.build_parser()),
    ):
        text = rendered(staged / "usr/local/share/man" / page)
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, sub in subs.choices.items():
            assert f"{parser.prog} {name}" in text, name
            for action in sub._actions:
                for flag in action.option_strings:
                    assert flag in text, f"{name} {flag}"
        assert "EXIT STATUS" in text and "/etc/kimi-supervisor/kimi-supervisor.toml" in text
        assert "EXAMPLES" in text and "kimi-supervisor.toml(5)" in text
    text = rendered(staged / "usr/local/share/man/man5/kimi-supervisor.toml.5.gz")
    assert "term_grace_s = 30.0" in text and "EXAMPLES" in text


def complete(script: Path, line: str) -> list[str]:
    """What bash offers after `line` (ending in the word being completed) with `script`."""
    words = line.split(" ")
    program = (
        f"source {script}\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        f"_{words[0].replace('-', '_')}\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    r = subprocess.run(["bash", "--norc", "-c", program], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_bash_completes_the_commands_options_and_choices_both_programs_take(
    staged: Path,
) -> None:
    share = staged / "usr/local/share"
    mode = share / "bash-completion/completions/kimi-mode"
    sup = share / "bash-completion/completions/kimi-supervisor"
    assert complete(mode, "kimi-mode is-") == ["is-serving"]
    assert complete(mode, "kimi-mode is-serving p") == ["production", "profile"]
    assert sorted(complete(mode, "kimi-mode capture --s")) == [
        "--seconds", "--socket", "--summarize", "--switch"]  # fmt: skip
    assert complete(mode, "kimi-mode capture --then ") == ["production", "stay"]
    assert str(share) in complete(mode, f"kimi-mode capture --summarize {share}")
    assert complete(sup, "kimi-supervisor sandbox up --g") == ["--gpus"]
    assert complete(sup, "kimi-supervisor sandbox d") == ["down"]
    zsh = (share / "zsh/site-functions/_kimi-mode").read_text()
    assert (staged / "opt/kimi-supervisor/config/grafana/kimi-supervisor.json").is_file()
    assert (staged / "opt/kimi-supervisor/config/prometheus/kimi-supervisor-alerts.yml").is_file()
    assert (staged / "opt/kimi-supervisor/config/prometheus/kimi-supervisor-fleet.yml").is_file()
    assert zsh.startswith("#compdef kimi-mode\n") and "bashcompinit" in zsh


def test_make_uninstall_removes_everything_it_installed_but_the_config(staged: Path) -> None:
    """Runs last: it undoes the staged install. What is left is the config directory alone (and a
    command of the same name that `make install` did not make)."""
    foreign = staged / "usr/local/bin/kimi-mode-helper"
    foreign.write_text("#!/bin/sh\n")  # planted: not ours, it must stay
    r = subprocess.run(
        ["sh", "scripts/uninstall.sh", str(staged), *DIRS],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    left = sorted(
        str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file() or p.is_symlink()
    )
    assert left == [
        "etc/kimi-supervisor/kimi-supervisor.toml",
        "etc/kimi-supervisor/kimi-supervisor.toml.dist",
        "usr/local/bin/kimi-mode-helper",
    ], left
    assert "Kept:" in r.stdout
