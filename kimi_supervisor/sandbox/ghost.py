"""A ghost: a detached process that holds GPU memory under an innocuous title.

It is what the seed's incident left behind: a process that matched none of the name patterns
and still held the GPUs. Started by `kimi-supervisor sandbox ghost` or by the fake vLLM's
ghost fault; it writes "ready PID" once it holds what it was asked to (PID: its own, which
differs from the one started with --detach), then waits to be killed.

With --fork-helper TITLE it forks a helper after taking the memory, as a CUDA process that
forks does: the helper inherits the contexts (the open device files) and the mappings, starts
a session of its own and retitles itself; "ready PID HELPER" names both. Kill the ghost and the
helper alone holds the memory while NVML keeps listing the dead ghost.

With --spin its GPUs read a kernel that spins (busy, no memory traffic: simgpu.set_activity,
written again every SPIN_EVERY_S over what vLLM's fake engine writes), as another user's
process on a managed GPU may run one: the simulated host only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from setproctitle import setproctitle

from kimi_supervisor.sandbox import holder

SPIN_EVERY_S = 0.1


def parse_gpus(spec: str) -> list[int]:
    if spec == "all":
        if holder.real_cuda():
            import torch

            return list(range(torch.cuda.device_count()))
        from kimi_supervisor.sandbox.simgpu import SimGpu

        gpu = SimGpu(holder.sim_dir())
        try:
            return list(range(gpu.device_count()))
        finally:
            gpu.close()
    return [int(x) for x in spec.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ghost")
    p.add_argument("--title", default="python")
    p.add_argument("--gpu", default="all")
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--hidden", action="store_true", help="hide from the GPU's process lists")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--spin", action="store_true", help="its GPUs read a kernel that spins")
    p.add_argument(
        "--detach", action="store_true", help="leave the starter: fork, and let the parent exit"
    )
    p.add_argument("--fork-helper", metavar="TITLE", help="fork a helper that shares the memory")
    p.add_argument(
        "--helper-closes-fds",
        action="store_true",
        help="the helper closes every descriptor, keeping only the mappings",
    )
    p.add_argument(
        "--cgroup-procs",
        action="append",
        default=[],
        help="cgroup.procs file(s) to move into, leaving the starter's cgroup",
    )
    args = p.parse_args(argv)
    if args.detach and os.fork() != 0:
        os._exit(0)  # the starter reaps us; the ghost goes on, reparented
    if args.title:
        setproctitle(args.title)
    for procs in args.cgroup_procs:
        Path(procs).write_text(str(os.getpid()))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gpus = parse_gpus(args.gpu)
    held = holder.hold(gpus, args.mib, hidden=args.hidden)
    if args.spin:
        threading.Thread(target=_spin, args=(gpus,), daemon=True).start()
    helper = _fork_helper(args.fork_helper, args.helper_closes_fds) if args.fork_helper else 0
    sys.stdout.write(f"ready {os.getpid()}" + (f" {helper}" if helper else "") + "\n")
    sys.stdout.flush()
    # Nobody reads our stdout after this; detach it so a closed pipe cannot hurt us.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    threading.Event().wait()
    held.release()


def _spin(gpus: list[int]) -> None:
    from kimi_supervisor.sandbox import simgpu

    root = holder.sim_dir()
    while True:
        simgpu.set_activity(root, gpus, "spin", pid=os.getpid())
        time.sleep(SPIN_EVERY_S)


def _fork_helper(title: str, close_fds: bool) -> int:
    sys.stdout.flush()
    pid = os.fork()
    if pid != 0:
        return pid
    os.setsid()
    setproctitle(title)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    if close_fds:
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
