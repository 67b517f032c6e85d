"""kimi-mode's output contract: one JSON Schema for every line `-o json` prints, kept in
docs/ as the code makes it; one exit code per meaning; the global options before or after the
command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_supervisor.cli import kimi_mode, output

SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "kimi-mode-output.schema.json"


def test_the_documented_schema_is_the_one_the_code_makes() -> None:
    assert json.loads(SCHEMA.read_text()) == output.schema(), (
        "regenerate it: python -m kimi_supervisor.cli.output > docs/kimi-mode-output.schema.json"
    )


def test_every_exit_code_has_one_meaning_and_the_man_page_and_help_say_them_all() -> None:
    codes = [c for c, _name, _what in output.EXIT_CODES]
    assert len(codes) == len(set(codes)) == 8
    names = [n for _c, n, _what in output.EXIT_CODES]
    assert names == [
        "ok", "failed", "usage", "unreachable", "timeout", "refused", "stuck", "interrupted"
    ]  # fmt: skip
    helptext = kimi_mode.build_parser().format_help()
    for code, name, _what in output.EXIT_CODES:
        assert f"{code:>3}  {name}:" in helptext


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [
        ("busy", output.EXIT_REFUSED),
        ("wrong_mode", output.EXIT_REFUSED),
        ("stopping", output.EXIT_REFUSED),
        ("forbidden", output.EXIT_UNREACHABLE),
        ("bad_request", output.EXIT_USAGE),
        ("internal", output.EXIT_FAILED),
        ("state_error", output.EXIT_FAILED),
    ],
)
def test_a_refusal_exits_with_what_it_means_to_the_caller(code: str, exit_code: int) -> None:
    assert output.refusal_exit(code) == exit_code


def test_a_switch_that_ends_stuck_exits_6_and_a_failed_one_1() -> None:
    assert output.end_exit({"ok": True, "outcome": "ready"}) == 0
    assert output.end_exit({"ok": False, "outcome": "stuck"}) == output.EXIT_STUCK == 6
    assert output.end_exit({"ok": False, "outcome": "failed"}) == output.EXIT_FAILED


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
