"""kimi-mode's output contract: one JSON Schema for every line `-o json` prints, kept in
docs/ as the code makes it; one exit code per meaning, stated once (cli/exits.py) and said the
same in --help, the man pages, docs/, the ansible module and the unit; the global options before
or after the command."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from kimi_supervisor.cli import admin, exits, kimi_mode, manpage, output
from kimi_supervisor.cli.exits import Exit

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "docs" / "kimi-mode-output.schema.json"


def test_the_documented_schema_is_the_one_the_code_makes() -> None:
    assert json.loads(SCHEMA.read_text()) == output.schema(), (
        "regenerate it: python -m kimi_supervisor.cli.output > docs/kimi-mode-output.schema.json"
    )


def test_every_exit_code_has_one_meaning_and_the_man_page_and_help_say_them_all() -> None:
    codes = [int(c) for c in exits.KIMI_MODE]
    assert len(codes) == len(set(codes)) == 9
    names = [c.label for c in exits.KIMI_MODE]
    assert names == [
        "ok", "failed", "usage", "unreachable", "timeout", "refused", "stuck", "interrupted",
        "output_closed",
    ]  # fmt: skip
    helptext = kimi_mode.build_parser().format_help()
    for code in exits.KIMI_MODE:
        assert f"{code:>3}  {code.label}:" in helptext
    kimi_mode_page, supervisor_page = (manpage.render(p) for p in manpage.pages())
    for code in exits.KIMI_MODE:
        assert f".TP\n\\fB{code}\\fR\n{code.label}: " in kimi_mode_page
    for code in exits.KIMI_SUPERVISOR:
        assert f".TP\n\\fB{code}\\fR\n" in supervisor_page
        assert f"{code} {exits.KIMI_SUPERVISOR[code]}" in " ".join(
            admin.build_parser().format_help().split()
        )


def test_no_exit_code_changes_its_value_and_each_is_meant_for_kimi_mode() -> None:
    # Scripts, playbooks and the unit act on the numbers.
    assert {c.label: int(c) for c in Exit} == {
        "ok": 0, "failed": 1, "usage": 2, "unreachable": 3, "timeout": 4, "refused": 5,
        "stuck": 6, "interrupted": 130, "output_closed": 141,
    }  # fmt: skip
    assert list(exits.KIMI_MODE) == list(Exit)
    assert set(exits.KIMI_SUPERVISOR) == {Exit.OK, Exit.FAILED, Exit.USAGE}


def test_the_documented_table_of_exit_codes_is_the_codes_own() -> None:
    tables = [
        re.findall(r"^\| (\d+) \| (\w+) \| ", text.split("| code | name | meaning |", 1)[1], re.M)
        for doc in sorted((ROOT / "docs").glob("*.md"))
        if "| code | name | meaning |" in (text := doc.read_text())
    ]
    assert len(tables) == 1, "docs/ has one table of kimi-mode's exit codes"
    assert [(int(c), name) for c, name in tables[0]] == [(int(c), c.label) for c in Exit]


def test_the_ansible_module_and_the_unit_read_the_codes_as_the_cli_states_them() -> None:
    module = ROOT / "ansible/ansible_collections/kimi/supervisor/plugins/modules/kimi_mode.py"
    meaning = next(
        ast.literal_eval(node.value)
        for node in ast.parse(module.read_text()).body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "EXIT_MEANING" for t in node.targets)
    )
    assert set(meaning) == {int(c) for c in Exit} - {Exit.OK}
    says = {Exit.TIMEOUT: "timed out", Exit.OUTPUT_CLOSED: "output closed"}
    for code in set(Exit) - {Exit.OK}:
        assert says.get(code, code.label) in meaning[code].lower(), code
    unit = (ROOT / "units" / "kimi-supervisor.service").read_text()
    (prevent,) = re.findall(r"^RestartPreventExitStatus=(.+)$", unit, re.M)
    assert [int(x) for x in prevent.split()] == [Exit.USAGE]
    assert "the unit does not restart on it" in exits.KIMI_SUPERVISOR[Exit.USAGE]


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [
        ("busy", Exit.REFUSED),
        ("wrong_mode", Exit.REFUSED),
        ("stopping", Exit.REFUSED),
        ("forbidden", Exit.UNREACHABLE),
        ("bad_request", Exit.USAGE),
        ("internal", Exit.FAILED),
        ("state_error", Exit.FAILED),
    ],
)
def test_a_refusal_exits_with_what_it_means_to_the_caller(code: str, exit_code: int) -> None:
    assert exits.refusal_exit(code) == exit_code


def test_a_switch_that_ends_stuck_exits_6_and_a_failed_one_1() -> None:
    assert exits.end_exit({"ok": True, "outcome": "ready"}) == 0
    assert exits.end_exit({"ok": False, "outcome": "stuck"}) == Exit.STUCK == 6
    assert exits.end_exit({"ok": False, "outcome": "failed"}) == Exit.FAILED


@pytest.mark.parametrize(
    "argv",
    [
        ["-o", "json", "status"],
        ["status", "-o", "json"],
        ["--json", "status"],
        ["status", "--json"],
        ["--output=json", "history", "-n", "3"],
        ["-o", "text", "status", "--json"],  # the last one given wins
    ],
)
def test_the_output_option_works_before_or_after_the_command(argv: list[str]) -> None:
    assert kimi_mode.build_parser().parse_args(argv).output == "json"


def test_without_an_output_option_text_is_the_default_and_a_later_one_is_not_hidden() -> None:
    p = kimi_mode.build_parser()
    assert p.parse_args(["status"]).output == "text"
    assert p.parse_args(["--json", "status"]).output == "json"  # not reset by the command's
    assert p.parse_args(["--socket", "/x", "status"]).socket == "/x"


def test_every_command_has_a_description_and_examples() -> None:
    from kimi_supervisor.cli.completion import _subparsers

    for name, sub in _subparsers(kimi_mode.build_parser()).items():
        assert sub.description and len(sub.description) > 40, name
        assert sub.epilog and sub.epilog.startswith("examples:\n  kimi-mode "), name
        for line in sub.format_help().splitlines():
            assert len(line) <= 80, (name, line)


@pytest.mark.parametrize(
    "argv, said",
    [
        (["prod"], "'prod': did you mean production?"),
        (["pro"], "'pro': did you mean production or profile?"),
        (["stauts"], "'stauts': did you mean status?"),
        (["wait", "prodcution"], "'prodcution': did you mean production?"),
        (["capture", "--then", "stya"], "'stya': did you mean stay?"),
        (["turbo"], "'turbo' is not one of production, profile, capture"),
    ],
)
def test_a_near_miss_says_what_was_meant(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kimi_mode.main(argv) == Exit.USAGE
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, command",
    [
        (["history", "-n", "0"], "history"),
        (["status", "--interval", "0"], "status"),
        (["wait", "--timeout", "x"], "wait"),
        (["logs", "-n", "-3"], "logs"),
    ],
)
def test_a_commands_own_error_shows_that_commands_usage(
    argv: list[str], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kimi_mode.main(argv) == Exit.USAGE
    said = capsys.readouterr()
    assert said.out == ""
    assert said.err.startswith(f"usage: kimi-mode {command} "), said.err
    assert f"kimi-mode {command}: error: argument " in said.err


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["-o", "json", "prod"], id="-o json"),
        pytest.param(["wait", "--json", "--timeout", "x"], id="--json"),
        pytest.param(["--output=json", "history", "-n", "0"], id="--output=json"),
        pytest.param(["status", "-ojson", "--bogus"], id="-ojson"),
        pytest.param(["-o=json", "stauts"], id="-o=json, as argparse reads it too"),
        pytest.param(["--output", "json", "wait", "prodcution"], id="--output json"),
    ],
)
def test_in_json_mode_a_usage_error_is_one_json_error_line_and_nothing_else(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert kimi_mode.main(argv) == Exit.USAGE
    said = capsys.readouterr()
    (line,) = [json.loads(x) for x in said.out.splitlines()]
    assert line["type"] == "error" and line["exit"] == 2 and line["code"] == "usage", line
    assert said.err.startswith("kimi-mode: ") and "usage:" not in said.err


def test_every_option_of_both_programs_says_what_it_is_for() -> None:
    """`sandbox up --help` showed --dir and --gpus with no word about them."""
    import argparse

    from kimi_supervisor.cli import admin

    def parsers(p: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
        found = [(name, p)]
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    found += parsers(sp, f"{name} {sub}")
        return found

    bare = [
        f"{name} {'/'.join(a.option_strings) or a.dest}"
        for root, prog in ((admin.build_parser(), "kimi-supervisor"),
                           (kimi_mode.build_parser(), "kimi-mode"))
        for name, p in parsers(root, prog)
        for a in p._actions
        if not isinstance(a, argparse._SubParsersAction) and not a.help
    ]  # fmt: skip
    assert bare == [], bare
