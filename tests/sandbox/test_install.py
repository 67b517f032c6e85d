"""`make install` as an operator runs it, staged with DESTDIR: the virtualenv, the commands, the
units, sysusers.d and tmpfiles.d, the config and the docs, and a second install (an upgrade)
that keeps the operator's config."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/opt/kimi-supervisor"


def _install(dest: Path) -> subprocess.CompletedProcess[str]:
    python = shutil.which("python3") or sys.executable
    return subprocess.run(
        ["sh", "scripts/install.sh", str(dest), PREFIX, "/usr/local/bin", "/etc/systemd/system",
         "/etc", python],
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
        "etc/systemd/system/kimi-supervisor.service",
        "etc/systemd/system/vllm-kimi-k25.service",
        "usr/lib/sysusers.d/kimi-supervisor.conf",
        "usr/lib/tmpfiles.d/kimi-supervisor.conf",
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
    assert r.returncode == 0, r.stderr
    assert "g kimi" in (staged / "usr/lib/sysusers.d/kimi-supervisor.conf").read_text()


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


def test_the_man_pages_are_installed_render_cleanly_and_name_every_command(staged: Path) -> None:
    import argparse

    from kimi_supervisor.cli import admin as cli
    from kimi_supervisor.cli import kimi_mode

    for page, parser in (
        ("man1/kimi-mode.1.gz", kimi_mode.build_parser()),
        ("man8/kimi-supervisor.8.gz", cli.build_parser()),
    ):
        path = staged / "usr/local/share/man" / page
        assert path.is_file(), page
        if shutil.which("man"):
            r = subprocess.run(
                ["man", "--warnings", "-l", str(path)],
                capture_output=True, text=True, env={"MANWIDTH": "100", "PATH": "/usr/bin:/bin"},
            )  # fmt: skip
            assert r.returncode == 0 and not r.stderr.strip(), r.stderr
            text = r.stdout
        else:
            import gzip

            text = gzip.decompress(path.read_bytes()).decode().replace("\\-", "-")
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, sub in subs.choices.items():
            assert f"{parser.prog} {name}" in text, name
            for action in sub._actions:
                for flag in action.option_strings:
                    assert flag in text, f"{name} {flag}"
        assert "EXIT STATUS" in text and "/etc/kimi-supervisor/kimi-supervisor.toml" in text


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
