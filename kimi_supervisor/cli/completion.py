"""Shell completion for kimi-mode and kimi-supervisor, generated from their argument parsers
(so a new command or option completes without anyone editing a script).

    python -m kimi_supervisor.cli.completion bash kimi-mode     # the bash script on stdout
    python -m kimi_supervisor.cli.completion zsh kimi-mode      # zsh, through its bashcompinit
    python -m kimi_supervisor.cli.completion install DESTDIR  # both, both shells (make install)

Completed: the commands (and a `sandbox` command's own commands), each one's options, the
choices of an option or argument, and file names after an option that takes a path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kimi_supervisor.cli import admin, kimi_mode
from kimi_supervisor.cli.exits import Exit

PARSERS = {"kimi-mode": kimi_mode.build_parser, "kimi-supervisor": admin.build_parser}
PATHS = {
    "--out",
    "--summarize",
    "--compare",
    "--socket",
    "--config",
    "--dir",
    "--argv-file",
    "--file",
}


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _words(p: argparse.ArgumentParser) -> list[str]:
    """What may follow a command: its options, its own commands, its arguments' choices."""
    words: list[str] = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            words += list(a.choices)
        elif a.option_strings:
            words += [o for o in a.option_strings if o.startswith("--")] or a.option_strings
        elif a.choices:
            words += [str(c) for c in a.choices]
    return words


def _choices(p: argparse.ArgumentParser) -> dict[str, list[str]]:
    return {
        o: [str(c) for c in a.choices]
        for a in p._actions
        if a.option_strings and a.choices
        for o in a.option_strings
    }


def bash(command: str) -> str:
    parser = PARSERS[command]()
    fn = "_" + command.replace("-", "_")
    cases = []
    choices: dict[str, list[str]] = {}
    for name, sub in _subparsers(parser).items():
        cases.append(f'        {name}) echo "{" ".join(_words(sub))}" ;;')
        choices.update(_choices(sub))
        for inner, leaf in _subparsers(sub).items():
            cases.append(f'        {name}/{inner}) echo "{" ".join(_words(leaf))}" ;;')
            choices.update(_choices(leaf))
    values = [f'        {o}) COMPREPLY=($(compgen -W "{" ".join(c)}" -- "$cur")); return ;;'
              for o, c in sorted(choices.items())]  # fmt: skip
    lines = [
        f"# bash completion for {command}, generated from its parser (cli/completion.py)",
        f"{fn}_words() {{",
        '    case "$1" in',
        *cases,
        "    esac",
        "}",
        f"{fn}() {{",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}" words=""',
        '    case "$prev" in',
        f'        {"|".join(sorted(PATHS))}) COMPREPLY=($(compgen -f -- "$cur")); return ;;',
        *values,
        "    esac",
        '    if [ "$COMP_CWORD" -eq 1 ]; then',
        f'        COMPREPLY=($(compgen -W "{" ".join(_words(parser))}" -- "$cur")); return',
        "    fi",
        '    if [ "$COMP_CWORD" -gt 2 ]; then',
        f'        words="$({fn}_words "${{COMP_WORDS[1]}}/${{COMP_WORDS[2]}}")"',
        "    fi",
        f'    [ -n "$words" ] || words="$({fn}_words "${{COMP_WORDS[1]}}")"',
        '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
        "}",
        f"complete -F {fn} {command}",
    ]
    return "\n".join(lines) + "\n"


def zsh(command: str) -> str:
    return f"#compdef {command}\nautoload -U +X bashcompinit && bashcompinit\n" + bash(command)


def install(dest: Path) -> list[Path]:
    written = []
    for command in PARSERS:
        for path, text in (
            (dest / "bash-completion" / "completions" / command, bash(command)),
            (dest / "zsh" / "site-functions" / f"_{command}", zsh(command)),
        ):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) == 2 and args[0] in ("bash", "zsh") and args[1] in PARSERS:
        print(bash(args[1]) if args[0] == "bash" else zsh(args[1]), end="")
        return Exit.OK
    if len(args) == 2 and args[0] == "install":
        for path in install(Path(args[1])):
            print(path)
        return Exit.OK
    print(
        "usage: python -m kimi_supervisor.cli.completion bash|zsh kimi-mode|kimi-supervisor\n"
        "       python -m kimi_supervisor.cli.completion install SHAREDIR",
        file=sys.stderr,
    )
    return Exit.USAGE


if __name__ == "__main__":
    sys.exit(main())
