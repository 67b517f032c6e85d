"""A followed switch as an operator watches it: redrawn in place on a terminal, plain lines
otherwise (a pipe, a log, TERM=dumb). Pure formatting of the daemon's events, and, on a
terminal, of the status it publishes (`tick`, each second: the clock never stands still).

On a terminal the redrawn frame fits the terminal as it is at each draw (its width and its
height, read again at every draw; after a SIGWINCH, once the size held, at the next tick): a
frame taller than the screen less the cursor's row cannot be moved back over, and left a copy of
itself in the scrollback at every redraw. What
does not fit is folded, never dropped unsaid: the kills to the newest few and "N more", the
GPU bars to several on a row, then to the first few and "N more"; the clock's row is always the
frame's first, and vLLM's progress its last."""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from types import FrameType
from typing import Any, TextIO

from kimi_supervisor.cli.render import cut, duration, rows_of, whole, wrap
from kimi_supervisor.model import GpuHealth, program

# The kills a frame shows at most (the newest), with "N more" for the others.
KILLS_SHOWN = 5
BAR = 24  # a GPU's bar, on a row of its own
# A resized terminal is drawn again once its size held this long (at the next tick).
SETTLE_S = 0.25
SMALL_BAR = 12  # a GPU's bar where several share a row


def redraws(out: TextIO, env: Mapping[str, str]) -> bool:
    """Whether the live display may redraw in place: a terminal that is not `TERM=dumb`."""
    return out.isatty() and env.get("TERM", "") != "dumb"


def health_lines(data: Mapping[str, Any]) -> list[str]:
    """The `gpu_health` event (the GPUs' health read before a load) as warning lines: one per
    GPU and signal found, each naming the policy and what it did."""
    from kimi_supervisor.decide import gpuhealth  # here: `kimi-mode status` loads no decide/

    policy = data.get("policy", "")
    did = "the load is refused" if data.get("refused") else "loading all the same"
    healths = [
        GpuHealth(
            index=int(g["index"]),
            remap_pending=g.get("remap_pending"),
            remap_failed=g.get("remap_failed"),
            retired_pending=g.get("retired_pending"),
            ecc_uncorrected=g.get("ecc_uncorrected"),
            nvlink_errors=g.get("nvlink_errors"),
            xids=tuple(g["xids"]) if g.get("xids") is not None else None,
        )
        for g in data.get("gpus") or []
    ]
    v = gpuhealth.judge(healths)
    found = [*v.failing, *v.warnings] or [str(data.get("text", ""))]
    said = f"(gpus.health_check = {policy}: {did})"
    return [f"  warning: {x} {said}" for x in found]


class Redraw:
    """A block of rows redrawn in place at the bottom of a terminal, with lines that stay
    printed above it. The cursor goes back over the block and each row is written over the
    old one (erased to its end), then what is left below is erased: never an erase from the
    screen's top-left corner, which tmux (scroll-on-clear) copies into the scrollback whole."""

    def __init__(self, out: TextIO, width: Callable[[], int], height: Callable[[], int]) -> None:
        self.out = out
        self.width = width
        self.height = height
        self.drawn: list[str] = []  # the block's rows on screen
        self._back = False  # the cursor is at the block's first row

    def rows_on_screen(self) -> int:
        """How many rows the block drawn last takes now: a row wider than the terminal (it
        shrank since) was wrapped onto more by the terminal; never more than the screen holds."""
        return min(rows_of(self.drawn, self.width()), max(self.height() - 1, 1))

    def back(self) -> None:
        """The cursor back to the block's first row (what is written next goes over it)."""
        if self.drawn and not self._back:
            self.out.write(f"\x1b[{self.rows_on_screen()}F")
            self._back = True
            self.drawn = []

    def print(self, rows: list[str]) -> None:
        """Rows that stay, where the block was (it is drawn again below them)."""
        self.back()
        self.out.write("".join(f"{r}\x1b[K\n" for r in rows))
        self.out.flush()

    def draw(self, rows: list[str]) -> None:
        """The block again, over the old one."""
        self.back()
        self.out.write("".join(f"{r}\x1b[K\n" for r in rows) + "\x1b[J")
        self.out.flush()
        self.drawn, self._back = rows, False


class Follower:
    """Renders a followed switch: redrawn on a TTY, plain lines otherwise. Redrawn lines are
    wrapped to the terminal's width here, never cut (the verdict and the evidence are at their
    ends), and the frame folded to its height (the module's docstring), so that the redraw's
    cursor arithmetic counts every row. During the teardown each GPU's bar drains from what it
    used when the teardown began to its baseline; while vLLM loads it fills towards the GPU's
    total memory."""

    def __init__(
        self,
        out: TextIO,
        tty: bool,
        width: Callable[[], int] | None = None,
        *,
        height: Callable[[], int] | None = None,
    ) -> None:
        self.out = out
        self.tty = tty
        self.width = width or (lambda: shutil.get_terminal_size((80, 24)).columns)
        self.height = height or (lambda: shutil.get_terminal_size((80, 24)).lines)
        self.drain_from: dict[int, int] = {}  # GPU index -> MiB used when the teardown began
        self.started = time.monotonic()
        self.target = ""
        self.steps: list[str] = []
        self.current = ""
        self.kills: list[tuple[str, str]] = []  # who was killed, and the evidence
        self.gpus: list[dict[str, Any]] = []
        self.loading = False  # the bars follow the load's memory (after the teardown)
        self.vllm = ""
        self.screen = Redraw(out, self.width, self.height)
        self._drawing = False
        self._last_draw = 0.0
        self._resized_at = -math.inf  # the last SIGWINCH
        self._last_gpu_line = 0.0
        self._last_pct: int | None = None
        self._last_text = ""
        self._old_winch: Any = None
        if tty:
            with contextlib.suppress(ValueError, OSError):  # not the main thread: no SIGWINCH
                self._old_winch = signal.signal(signal.SIGWINCH, self._resized)

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
        rows = wrap([text], width - 1)
        if self.tty:
            self.screen.print(rows)
            self._draw(force=True)
        else:
            print("\n".join(rows), file=self.out, flush=True)

    def seen(self) -> str:
        """What the display showed last, in a few words (said at Ctrl-C): the switch, its
        clock, and vLLM's progress, else the teardown's step; "" before an event said one."""
        now = self.vllm or (f"teardown {self.current}" if self.current else "")
        now = now or (f"teardown {self.steps[-1]}" if self.steps else "")
        if not now:
            return ""
        clock = duration(time.monotonic() - self.started)
        return f"switching to {self.target or '...'} ({clock}): {now}"

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
        elif name == "gpu_health":
            for line in health_lines(data):
                self.say(line)
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

    # ------------------------------------------------------------------ the frame
    def _lines(self) -> list[str]:
        """Every line of the frame, unfolded (a terminal tall and wide enough shows these)."""
        head, steps, kills, gpus, tail = self._parts(KILLS_SHOWN, per_row=1)
        return [*head, *steps, *kills, *gpus, *tail]

    def frame(self, width: int, height: int) -> list[str]:
        """The rows drawn on a terminal of `width` x `height`: wrapped to its width, folded to
        fit its height less the cursor's row (the module's docstring)."""
        room = max(height - 1, 1)  # the cursor's row below: a taller frame scrolls
        per_cell = max((len(self._gpu_cell(d, SMALL_BAR)) + 2 for d in self.gpus), default=1)
        fits_per_row = max((width - 3) // per_cell, 1)
        most = min(len(self.kills), KILLS_SHOWN)
        least = min(most, 1)
        # Folded step by step: several GPUs on a row, then fewer kills, then fewer GPU rows.
        tries: list[tuple[int, int, int | None]] = [
            (most, n, None) for n in range(1, fits_per_row + 1)
        ]
        tries += [(k, fits_per_row, None) for k in range(most - 1, 0, -1)]
        tries += [(least, fits_per_row, r) for r in range(len(self.gpus) - 1, 0, -1)]
        tries += [(0, fits_per_row, 1)]
        rows: list[str] = []
        parts = self._parts(most, per_row=1)
        for kills_shown, per_row, gpu_rows in tries:
            parts = self._parts(kills_shown, per_row=per_row, gpu_rows=gpu_rows)
            rows = [r for part in parts for r in wrap(part, max(width - 1, 20))]
            if rows_of(rows, width) <= room:  # a row wider than the terminal takes more
                return rows
        # Still too tall (a terminal of a few rows): the clock's row, as many as fit, and
        # vLLM's progress last, with what was left out counted.
        head, *_, tail = parts
        first, last = wrap(head, max(width - 1, 20)), wrap(tail, max(width - 1, 20))
        middle = rows[len(first) : len(rows) - len(last)]
        keep = room - len(first) - len(last) - 1
        if keep < 0:  # not even vLLM's progress fits: counted with the rest
            middle, last, keep = rows[len(first) :], [], max(room - len(first) - 1, 0)
        more = f"  {len(middle) - keep} more rows (a taller terminal shows them)"
        if len(more) >= width:
            more = f"  {len(middle) - keep} more rows"
        # Each row cut to the width here: a path kept whole, or wide characters, would take
        # rows of the terminal's that the count above does not have.
        return [cut(r, max(width - 1, 1)) for r in [*first, *middle[:keep], more, *last]][
            : max(room, 1)
        ]

    def _parts(
        self, kills_shown: int, *, per_row: int, gpu_rows: int | None = None
    ) -> tuple[list[str], list[str], list[str], list[str], list[str]]:
        """The frame's parts: the clock, the teardown's steps, the kills, the GPUs, vLLM."""
        elapsed = duration(time.monotonic() - self.started)
        head = [f"kimi-mode: switching to {self.target or '...'}  ({elapsed})"]
        steps: list[str] = []
        if self.steps or self.current:
            earlier = len(self.steps) - 4
            shown = ", ".join(whole(x) for x in self.steps[-4:])
            before = f"{earlier} earlier, " if earlier > 0 else ""
            now = f" > {self.current}..." if self.current else ""
            steps.append(f"  teardown: {before}{shown}{now}")
        kills = [
            f"  {who} {whole(why)}" for who, why in self.kills[len(self.kills) - kills_shown :]
        ]
        if len(self.kills) > kills_shown:
            more = len(self.kills) - kills_shown
            kills.insert(0, f"  {more} more killed (`kimi-mode history` lists every kill)")
        gpus: list[str] = []
        if self.gpus:
            what = "filling as vLLM loads" if self.loading else "draining to baseline"
            if per_row == 1:
                gpus.append(f"  GPU memory, {what}:")
                gpus += [f"  {self._gpu_cell(d, BAR)} (baseline {d['baseline_mib']})"
                         for d in self.gpus]  # fmt: skip
            else:
                gpus.append(f"  GPU memory in MiB, used/baseline, {what}:")
                cells = [self._gpu_cell(d, SMALL_BAR) for d in self.gpus]
                cells = [c.ljust(max(map(len, cells))) for c in cells]  # in columns
                gpus += ["  " + "  ".join(cells[i : i + per_row]).rstrip()
                         for i in range(0, len(cells), per_row)]  # fmt: skip
            if gpu_rows is not None and len(gpus) - 1 > gpu_rows:
                hidden = len(self.gpus) - gpu_rows * per_row
                gpus = [
                    *gpus[: 1 + gpu_rows],
                    f"  {hidden} more GPUs (`kimi-mode status` shows each)",
                ]
        tail = [f"  vLLM: {self.vllm}"] if self.vllm else []
        return head, steps, kills, gpus, tail

    def _gpu_cell(self, d: dict[str, Any], width: int) -> str:
        used, base = d["used_mib"], d["baseline_mib"]
        if self.loading:
            top = max(d.get("total_mib") or used, used)
        else:
            top = max(self.drain_from.get(d["index"], used), used)
        fill = min(width, round(width * (used - base) / max(top - base, 1))) if used > base else 0
        bar = f"GPU {d['index']} [{'#' * fill}{'.' * (width - fill)}]"
        return f"{bar} {used} MiB" if width == BAR else f"{bar} {used}/{base}"

    # ------------------------------------------------------------------ drawing
    def _clear(self) -> None:
        self.screen.back()

    def _draw(self, force: bool = False, *, resizing_too: bool = False) -> None:
        """The frame again (events: at most every 0.1 s; `force`: now). Not while the terminal
        is being resized (a SIGWINCH less than SETTLE_S ago): a frame drawn at one size lands
        at another, is wrapped or pushed into the scrollback there, and cannot be moved back
        over; the next tick draws it once the size holds (`resizing_too`: the last frame)."""
        now = time.monotonic()
        if self._drawing or (not force and now - self._last_draw < 0.1):
            return
        if now - self._resized_at < SETTLE_S and not resizing_too:
            return
        self._drawing = True
        try:
            self._last_draw = now
            self.screen.draw(self.frame(self.width(), self.height()))
        finally:
            self._drawing = False

    def _resized(self, signum: int, frame: FrameType | None) -> None:
        """SIGWINCH: only noted. A storm of them (a window dragged) is one redraw, at the next
        tick after the size held for SETTLE_S, never a frame per signal, nor one drawn from
        the handler into the middle of another write."""
        self._resized_at = time.monotonic()

    def finish(self) -> None:
        if self.tty:
            self._draw(force=True, resizing_too=True)
            if self._old_winch is not None:
                with contextlib.suppress(ValueError, OSError):
                    signal.signal(signal.SIGWINCH, self._old_winch)
                self._old_winch = None
