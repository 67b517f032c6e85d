"""A followed switch as an operator watches it: redrawn in place on a terminal, plain lines
otherwise (a pipe, a log, TERM=dumb). Pure formatting of the daemon's events, and, on a
terminal, of the status it publishes (`tick`, each second: the clock never stands still)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TextIO

from kimi_supervisor.cli.render import duration, whole, wrap
from kimi_supervisor.model import program


def redraws(out: TextIO, env: Mapping[str, str]) -> bool:
    """Whether the live display may redraw in place: a terminal that is not `TERM=dumb`."""
    return out.isatty() and env.get("TERM", "") != "dumb"


class Follower:
    """Renders a followed switch: redrawn on a TTY, plain lines otherwise. Redrawn lines are
    wrapped to the terminal's width here, never cut (the verdict and the evidence are at their
    ends), so that the redraw's cursor arithmetic counts every row. During the teardown each
    GPU's bar drains from what it used when the teardown began to its baseline; while vLLM
    loads it fills towards the GPU's total memory."""

    def __init__(self, out: TextIO, tty: bool, width: Callable[[], int] | None = None) -> None:
        self.out = out
        self.tty = tty
        self.width = width or (lambda: shutil.get_terminal_size((80, 24)).columns)
        self.drain_from: dict[int, int] = {}  # GPU index -> MiB used when the teardown began
        self.started = time.monotonic()
        self.target = ""
        self.steps: list[str] = []
        self.current = ""
        self.kills: list[tuple[str, str]] = []  # who was killed, and the evidence
        self.gpus: list[dict[str, Any]] = []
        self.loading = False  # the bars follow the load's memory (after the teardown)
        self.vllm = ""
        self._drawn = 0
        self._last_draw = 0.0
        self._last_gpu_line = 0.0
        self._last_pct: int | None = None
        self._last_text = ""

    def join(self, transition: dict[str, Any]) -> None:
        """Following a switch already under way (a rejoin): its real target and its clock."""
        self.target = str(transition.get("target") or self.target)
        started = transition.get("started_at")
        if started:
            age = (datetime.now(UTC) - datetime.fromisoformat(started)).total_seconds()
            self.started = time.monotonic() - max(age, 0.0)
        if transition.get("step") == "starting":
            self.loading = True

    def say(self, text: str) -> None:
        """A line that stays (above the redrawn lines on a terminal), wrapped at its width, or
        at 80 columns in a pipe or a log."""
        if self.tty:
            self._clear()
        width = max(self.width(), 40) if self.tty else 80
        print("\n".join(wrap([text], width - 1)), file=self.out, flush=True)
        if self.tty:
            self._draw(force=True)

    def tick(self, status: dict[str, Any] | None) -> None:
        """Each second on a terminal, whether events came or not: the clock moves, and the GPU
        bars, vLLM's progress and the ETA follow the status the daemon last published (None:
        not to be had now; the clock moves on)."""
        if status is not None:
            if status.get("gpus"):
                self.gpus = [g for g in status["gpus"] if "used_mib" in g]
                if not self.loading:
                    for d in self.gpus:
                        self.drain_from.setdefault(d["index"], d["used_mib"])
            if status.get("state") == "starting":
                self.loading = True
                progress, eta = status.get("progress"), status.get("eta")
                if progress:
                    self.vllm = progress["text"] + (f"; {eta['text']}" if eta else "")
        if self.tty:
            self._draw(force=True)

    def on_event(self, e: dict[str, Any]) -> None:
        name, data = e["event"], e.get("data", {})
        if name == "transition_started":
            self.target = data["target"]
            self.started = time.monotonic()
            self.drain_from, self.loading = {}, False
            self.say(
                f"{data['id']}: {data.get('previous') or 'nothing'} -> {data['target']} "
                f"({data['kind']}: {data['reason']})"
            )
        elif name == "step_started":
            self.current = data["step"]
        elif name == "step_finished":
            mark = "skipped" if data.get("skipped") else f"{data['duration_s']:.2f} s"
            self.steps.append(f"{data['step']} ({mark})")
            self.current = ""
            if not self.tty:
                self.say(f"  teardown {data['step']:<17} {mark:>8}  {data.get('note', '')}")
        elif name == "kill" and data.get("signal") == "SIGKILL":
            p = data["process"]
            name = program(p.get("cmdline", []), p.get("comm", ""))
            head, why = f"killed PID {p['pid']} {name}", f"({data['step']}: {data['evidence']})"
            self.kills.append((head, why))
            if not self.tty:
                self.say(f"  {head} {why}")
        elif name == "spared":
            self.say(f"  spared PID {data['pid']}: {data['why']}")
        elif name == "gpus":
            self.gpus = data["devices"]
            if not self.loading:
                for d in self.gpus:
                    self.drain_from.setdefault(d["index"], d["used_mib"])
            now = time.monotonic()
            if not self.tty and now - self._last_gpu_line >= 1.0:
                self._last_gpu_line = now
                self.say(
                    "  GPUs used/baseline MiB: "
                    + ", ".join(
                        f"{d['index']}: {d['used_mib']}/{d['baseline_mib']}" for d in self.gpus
                    )
                )
        elif name == "teardown_finished":
            if not self.tty:
                self.say(f"  teardown {data['outcome'].upper()} in {data['duration_s']:.2f} s")
            self.steps.append(f"=> {data['outcome'].upper()} in {data['duration_s']:.2f} s")
        elif name == "starting":
            self.loading = True
            self.vllm = f"starting vLLM in {data['mode']}"
            if not self.tty:
                self.say(f"  {self.vllm}")
            if data.get("expected_s") is not None:
                self.say(
                    f"  past loads of this mode and argv took {duration(data['expected_s'])} "
                    f"(median of {data['past']})"
                )
        elif name == "progress":
            self.vllm = data["text"] + (f"; {data['eta']}" if data.get("eta") else "")
            pct = data.get("percent")
            bucket = None if pct is None else pct // 10
            if not self.tty and (bucket != self._last_pct or pct is None):
                if pct is not None or data["text"] != self._last_text:
                    self.say(f"  vLLM: {self.vllm}")
                self._last_pct, self._last_text = bucket, data["text"]
        elif name == "warm":
            self.vllm = data["text"]
            now = time.monotonic()
            if not self.tty and (not data["under_way"] or now - self._last_gpu_line >= 5.0):
                self._last_gpu_line = now
                self.say(f"  {data['text']}")
        elif name == "start_failed":
            self.say(f"  vLLM did not start: {data['reason']}")
            for line in data.get("output_tail", [])[-10:]:
                self.say(f"    | {line}")
        elif name == "warning":
            self.say(f"  warning: {data.get('message')}")
        if self.tty:
            self._draw()

    def _lines(self) -> list[str]:
        elapsed = duration(time.monotonic() - self.started)
        lines = [f"kimi-mode: switching to {self.target or '...'}  ({elapsed})"]
        if self.steps or self.current:
            steps = ", ".join(whole(x) for x in self.steps[-4:])
            lines.append(f"  teardown: {steps}" + (f" > {self.current}..." if self.current else ""))
        lines.extend(f"  {head} {whole(why)}" for head, why in self.kills[-5:])
        if self.gpus:
            lines.append(
                "  GPU memory, filling as vLLM loads:"
                if self.loading
                else "  GPU memory, draining to baseline during the teardown:"
            )
        for d in self.gpus:
            used, base = d["used_mib"], d["baseline_mib"]
            if self.loading:
                top = max(d.get("total_mib") or used, used)
            else:
                top = max(self.drain_from.get(d["index"], used), used)
            width = 24
            fill = (
                min(width, round(width * (used - base) / max(top - base, 1))) if used > base else 0
            )
            lines.append(
                f"  GPU {d['index']} [{'#' * fill}{'.' * (width - fill)}] "
                f"{used} MiB (baseline {base})"
            )
        if self.vllm:
            lines.append(f"  vLLM: {self.vllm}")
        return lines

    def _clear(self) -> None:
        if self._drawn:
            self.out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        self._clear()
        lines = wrap(self._lines(), max(self.width() - 1, 20))
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()
        self._drawn = len(lines)

    def finish(self) -> None:
        if self.tty:
            self._draw(force=True)
