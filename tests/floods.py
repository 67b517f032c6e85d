"""What an outsider floods the daemon with, for the fault tests and bench/faults_bench.py: a
script that asks for the whole history from many connections at once, one that holds /metrics'
connections open without asking, and the daemon's RSS.

    python -c HISTORY_FLOOD SOCKET N   # prints "started", then the N replies' codes as JSON
    python -c METRICS_HOLD HOST PORT IDLE TRICKLING HOLD_S once|reopen
        # prints "held UID" once every connection is open, then, once the server has closed
        # them all (or after HOLD_S), as JSON: how many were opened, the seconds from each one's
        # connect to the server's close, and how many the server left open
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

# IDLE connections that send nothing, and TRICKLING ones that send a request a byte every
# TRICKLE_S and never its last byte (never a whole request). `reopen`: each one the server closes
# is opened again, until HOLD_S (an attacker who keeps at it); `once`: the client waits for the
# server to close them all.
METRICS_HOLD = """
import json, os, selectors, socket, sys, time
host, port, idle, trickling = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
hold_s, reopen = float(sys.argv[5]), sys.argv[6] == "reopen"
REQUEST = b"GET /metrics HTTP/1.1\\r\\nHost: kimi\\r\\nAccept: */*\\r\\n\\r\\n"
TRICKLE_S = 0.25
sel = selectors.DefaultSelector()
closed, opened = [], 0
def connect(trickles):
    global opened
    s = socket.create_connection((host, port), timeout=10)
    s.setblocking(False)
    opened += 1
    sel.register(s, selectors.EVENT_READ, [time.monotonic(), trickles, 0])
for i in range(idle + trickling):
    connect(i >= idle)
print("held", os.getuid(), flush=True)
end = time.monotonic() + hold_s
due = time.monotonic() + TRICKLE_S
while sel.get_map() and time.monotonic() < end:
    for key, _ in sel.select(max(0.0, min(end, due) - time.monotonic())):
        try:
            data = key.fileobj.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if not data:  # the server closed it (an end of file, or a reset)
            sel.unregister(key.fileobj)
            key.fileobj.close()
            closed.append(round(time.monotonic() - key.data[0], 3))
            if reopen:
                connect(key.data[1])
    if time.monotonic() >= due:
        due += TRICKLE_S
        for key in list(sel.get_map().values()):
            if key.data[1] and key.data[2] < len(REQUEST) - 1:
                try:
                    key.fileobj.send(REQUEST[key.data[2]:key.data[2] + 1])
                    key.data[2] += 1
                except OSError:
                    pass
left = len(sel.get_map())
print(json.dumps({"opened": opened, "closed_after_s": closed, "still_open": left}), flush=True)
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
