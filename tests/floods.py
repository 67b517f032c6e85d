"""What an outsider floods the daemon with, for the fault tests and bench/faults_bench.py: a
script that asks for the whole history from many connections at once, and the daemon's RSS.

    python -c HISTORY_FLOOD SOCKET N   # prints "started", then the N replies' codes as JSON
"""

from __future__ import annotations

from pathlib import Path

HISTORY_FLOOD = """
import json, socket, sys, threading
path, n = sys.argv[1], int(sys.argv[2])
codes = []
def one():
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(120)
        s.connect(path)
        s.sendall(b'{"v": 1, "cmd": "history", "n": 10000}\\n')
        line = s.makefile("rb").readline()
        codes.append(json.loads(line)["code"] if line else "closed")
threads = [threading.Thread(target=one) for _ in range(n)]
for t in threads:
    t.start()
print("started", flush=True)
for t in threads:
    t.join()
print(json.dumps(codes), flush=True)
"""


def rss_mb(pid: int) -> float:
    """The resident set of `pid` (MB), 0 if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
