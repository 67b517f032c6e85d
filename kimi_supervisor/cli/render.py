"""What an operator reads: status, history, a STUCK teardown's holders, a capture's files, and a
followed switch redrawn in place (on a terminal) or as plain lines. Pure formatting of the
daemon's JSON; used by kimi-mode and by `kimi-supervisor teardown`.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, TextIO

from kimi_supervisor.cli.summary_text import format_summary
from kimi_supervisor.model import SUMMARY, Outcome, State, printable, program, title
from kimi_supervisor.status import Status


def _ago(iso: str | None) -> str:
    if not iso:
        return "-"
    secs = (datetime.now(UTC) - datetime.fromisoformat(iso)).total_seconds()
    return duration(secs)


def duration(secs: float) -> str:
    secs = max(int(secs), 0)
    d, rem = divmod(secs, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m}m"
    if m:
        return f"{m}m {s}s"
    return f"{s}s"


def _hhmmss(iso: str | None) -> str:
    if not iso:
        return "-"
    return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def format_status(data: dict[str, Any], width: int = 80) -> str:
    """The status as `kimi-mode status` prints it, every row within `width` columns (longer
    values wrap under their column)."""
    s = Status.model_validate(data)
    unit, mode = s.unit, s.mode
    since = s.mode_since
    lines = [
        f"desired mode:  {s.desired_mode}",
        f"actual mode:   {mode or '-'}"
        + (f"  (for {_ago(since)}, since {_hhmmss(since)})" if mode else ""),
        f"state:         {s.state}: {s.status_line}",
    ]
    f = s.last_failure
    if f and s.state is not State.SERVING:
        lines.append(f"last failure:  {f.mode} at {_hhmmss(f.at)}: {f.reason}")
        if f.more:
            lines.append(f"               all of vLLM's output: {f.more}")
    if s.stuck:
        now = "a retry runs now" if s.stuck.retrying else "the next is due"
        lines.append(
            f"stuck:         since {_hhmmss(s.stuck.since)} ({_ago(s.stuck.since)}), "
            f"{s.stuck.retries} teardown(s) tried again; {now}"
        )
    tr = s.transition
    if tr:
        lines.append(
            f"transition:    {tr.id} to {tr.target} ({tr.kind}), step {tr.step}, "
            f"since {_hhmmss(tr.started_at)}; {tr.reason}"
        )
    if s.progress:
        lines.append(f"progress:      {s.progress.text}")
    if s.eta:
        lines.append(f"eta:           {s.eta.text}")
    if s.warm and s.transition:
        # "warming" only while it is under way: once it gave up or ended, what it did.
        label = "warming:" if s.warm.under_way else "page cache:"
        lines.append(f"{label:<15}{s.warm.text}")
    if s.downtime:
        when = "" if s.downtime.under_way else f" (last switch, to {s.downtime.target})"
        lines.append(f"downtime:      {s.downtime.text}{when}")
    if s.profile_until:
        lines.append(
            f"profile ends:  {_hhmmss(s.profile_until)} "
            f"(in {duration(s.profile_left_s or 0)}), then production"
        )
    c = s.capture
    if c:
        lines.append(
            f"capture:       {c.capture} {c.phase} since {_hhmmss(c.started_at)}, "
            f"{c.bytes / 1e6:.1f} MB written, then {c.then}"
        )
    live = s.liveness
    if live and (
        live.running is not None or live.canary_at or live.metrics in ("absent", "unreachable")
    ):
        parts = []
        if live.running is not None:
            waiting = f", {live.waiting:g} waiting" if live.waiting else ""
            parts.append(
                f"{live.running:g} request(s) running{waiting}, {live.tokens or 0:g} tokens made"
            )
        elif live.metrics == "absent":
            parts.append("no vllm:* metrics (judged by the engine's CPU and the canary)")
        elif live.metrics == "unreachable":
            parts.append("/metrics did not answer in time (no reading)")
        if live.stopped:
            parts.append(f"stopped: {', '.join(live.stopped)}")
        if live.judging:
            parts.append(live.judging)
        elif live.doubt:
            parts.append(live.doubt)
        if live.canary_at:
            if live.canary_ok:
                said = f"answered in {live.canary_s:.2f} s"
            elif live.canary_answered is False:
                said = f"unanswered after {live.canary_s:.0f} s"
            else:
                said = "refused"
            parts.append(f"canary {said} at {_hhmmss(live.canary_at)}")
        lines.append("liveness:      " + "; ".join(parts))
    health = unit.health
    lines.append(
        f"unit:          {unit.name} {unit.active_state}/{unit.sub_state}, "
        f"MainPID {unit.main_pid or '-'}, /health "
        + ("-" if health == -1 else ("no answer" if health == 0 else str(health)))
    )
    lines.append("GPUs:          index  used MiB  baseline MiB  state  holders")
    for g in s.gpus:
        holders = ", ".join(f"{h.pid} ({h.name})" for h in g.holders) or "-"
        state = "clean" if g.clean else "in use"
        lines.append(
            f"               {g.index:>5}  {g.used_mib:>8}  {g.baseline_mib:>12}  "
            f"{state:<6} {holders}"
        )
    if s.baseline_provisional:
        lines.append("               (baseline provisional: calibrated when the GPUs are idle)")
    gh = s.gpu_health
    if gh and gh.verdict != "healthy":  # healthy is said by nothing: the common case
        refused = ", the load refused" if gh.refused else ""
        lines.append(
            f"GPU health:    {gh.verdict} at {_hhmmss(gh.checked_at)} (before the load; "
            f"gpus.health_check = {gh.policy}{refused}): {fold_health(gh.text)}"
        )
    td = s.last_teardown
    if td:
        lines.append(
            f"last teardown: {td.outcome.upper()} in {td.duration_s:.2f} s, "
            f"{_ago(td.started_at)} ago, {len(td.kills)} process(es) killed"
        )
        for k in td.kills:
            lines.append(
                f"                 PID {k.pid} {program(k.cmdline, k.comm)} "
                f"({k.step}: {k.evidence})"
            )
        if td.outcome is not Outcome.CLEAN:
            lines.append(f"                 {td.diagnosis}")
            remaining = [r.model_dump(mode="json") for r in td.remaining]
            lines += ["                 " + x for x in format_remaining(remaining)]
            lines.append(f"                 next: {td.next_action}")
    if s.last_intrusion:
        i = s.last_intrusion
        lines.append(f"last intrusion: {_hhmmss(i.at)} {i.what}")
    b = s.incident_bundle
    if b and b.path:
        when = f" at {_hhmmss(b.at)}" if b.at else ""
        what = f"{b.trigger}{when}, " if b.trigger else ""
        cut = f", cut: {', '.join(b.cut)}" if b.cut else ""
        # The path on a row of its own: the default one (77 characters) fits 80 columns whole.
        lines.append(f"incident:      the newest bundle ({what}{b.size} bytes{cut}; root only):")
        lines.append(f"  {b.path}")
    if b and b.error:
        lines.append(f"incident:      the last bundle was not written ({_hhmmss(b.error_at)}): "
                     f"{b.error}")  # fmt: skip
    if s.next_attempt_in_s is not None:
        lines.append(
            f"next attempt:  in {s.next_attempt_in_s:.0f} s "
            f"({s.failures_in_window} failure(s) in the window)"
        )
    if s.restart_needed:
        lines.append(f"restart:       {s.restart_needed}")
    for w in s.warnings:
        lines.append(f"warning:       {w}")
    if s.output_tail:
        where = "" if f and f.more == s.output_where else f"; all of it: {s.output_where}"
        lines.append(f"vLLM's output: its last {len(s.output_tail)} lines{where}")
        lines += [f"  | {line}" for line in s.output_tail]
    lines.append(f"daemon:        PID {s.daemon.pid}, up {_ago(s.daemon.started_at)}")
    return "\n".join(wrap(lines, width - 1, hang=15))


ROLE_HEADINGS = {
    "suspect": "suspects (hold a managed GPU, not cleared):",
    "candidate": "candidates (might hold it; never killed on that evidence):",
    "unknown": "unknown (what they map could not be read; never killed):",
    "bystander": "bystanders (not the holder; never killed):",
}


def format_remaining(remaining: list[dict[str, Any]]) -> list[str]:
    """A STUCK teardown's processes, suspects first, then candidates, then bystanders. Entries
    are the status summary's or a history report's (`process` nested there)."""
    lines: list[str] = []
    for role, heading in ROLE_HEADINGS.items():
        group = [h for h in remaining if h.get("role", "suspect") == role]
        if group:
            lines.append(heading)
        for h in group:
            p = h.get("process", h)
            name = h.get("name") or title(p.get("cmdline", []), p.get("comm", ""))
            lines.append(f"  PID {p['pid']} {name}: {h['why']}")
            if h.get("check"):
                lines.append(f"    check: {h['check']}")
    return lines


def format_history(entries: list[dict[str, Any]], width: int = 80) -> str:
    """The history as `kimi-mode history` prints it, every row within `width` columns (a
    record's continuation rows under its text, after the time)."""
    lines = []
    for e in entries:
        kind = e.get("kind")
        if kind == "transition":
            lines.append(
                f"{_hhmmss(e['started_at'])}  switch   {e.get('previous') or '-'} -> "
                f"{e['target']} ({e['trigger']}): {e['outcome'].upper()} in {e['duration_s']:.1f} s"
                f" [{e['id']}] by {e.get('requested_by') or '-'}"
            )
            lines.append(f"{'':21}{e.get('message', '')}")
            if isinstance(e.get("downtime"), dict) and e["downtime"].get("text"):
                lines.append(f"{'':21}{e['downtime']['text']}")
        elif kind == "teardown":
            kills = [k for k in e.get("kills", []) if k["signal"] == "SIGKILL"]
            lines.append(
                f"{_hhmmss(e['started_at'])}  teardown {e['outcome'].upper()} in "
                f"{e['duration_s']:.2f} s, {len(kills)} killed: {e.get('reason', '')}"
            )
            for k in kills:
                p = k["process"]
                name = program(p.get("cmdline", []), p.get("comm", ""))
                lines.append(f"{'':21}killed PID {p['pid']} {name} ({k['step']}: {k['evidence']})")
            if e["outcome"] != "clean":
                lines.append(f"{'':21}{e.get('diagnosis', '')}")
                lines += [f"{'':21}{x}" for x in format_remaining(e.get("remaining", []))]
        elif kind == "capture":
            state = "OK" if e.get("ok") else "FAILED"
            lines.append(f"{_hhmmss(e.get('started_at'))}  capture  {state}: {e.get('message')}")
        elif kind == "incident":
            lines.append(f"{_hhmmss(e.get('at'))}  incident {e.get('what')}")
        else:
            lines.append(json.dumps(e))
    return "\n".join(wrap(lines, width - 1, hang=21)) or "(no history yet)"


# ------------------------------------------------------------------------------ commands
def format_capture(data: dict[str, Any], width: int = 80) -> str:
    lines = [f"traces in {data['folder']}:"]
    for f in data.get("files", []):
        rank = "-" if f["rank"] is None else str(f["rank"])
        lines.append(f"  rank {rank:>3}  {f['bytes'] / 1e6:10.1f} MB  {f['name']}")
    for old in data.get("removed", []):
        lines.append(f"  removed by retention: {old}")
    if data.get("summary"):
        lines.append(f"summary ({SUMMARY} beside the traces):")
        lines += format_summary(data["summary"]).splitlines()
    return "\n".join(wrap(lines, width - 1))


NBSP = "\xa0"


def whole(text: str) -> str:
    """`text` kept on one row by wrap() (a step and its time, the verdict, a kill's evidence)."""
    return text.replace(" ", NBSP)


def columns(out: TextIO) -> int:
    """The width a person's text is wrapped to: the terminal's, else 80 (a pipe, a log)."""
    import shutil

    return max(shutil.get_terminal_size((80, 24)).columns, 40) if out.isatty() else 80


def cells(text: str) -> int:
    """The columns `text` takes on a terminal: an East Asian wide or fullwidth character two,
    a combining mark none (a name another user chose may be any of them)."""
    if text.isascii():
        return len(text)
    import unicodedata

    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def rows_of(lines: list[str], width: int) -> int:
    """The terminal rows `lines` take at `width` columns: a row wider than that (a path kept
    whole, wide characters) is wrapped by the terminal onto more."""
    w = max(width, 1)
    return sum(max(-(-cells(r) // w), 1) for r in lines)


def cut(text: str, width: int) -> str:
    """`text` cut to at most `width` columns (where a row must fit, whatever it holds)."""
    if cells(text) <= width:
        return text
    out, used = [], 0
    for c in text:
        used += cells(c)
        if used > width:
            break
        out.append(c)
    return "".join(out)


def wrap(lines: list[str], width: int, hang: int | None = None) -> list[str]:
    """Each line wrapped at spaces to `width` columns, its continuation rows indented under the
    line's own indent plus two (or `hang` columns): nothing is cut. What whole() joined stays
    on one row if it fits in one, else breaks at its own spaces; only a word wider than a row
    is broken, and never a path: it gets a row of its own, whole."""
    import textwrap

    out: list[str] = []
    for raw in lines:
        # What another user chose (a process's argv, a file's name) never drives the terminal.
        line = printable(raw)
        if cells(line) <= width:
            out.append(line.replace(NBSP, " "))
            continue
        own = len(line) - len(line.lstrip(" "))
        indent = " " * (own + 2 if hang is None or own >= hang else hang)
        indent = indent[: width // 2]
        room = width - len(indent)
        words = line.split(" ")
        line = " ".join(w if len(w) <= room else w.replace(NBSP, " ") for w in words)
        # A path wider than a row goes on a row of its own, whole: a path broken in two cannot
        # be copied (the row is then wider than `width`; the terminal wraps it, adding nothing).
        path = any(len(w) > room and "/" in w for w in words)
        out += textwrap.wrap(
            line,
            width,
            subsequent_indent=indent,
            break_on_hyphens=False,
            break_long_words=not path,
            drop_whitespace=True,
        ) or [line[:width]]
    return [row.replace(NBSP, " ") for row in out]


def fold_gpus(findings: list[str]) -> list[str]:
    """Per-GPU findings said once for all the GPUs they are true of, in the order first seen:
    "GPU 0: page retirement: not supported" for GPUs 0 to 7 is "GPUs 0-7: page retirement:
    not supported" (it was one line of 495 columns on an 8-GPU host)."""
    import re

    by_text: dict[str, list[int]] = {}
    for f in findings:
        m = re.fullmatch(r"GPU (\d+): (.*)", f, re.DOTALL)
        key = m.group(2) if m else f"\0{f}"
        by_text.setdefault(key, []).extend([int(m.group(1))] if m else [])
    out = []
    for text, gpus in by_text.items():
        if not gpus:
            out.append(text.removeprefix("\0"))
        elif len(gpus) == 1:
            out.append(f"GPU {gpus[0]}: {text}")
        else:
            out.append(f"GPUs {_ranges(sorted(set(gpus)))}: {text}")
    return out


def _ranges(indices: list[int]) -> str:
    """0, 1, 2, 3, 5 -> "0-3, 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def fold_health(text: str) -> str:
    """A GPU health text ("found; ...; not read: ...; ...", decide/gpuhealth.py) with each
    finding true of several GPUs said once (fold_gpus)."""
    found, sep, missing = text.partition("not read: ")
    said = "; ".join(fold_gpus([x for x in found.rstrip("; ").split("; ") if x]))
    if not sep:
        return said
    return (f"{said}; " if said else "") + "not read: " + "; ".join(fold_gpus(missing.split("; ")))
