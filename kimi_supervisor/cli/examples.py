"""What kimi-mode's parser says beyond its options: each command's examples (its --help
epilog and the man page's EXAMPLES section, from one table), and the options every command
takes before or after its name."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from kimi_supervisor.cli.exits import Exit

# Each command's examples: its --help's epilog and the man page's EXAMPLES.
EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "production": [
        ("kimi-mode production", "switch back to production and follow the switch"),
        ("kimi-mode production --apply", "restart production with the config's new argv"),
        ("kimi-mode production --no-wait", "ask, return at once (follow with kimi-mode wait)"),
    ],
    "profile": [
        ("kimi-mode profile --for 2h", "profile mode for two hours, then production again"),
        ("kimi-mode profile --force", "take over from a switch to production in progress"),
    ],
    "capture": [
        ("kimi-mode capture --switch --seconds 30", "switch, record 30 s, switch back"),
        ("kimi-mode capture --then stay", "record until Enter, stay in profile mode"),
        ("kimi-mode capture --summarize DIR -o json", "a capture's summary as JSON"),
        ("kimi-mode capture --compare BEFORE AFTER", "two captures side by side, and a verdict"),
    ],
    "status": [
        ("kimi-mode status", "modes, state, unit, GPUs, the last teardown"),
        ("kimi-mode status --watch", "the same, redrawn every 2 s"),
        ("kimi-mode status -o json | jq .state", "one field, for a script"),
    ],
    "is-serving": [
        (
            "kimi-mode is-serving production -q && echo up",
            f"exit {Exit.OK} only when production serves",
        ),
    ],
    "history": [
        ("kimi-mode history -n 5", "the last five switches and teardowns, with every kill"),
        ("kimi-mode history -o json | jq 'select(.kind==\"teardown\")'", "teardowns only"),
    ],
    "wait": [
        ("kimi-mode wait", "follow the switch under way again (after Ctrl-C or --no-wait)"),
        ("kimi-mode wait production --timeout 45m", "until production serves, at most 45 min"),
    ],
    "logs": [
        ("kimi-mode logs", "vLLM's last 50 lines, as journalctl -u would show them"),
        ("kimi-mode logs -f", "follow vLLM's output"),
        ("kimi-mode logs --daemon -n 200", "the daemon's own last 200 lines"),
    ],
    "doctor": [
        ("kimi-mode doctor", "check that this host can run the daemon; say what to fix"),
    ],
}


class Formatter(argparse.HelpFormatter):
    """argparse's own, except that an epilog of examples or exit codes keeps its lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(("examples:", "exit codes:")):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def exit_codes(meanings: Mapping[Exit, str], width: int = 78) -> str:
    """The --help epilog of exit codes (cli/exits.py): one code a row, with its name."""
    import textwrap

    out = ["exit codes:"]
    for code, what in meanings.items():
        out += textwrap.wrap(
            f"{code:>3}  {code.label}: {what}",
            width,
            initial_indent="  ",
            subsequent_indent=" " * 7,
        )
    return "\n".join(out)


def epilog(cmd: str) -> str:
    rows = EXAMPLES.get(cmd, [])
    return "examples:\n" + "\n".join(f"  {c}\n      {what}" for c, what in rows) if rows else ""


def global_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    """The options every command takes, before or after the command. A command's copy leaves
    the value unset (SUPPRESS) unless given there, so it never hides the one before it."""

    def d(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    p.add_argument(
        "-o",
        "--output",
        choices=["text", "json"],
        default=d("text"),
        help="text for a person (default), or json: JSON lines, one object each "
        "(docs/control-protocol.md)",
    )
    p.add_argument(
        "--json",
        dest="output",
        action="store_const",
        const="json",
        default=d("text"),
        help="the same as -o json",
    )
    p.add_argument(
        "--socket",
        default=d(None),
        help="the daemon's control socket (or KIMI_SUPERVISOR_SOCKET)",
    )
    p.add_argument("--config", default=d(None), help="find the socket in this config file")
