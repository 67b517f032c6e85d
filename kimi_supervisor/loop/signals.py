"""The daemon's signals (SIGTERM and SIGINT: stop; SIGHUP: re-execute), as requests in its
inbox, and the re-exec itself."""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

from kimi_supervisor.loop.inbox import Reexec, Stop
from kimi_supervisor.ports.notify import Notifier

if TYPE_CHECKING:
    from kimi_supervisor.loop.daemon import Daemon


# The signals the daemon handles. They stay blocked from the start of `kimi-supervisor run` (so
# every thread it starts blocks them too, and they reach the main thread, whose select they wake)
# until the handlers are installed; and again across a re-exec, whose new image inherits the mask
# and the pending signals: between execv and the new handlers, SIGHUP's and SIGTERM's default
# actions would kill the daemon, and systemd counts a death by SIGHUP as a clean exit.
HANDLED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def block_signals() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)


def install_signal_handlers(daemon: Daemon) -> None:
    signal.signal(signal.SIGTERM, lambda *_: daemon.ask(Stop()))
    signal.signal(signal.SIGINT, lambda *_: daemon.ask(Stop()))
    signal.signal(signal.SIGHUP, lambda *_: daemon.ask(Reexec()))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)  # pending ones are handled now


def reexec(notifier: Notifier) -> None:
    """Replace this process with a fresh copy of itself (upgrades): vLLM is left running and is
    adopted by the new process. The control socket's lock dies with the old image. systemd is
    told RELOADING=1; the new image's READY=1 ends the reload (`systemctl reload` waits)."""
    block_signals()
    notifier.reloading("re-executing: vLLM keeps running and is adopted")
    os.execv(sys.executable, list(sys.orig_argv))
