"""The architecture holds as the code's own imports draw it: the wings' layers and no circles
(both checked by `make lint`, shown here to fail on a wrong import), kimi-mode loading none of
the daemon's wings, and no module past 400 lines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kimi_supervisor"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports with the project's contracts over the package copied under `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(PACKAGE, tmp_path / "kimi_supervisor", ignore=skip)
    return tmp_path


def plant(tree: Path, module: str, line: str) -> None:
    path = tree / "kimi_supervisor" / module
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_import_contracts_hold_on_the_package_as_it_is(copy: Path) -> None:
    r = lint_imports(copy)
    assert r.returncode == 0, r.stdout + r.stderr
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert f"{len(contracts['contracts'])} kept, 0 broken" in r.stdout


@pytest.mark.parametrize(
    ("module", "line", "said"),
    [
        pytest.param(
            "decide/policy.py",
            "from kimi_supervisor.loop import daemon",
            "kimi_supervisor.decide.policy -> kimi_supervisor.loop.daemon",
            id="a pure decision importing the loop breaks the layers",
        ),
        pytest.param(
            "loop/observer.py",
            "from kimi_supervisor.sandbox import simreader",
            "kimi_supervisor.loop.observer -> kimi_supervisor.sandbox.simreader",
            id="the loop importing the sandbox breaks the layers",
        ),
        pytest.param(
            "loop/boot.py",
            "from kimi_supervisor.loop import daemon",
            "No cycles are allowed in kimi_supervisor.loop",
            id="a circle inside a wing breaks the acyclic contract",
        ),
    ],
)
def test_a_planted_wrong_import_fails_lint_and_names_itself(
    copy: Path, module: str, line: str, said: str
) -> None:
    plant(copy, module, f"{line}  # noqa")
    r = lint_imports(copy)
    assert r.returncode != 0
    assert said in r.stdout


def test_a_new_module_outside_every_layer_breaks_the_contract_the_day_it_is_added(
    copy: Path,
) -> None:
    (copy / "kimi_supervisor" / "helpers.py").write_text("X = 1\n")
    r = lint_imports(copy)
    assert r.returncode != 0
    assert "kimi_supervisor.helpers" in r.stdout


def test_kimi_mode_status_loads_the_client_and_plain_data_and_none_of_the_daemons_wings(
    tmp_path: Path,
) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "kimi_supervisor.cli.kimi_mode",
            "status",
            "--socket",
            str(tmp_path / "none.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 3, r.stderr[-2000:]  # unreachable, said so
    loaded = {
        line.rsplit("|", 1)[-1].strip()
        for line in r.stderr.splitlines()
        if line.startswith("import time:")
    }
    ours = {m for m in loaded if m.startswith("kimi_supervisor")}
    assert "kimi_supervisor.control.client" in ours
    wings = ("loop", "decide", "teardown", "store", "capture", "analysis", "ports", "sandbox")
    daemons = {m for m in ours if m.split(".")[1:2] and m.split(".")[1] in wings}
    assert daemons == set()


def test_no_module_of_the_package_is_past_400_lines() -> None:
    big = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert big == {}
