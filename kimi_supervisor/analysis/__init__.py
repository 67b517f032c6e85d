"""The trace analysis: a capture's traces read (ranks.py, trace.py, reader.py, jsonstream.py),
each rank's steps and collective calls (timeline.py, collectives.py), the cross-rank split of
waiting against moving data (skew.py), and two captures compared (compare.py). It imports plain
data only, no part of the daemon: the capture job and `kimi-mode capture --summarize/--compare`
call it."""
