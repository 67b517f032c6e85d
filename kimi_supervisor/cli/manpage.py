"""Manual pages for kimi-mode(1) and kimi-supervisor(8), rendered from the commands' own
argument parsers (so every command and option the program takes is in its page, with the help
text it prints) plus the sections a parser cannot say: exit status (from the tables of
cli/exits.py), examples (cli/examples.py), environment, files; and
kimi-supervisor.toml(5), from the config model (cli/configdoc.py).

    python -m kimi_supervisor.cli.manpage OUTDIR  # man1/kimi-mode.1.gz, man8/…, man5/…

Why not argparse-manpage (docs/dependencies.md): it renders the options as well, but neither
the exit-status table shared with --help, the examples, nor a page from the config model.
"""

from __future__ import annotations

import argparse
import gzip
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kimi_supervisor.cli import admin, configdoc, kimi_mode
from kimi_supervisor.cli.configdoc import esc as _esc
from kimi_supervisor.cli.examples import EXAMPLES
from kimi_supervisor.cli.exits import KIMI_MODE, KIMI_SUPERVISOR, Exit
from kimi_supervisor.version import package_version

FILES = [
    ("/etc/kimi-supervisor/kimi-supervisor.toml", "the configuration (check it with "
     "kimi-supervisor check-config)"),
    ("/run/kimi-supervisor/control.sock", "the daemon's control socket (root and group kimi)"),
    ("/var/lib/kimi-supervisor/state.json", "the desired mode, kept across restarts and reboots"),
    ("/var/lib/kimi-supervisor/history.jsonl", "every switch and teardown, with what was killed"),
    ("/var/lib/kimi-supervisor/captures/", "profiler captures taken without --out"),
    ("/usr/share/doc/kimi-supervisor/operations.md", "the operator's guide"),
]  # fmt: skip


@dataclass
class Page:
    parser: argparse.ArgumentParser
    section: int
    summary: str
    description: list[str]
    exit_status: list[tuple[str, str]]
    environment: list[tuple[str, str]] = field(default_factory=list)
    see_also: list[str] = field(default_factory=list)
    examples: list[tuple[str, str]] = field(default_factory=list)


def pages() -> list[Page]:
    return [
        Page(
            kimi_mode.build_parser(),
            1,
            "switch vLLM between production and profile mode, take profiler captures",
            [
                "kimi-mode asks the kimi-supervisor daemon, over its control socket, to switch "
                "vllm-kimi-k25.service between production and profile mode, and follows the "
                "switch: the teardown's steps, what was killed and why, vLLM's load progress.",
                "A switch first tears vLLM down until every managed GPU is back at its baseline "
                "memory, killing only what holds them, never the daemon, nvidia-persistenced or "
                "DCGM. Ctrl-C stops following; the switch goes on in the daemon.",
                "Root and members of the group kimi may use it.",
            ],
            [(str(code), f"{code.label}: {what}") for code, what in KIMI_MODE.items()],
            [
                ("KIMI_SUPERVISOR_SOCKET", "the control socket, when --socket is not given"),
                ("KIMI_SUPERVISOR_CONFIG", "the config file to find the socket in"),
            ],
            ["kimi-supervisor(8)", "kimi-supervisor.toml(5)", "systemctl(1)", "journalctl(1)"],
            [(cmd, what) for rows in EXAMPLES.values() for cmd, what in rows],
        ),
        Page(
            admin.build_parser(),
            8,
            "the daemon that owns vllm-kimi-k25.service and the GPUs it runs on",
            [
                "kimi-supervisor run is the daemon of kimi-supervisor.service. It keeps vLLM in "
                "the desired mode, tears it down until NVML reads every managed GPU back at its "
                "baseline before each start, and recovers the desired mode at boot. Operators "
                "use systemctl start, stop, restart (vLLM is adopted, not reloaded) and reload "
                "(after an upgrade), and kimi-mode(1) to switch.",
                "The other commands are for the operator (check-config, calibrate, teardown), "
                "for the units (reload, launch-vllm, launch-record), and for development "
                "(sandbox).",
            ],
            [(str(code), what) for code, what in KIMI_SUPERVISOR.items()],
            [("KIMI_SUPERVISOR_CONFIG", "the config file, when --config is not given")],
            [
                "kimi-mode(1)",
                "kimi-supervisor.toml(5)",
                "systemctl(1)",
                "journalctl(1)",
                "systemd.exec(5)",
            ],
            [
                (
                    "kimi-supervisor check-config /etc/kimi-supervisor/kimi-supervisor.toml",
                    "validate the config and check this host against it",
                ),
                (
                    "systemctl reload kimi-supervisor",
                    "re-execute the daemon (after an upgrade or a config edit); vLLM keeps serving",
                ),
                (
                    "systemctl stop kimi-supervisor && kimi-supervisor calibrate",
                    "tear vLLM down, then measure each GPU's idle memory",
                ),
                (
                    "journalctl -u kimi-supervisor KIMI_EVENT=stuck",
                    "every STUCK teardown, with its fields (KIMI_TRANSITION, KIMI_MODE, …)",
                ),
            ],
        ),
    ]


def _options(parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            takes = action.nargs != 0
            metavar = action.metavar or (action.dest.upper() if takes else "")
            if isinstance(action.choices, list | tuple) and takes and not action.metavar:
                metavar = "{" + ",".join(map(str, action.choices)) + "}"
            flags = ", ".join(f"\\fB{_esc(o)}\\fR" for o in action.option_strings)
            head = flags + (f" \\fI{_esc(str(metavar))}\\fR" if takes else "")
        else:
            head = f"\\fI{_esc(str(action.metavar or action.dest))}\\fR"
        out += [".TP", head, _esc(action.help or "")]
    return out


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    out: list[str] = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help or "" for a in action._choices_actions}
        for name, sub in action.choices.items():
            out += [".SS", f"\\fB{_esc(prefix + ' ' + name)}\\fR", _esc(helps.get(name, ""))]
            out += _options(sub)
            out += _subcommands(sub, f"{prefix} {name}")
    return out


def render(page: Page) -> str:
    p = page.parser
    name = p.prog
    lines = [
        f'.TH {name.upper()} {page.section} "" "kimi-supervisor {package_version()}"',
        ".nh",  # no hyphenation: commands and paths stay whole, as typed
        ".ad l",
        ".SH NAME",
        f"{_esc(name)} \\- {_esc(page.summary)}",
        ".SH SYNOPSIS",
        f"\\fB{_esc(name)}\\fR [\\fIoptions\\fR] \\fIcommand\\fR [\\fIcommand options\\fR]",
        ".SH DESCRIPTION",
    ]
    for para in page.description:
        lines += [".PP", _esc(para)]
    lines += [".SH OPTIONS", *_options(p), ".SH COMMANDS", *_subcommands(p, name)]
    lines += [".SH EXIT STATUS"]
    for code, meaning in page.exit_status:
        lines += [".TP", f"\\fB{code}\\fR", _esc(meaning)]
    if page.environment:
        lines += [".SH ENVIRONMENT"]
        for var, meaning in page.environment:
            lines += [".TP", f"\\fB{var}\\fR", _esc(meaning)]
    if page.examples:
        lines += [".SH EXAMPLES"]
        for cmd, what in page.examples:
            lines += [".TP", f"\\fB{_esc(cmd)}\\fR", _esc(what)]
    lines += [".SH FILES"]
    for path, meaning in FILES:
        lines += [".TP", f"\\fI{_esc(path)}\\fR", _esc(meaning)]
    lines += [".SH SEE ALSO", ", ".join(f"\\fB{_esc(s)}\\fR" for s in page.see_also)]
    return "\n".join(lines) + "\n"


def write(outdir: Path) -> list[Path]:
    written = []
    for page in pages():
        d = outdir / f"man{page.section}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{page.parser.prog}.{page.section}.gz"
        # mtime 0: the same version renders byte-identical pages
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(render(page).encode())
        written.append(path)
    d = outdir / "man5"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "kimi-supervisor.toml.5.gz"
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(configdoc.render().encode())
    written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m kimi_supervisor.cli.manpage OUTDIR", file=sys.stderr)
        return Exit.USAGE
    for path in write(Path(args[0])):
        print(path)
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())
