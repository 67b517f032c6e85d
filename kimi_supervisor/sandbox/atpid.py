"""Run a command as a given PID, as a recycled PID comes about: the kernel hands out the next free
PID after `ns_last_pid`.

    python -m kimi_supervisor.sandbox.atpid PID -- COMMAND ...

It writes PID - 1 to /proc/sys/kernel/ns_last_pid and forks, until the child has PID (another
process can take it in between: then it tries again). That child execs COMMAND; this process
exits at once, so COMMAND is an orphan, reparented as a detached process is. Needs CAP_SYS_ADMIN;
PID must be free.
"""

from __future__ import annotations

import os
import shutil
import sys

NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"
TRIES = 1000


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--" or not args[0].isdigit():
        raise SystemExit("usage: atpid PID -- COMMAND ...")
    want, command = int(args[0]), args[2:]
    exe = shutil.which(command[0]) or command[0]
    for _ in range(TRIES):
        if os.path.exists(f"/proc/{want}"):
            raise SystemExit(f"atpid: PID {want} is in use")
        with open(NS_LAST_PID, "w") as f:
            f.write(str(want - 1))
        pid = os.fork()
        if pid == 0:
            if os.getpid() == want:
                os.execv(exe, command)
            os._exit(0)
        if pid == want:
            os._exit(0)
        os.waitpid(pid, 0)
    raise SystemExit(f"atpid: PID {want} was taken by others {TRIES} times")


if __name__ == "__main__":
    main()
