"""The architecture holds as the code's own imports draw it: the wings' layers and no circles
(both checked by `make lint`, shown here to fail on a wrong import), and kimi-mode loading none of
the daemon's wings.

lint-imports runs once, over the package as it is and over copies of it, each with one wrong
import planted and named for it: each copy's contracts are the project's, on the copy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kimi_supervisor"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS: list[dict[str, Any]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
    "importlinter"
]["contracts"]

# The copies, by name: the module and the line planted in it (None: a new module, helpers.py).
PLANTED = {
    "decide_imports_loop": ("decide/policy.py", "from kimi_supervisor.loop import daemon"),
    "loop_imports_sandbox": ("loop/observer.py", "from kimi_supervisor.sandbox import simreader"),
    "loop_circle": ("loop/boot.py", "from kimi_supervisor.loop import daemon"),
    "loop_upward": ("loop/jobs.py", "from kimi_supervisor.loop import admission"),
    "analysis_imports_capture": (
        "analysis/compare.py",
        "from kimi_supervisor.capture import retention",
    ),
    "new_module": None,
}


def named(value: Any, package: str) -> Any:
    """`value` (a contract's string, list or flag) with the package called `package`."""
    if isinstance(value, str):
        return re.sub(r"\bkimi_supervisor\b", package, value)
    if isinstance(value, list):
        return [named(v, package) for v in value]
    return value


@dataclass(frozen=True)
class Report:
    out: str

    def verdicts(self, package: str) -> list[str]:
        """KEPT or BROKEN, for each contract on `package`."""
        return re.findall(rf"^{package}: .* (KEPT|BROKEN)$", self.out, re.MULTILINE)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    """lint-imports over the package and the copies, with the project's contracts on each."""
    tree = tmp_path_factory.mktemp("layers")
    for package, plant in PLANTED.items():
        copy = tree / package
        shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
        for path in copy.rglob("*.py"):
            path.write_text(named(path.read_text(), package))
        if plant is None:
            (copy / "helpers.py").write_text("X = 1\n")
        else:
            module, line = plant
            with open(copy / module, "a") as f:
                f.write(f"\n{named(line, package)}  # noqa\n")
    packages = ["kimi_supervisor", *PLANTED]
    toml = [f"[tool.importlinter]\nroot_packages = {json.dumps(packages)}"]
    for package in packages:
        for contract in CONTRACTS:
            c = {k: named(v, package) for k, v in contract.items()}
            c["name"] = f"{package}: {contract['name']}"
            toml.append("[[tool.importlinter.contracts]]")
            toml += [f"{k} = {json.dumps(v)}" for k, v in c.items()]
    config = tree / "importlinter.toml"
    config.write_text("\n".join(toml) + "\n")
    # The package itself from this checkout; COLUMNS: one line per contract's verdict.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]), COLUMNS="1000")
    r = subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return Report(r.stdout + r.stderr)


def test_the_import_contracts_hold_on_the_package_as_it_is(report: Report) -> None:
    assert report.verdicts("kimi_supervisor") == ["KEPT"] * len(CONTRACTS), report.out


@pytest.mark.parametrize(
    ("package", "said"),
    [
        pytest.param(
            "decide_imports_loop",
            "kimi_supervisor.decide.policy -> kimi_supervisor.loop.daemon",
            id="a pure decision importing the loop breaks the layers",
        ),
        pytest.param(
            "loop_imports_sandbox",
            "kimi_supervisor.loop.observer -> kimi_supervisor.sandbox.simreader",
            id="the loop importing the sandbox breaks the layers",
        ),
        pytest.param(
            "loop_upward",
            "kimi_supervisor.loop.jobs -> kimi_supervisor.loop.admission",
            id="a floor of the loop importing one above it breaks the loop's floors",
        ),
        pytest.param(
            "analysis_imports_capture",
            "kimi_supervisor.analysis.compare -> kimi_supervisor.capture.retention",
            id="the trace analysis importing the daemon's capture job breaks its contract",
        ),
        pytest.param(
            "loop_circle",
            "No cycles are allowed in kimi_supervisor.loop",
            id="a circle inside a wing breaks the acyclic contract",
        ),
    ],
)
def test_a_planted_wrong_import_fails_lint_and_names_itself(
    report: Report, package: str, said: str
) -> None:
    assert "BROKEN" in report.verdicts(package), report.out
    assert named(said, package) in report.out


def test_a_new_module_outside_every_layer_breaks_the_contract_the_day_it_is_added(
    report: Report,
) -> None:
    assert "BROKEN" in report.verdicts("new_module"), report.out
    assert "new_module.helpers" in report.out


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
        timeout=300,
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
