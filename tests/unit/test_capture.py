"""A capture's summary: steps, time per step, and the communication, GEMM and attention shares
of each rank, read from the traces as a stream. The GPU case is a fixture made on 2x H200 with
NCCL (tests/fixtures/make_gpu_trace.py); the real CPU traces of vLLM 0.16 are summarized in the
real-vLLM tier (tests/realvllm)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.analysis import trace as tracesummary
from kimi_supervisor.analysis.ranks import rank_of, summarize, summarize_folder
from kimi_supervisor.cli.render import format_summary as render
from kimi_supervisor.ports.safeopen import try_open
from tests.inotify import Watch

from ..conftest import as_user

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gpu-allreduce-2xh200"


def load_whole(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path) as f:
        events: list[dict[str, Any]] = json.load(f)["traceEvents"]
    return events


def decode_comm_share_the_slow_way(events: list[dict[str, Any]]) -> tuple[int, float]:
    """Independently of the summary's code: the NCCL kernels launched inside decode steps, and
    their share of all kernel time launched inside decode steps."""
    steps = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("execute_context_0(")
    ]
    launched = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    inside = [
        e
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        and any(s <= launched.get(e["args"]["correlation"], -1) < t for s, t in steps)
    ]
    nccl = [e for e in inside if "nccl" in e["name"]]
    return len(nccl), sum(e["dur"] for e in nccl) / sum(e["dur"] for e in inside)


def test_the_gpu_fixture_shows_each_ranks_nccl_share_of_the_decode_steps(tmp_path: Path) -> None:
    folder = tmp_path / "capture"
    shutil.copytree(FIXTURE, folder)
    summary, not_written = summarize_folder(folder, try_open)
    assert not_written is None and json.loads((folder / "summary.json").read_text()) == summary
    assert [r["rank"] for r in summary["ranks"]] == [0, 1] and not summary["errors"]
    for r in summary["ranks"]:
        events = load_whole(folder / r["file"])
        calls, share = decode_comm_share_the_slow_way(events)
        assert r["device"] == "gpu" and r["steps"] == {"decode": 12, "prefill": 1}
        assert r["classes"]["communication"]["share"] == pytest.approx(share, abs=1e-4)
        nccl = [t for t in r["top"] if t["name"].startswith("ncclDevKernel_AllReduce")]
        assert nccl and nccl[0]["calls"] == calls == 12 * 4  # 4 layers a step
        assert r["classes"]["gemm"]["ms_per_step"] > 0 and r["classes"]["attention"]["share"] > 0
        assert sum(c["share"] for c in r["classes"].values()) == pytest.approx(1, abs=1e-3)
    text = render(summary)
    assert "rank 0 (python3): 12 decode, 1 prefill; decode steps:" in text
    assert "communication" in text and "GEMM" in text and "attention" in text


def cpu_trace(path: Path, extra: int = 0) -> None:
    """A CPU worker's trace: 2 decode steps with nested operators, `extra` Python frames of
    with_stack noise, and a prefill step."""
    ev: list[dict[str, Any]] = [
        {
            "ph": "M",
            "name": "process_name",
            "pid": 1,
            "tid": 0,
            "args": {"name": "VLLM::Worker_TP0"},
        }
    ]

    def x(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> None:
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur})

    x("user_annotation", "execute_context_1(7)_generation_0(0)", 0, 900)
    x("cpu_op", "_C::onednn_mm", 10, 800)  # prefill: not in the decode figures
    for step in range(2):
        t = 1000 + step * 1000
        x("user_annotation", "execute_context_0(0)_generation_2(2)", t, 800)
        x("cpu_op", "aten::linear", t + 10, 300)
        x("cpu_op", "aten::addmm", t + 20, 250)  # inside linear: 50 of linear's own
        x("cpu_op", "_C::shm_allreduce", t + 400, 200)
        x("cpu_op", "_C::cpu_attention_with_kv_cache", t + 650, 100)
        x("cpu_op", "aten::copy_", t + 760, 20)
    x("cpu_op", "_C::shm_allreduce", 5000, 9999, tid=2)  # another thread: no steps there
    for i in range(extra):
        ev.append({"ph": "X", "cat": "python_function", "name": f"f.py({i}): f{i % 97}",
                   "pid": 1, "tid": 1, "ts": 1000 + i * 1e-3, "dur": 1e-3,
                   "args": {"Python id": i, "Python parent id": i - 1}})  # fmt: skip
    with gzip.open(path, "wt", compresslevel=1) as f:  # one write: dump's many are slow
        f.write(json.dumps({"schemaVersion": 1, "traceEvents": ev, "traceName": "t"}, indent=1))


def test_a_cpu_trace_counts_each_operators_own_time_once_inside_the_decode_steps(
    tmp_path: Path,
) -> None:
    cpu_trace(tmp_path / "1-rank-0.1.pt.trace.json.gz")
    with open(tmp_path / "1-rank-0.1.pt.trace.json.gz", "rb") as f:
        r = tracesummary.summarize_file(f)
    ms = {c: v["ms_per_step"] for c, v in r["classes"].items()}
    assert r["steps"] == {"prefill": 1, "decode": 2} and r["step_ms"] == 0.8
    assert ms == {"communication": 0.2, "gemm": 0.3, "attention": 0.1, "other": 0.02}
    assert r["busy_ms_per_step"] == 0.62 and r["top"][0]["name"] == "aten::addmm"


def test_a_large_trace_is_read_in_a_few_megabytes_whatever_its_size(tmp_path: Path) -> None:
    """Three times the events, past the reader's buffers: the peak grows by less than a
    twentieth of what the input grew (a reader that kept the events would grow by more than
    the input, one that kept their names by a third of it)."""
    unpacked, peaks = [], []
    for n in (10_000, 30_000):
        path = tmp_path / f"1-rank-0.{n}.pt.trace.json.gz"
        cpu_trace(path, extra=n)
        with gzip.open(path) as f:
            unpacked.append(sum(len(chunk) for chunk in iter(lambda: f.read(1 << 20), b"")))
        tracemalloc.start()
        try:
            with open(path, "rb") as f:
                r = tracesummary.summarize_file(f)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert r["events"] > n and r["steps"]["decode"] == 2
    assert unpacked[1] > 2.5 * unpacked[0] and peaks[1] < 12e6, (unpacked, peaks)
    assert peaks[1] - peaks[0] < (unpacked[1] - unpacked[0]) / 20, (unpacked, peaks)


def test_broken_and_linked_traces_are_reported_by_rank_and_the_others_still_summarized(
    tmp_path: Path,
) -> None:
    shutil.copy(next(FIXTURE.glob("*rank-0*")), tmp_path / "9-rank-0.1.pt.trace.json.gz")
    good = (tmp_path / "9-rank-0.1.pt.trace.json.gz").read_bytes()
    (tmp_path / "9-rank-1.1.pt.trace.json.gz").write_bytes(good[: len(good) // 2])
    (tmp_path / "9-rank-2.1.pt.trace.json.gz").write_bytes(gzip.compress(b"<html>nope</html>"))
    (tmp_path / "9-rank-3.1.pt.trace.json").write_text('{"traceEvents": [{"ph": "X"}')
    # Malformed early in a large file: reported without reading the rest into memory.
    (tmp_path / "9-rank-5.1.pt.trace.json").write_text(
        '{"traceEvents": [{"ph": "X", oops}, ' + '{"ph": "X"}, ' * 3_000_000 + "]}"
    )
    secret = tmp_path / "elsewhere.json"
    secret.write_text("{}")
    (tmp_path / "9-rank-4.1.pt.trace.json.gz").symlink_to(secret)
    summary, _ = summarize_folder(tmp_path, try_open)
    assert [r["rank"] for r in summary["ranks"]] == [0]
    errors = {e["rank"]: e["error"] for e in summary["errors"]}
    assert set(errors) == {1, 2, 3, 4, 5}
    assert "malformed JSON, or a value over 16 MB" in errors[5]
    assert "cannot read" in errors[1] or "truncated" in errors[1] or "ends inside" in errors[1]
    assert "not a Chrome trace" in errors[2]
    assert "truncated" in errors[3] or "ends inside" in errors[3]
    assert "a symbolic link" in errors[4]  # a link is never followed
    assert "rank 2 (9-rank-2.1.pt.trace.json.gz): not summarized: not a Chrome trace" in render(
        summary
    )


def test_vllm_0_16_and_0_32_trace_names_give_their_rank_and_the_api_servers_none() -> None:
    assert rank_of("1796080373330063950-rank-1.1796080419792488798.pt.trace.json.gz") == 1
    assert rank_of("rank3.1796080419792488798.pt.trace.json.gz") == 3
    assert rank_of("vm_8515.async_llm.1796080412100115802.pt.trace.json.gz") is None


def kimi_mode(*args: str, user: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    cmd = [*as_user(*user), "-m"] if user else [sys.executable, "-m"]
    return subprocess.run(
        [*cmd, "kimi_supervisor.cli.kimi_mode", "capture", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KIMI_SUPERVISOR_CONFIG": "/nonexistent"},
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="runs kimi-mode as another user (setpriv)")
def test_kimi_mode_summarize_needs_no_daemon_and_says_when_it_cannot_write_the_summary() -> None:
    tmp_path = Path(tempfile.mkdtemp(prefix="kimi-summary-"))  # pytest's is root's only
    try:
        summarize_as_another_user(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def summarize_as_another_user(tmp_path: Path) -> None:
    folder = tmp_path / "capture"
    shutil.copytree(FIXTURE, folder)
    os.chmod(tmp_path, 0o755)
    os.chmod(folder, 0o755)  # root's: another user reads the traces but cannot write there
    for f in folder.iterdir():
        os.chmod(f, 0o644)
    r = kimi_mode("--summarize", str(folder), user=("--reuid=65534", "--regid=65534",
                                                    "--clear-groups"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "rank 1 (python3): 12 decode, 1 prefill" in r.stdout
    assert "summary.json not written: Permission denied" in r.stdout
    assert not (folder / "summary.json").exists()
    r = kimi_mode("--summarize", str(folder), "--json")
    assert r.returncode == 0 and [x["rank"] for x in json.loads(r.stdout)["ranks"]] == [0, 1]
    assert (folder / "summary.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    r = kimi_mode("--summarize", str(empty))
    assert r.returncode == 1 and "no rank traces to summarize" in r.stderr
    assert "summary.json not written" in r.stderr and not (empty / "summary.json").exists()
    r = kimi_mode("--summarize", str(empty), "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["type"] == "error"
    r = kimi_mode("--summarize", str(tmp_path / "missing"))
    assert r.returncode == 2 and "No such file or directory" in r.stderr
    r = kimi_mode("--summarize", str(folder), "--seconds", "3")
    assert r.returncode == 2 and "--summarize takes no capture: drop --seconds" in r.stderr


def test_a_fifo_swapped_over_a_rank_trace_is_refused_at_once_and_never_wedges_the_summary(
    tmp_path: Path,
) -> None:
    """Before, a group member renamed a FIFO over a trace after the handover; the summarizer's
    open blocked for ever, and the capture stayed `summarizing`."""
    shutil.copy(next(FIXTURE.glob("*rank-0*")), tmp_path / "9-rank-0.1.pt.trace.json.gz")
    os.mkfifo(tmp_path / "9-rank-1.1.pt.trace.json.gz")
    result: list[dict[str, Any]] = []
    t = threading.Thread(
        target=lambda: result.append(summarize_folder(tmp_path, try_open)[0]), daemon=True
    )
    t.start()
    t.join(60)
    assert result, "the summary blocked on the FIFO"
    (summary,) = result
    assert [r["rank"] for r in summary["ranks"]] == [0]
    (error,) = summary["errors"]
    assert error["rank"] == 1 and "not a regular file" in error["error"]


def test_a_gzip_bomb_is_an_error_past_the_summarizers_memory_cap_not_a_daemon_out_of_memory(
    tmp_path: Path,
) -> None:
    """1 MB gzipped, 200,000 events with names that never repeat: 140 MB of memory without a
    cap on this VM (a million: 600 MB and 19 s); here a clear error under a 48 MiB cap, in
    which the real rank's summarizer still fits (it needs 20)."""
    shutil.copy(next(FIXTURE.glob("*rank-0*")), tmp_path / "9-rank-0.1.pt.trace.json.gz")
    event = '{"ph":"X","cat":"kernel","name":"kernel_%d","ts":%d,"dur":1,"pid":0,"tid":7}'
    with gzip.open(tmp_path / "9-rank-1.1.pt.trace.json.gz", "wt", compresslevel=1) as f:
        f.write('{"traceEvents":[' + ",".join(event % (i, i) for i in range(200_000)) + "]}")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        # The deadline far past the cap: at load 25 on 2 cores, 120 s ran out before the cap.
        summary = summarize(fd, os.listdir(fd), try_open, timeout_s=900, memory_mb=48)
    finally:
        os.close(fd)
    assert [r["rank"] for r in summary["ranks"]] == [0], "the real rank is still summarized"
    (error,) = summary["errors"]
    assert error["rank"] == 1 and "more than 48 MiB" in error["error"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root (CAP_MKNOD)")
def test_a_device_or_a_link_swapped_over_a_rank_trace_is_never_opened_by_the_summary(
    tmp_path: Path,
) -> None:
    """The daemon summarizes in a folder the asker owns by then: a device renamed over a
    trace would have been opened (O_NONBLOCK does not keep a driver's open from acting)."""
    folder = tmp_path / "capture"
    folder.mkdir()
    shutil.copy(next(FIXTURE.glob("*rank-0*")), folder / "9-rank-0.1.pt.trace.json.gz")
    device = folder / "9-rank-1.1.pt.trace.json.gz"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    secret = tmp_path / "root-only.json"
    secret.write_text("{}")
    secret.chmod(0o600)
    (folder / "9-rank-2.1.pt.trace.json.gz").symlink_to(secret)
    watch = Watch(device, secret)
    try:
        summary, _ = summarize_folder(folder, try_open)
        assert watch.opened() == [], "the summary opened what was swapped in"
    finally:
        watch.close()
    assert [r["rank"] for r in summary["ranks"]] == [0]
    errors = {e["rank"]: e["error"] for e in summary["errors"]}
    assert "a character device, not a regular file" in errors[1]
    assert "a symbolic link" in errors[2]


def test_a_trace_vllms_user_swaps_before_the_handover_is_never_read_or_handed_over(
    tmp_path: Path,
) -> None:
    """capture/job._move_into: vLLM's trace folder is vLLM's user's. A trace swapped after the
    listing for a FIFO or a link is neither opened nor moved, on one file system or across two
    (a copy), and is said; the file listed only is handed over."""
    from kimi_supervisor.capture.job import _move_into
    from kimi_supervisor.capture.tracedir import TraceDir

    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kimi-traces-"))  # another file system
    try:
        capture = tmp_path / "capture"
        capture.mkdir()
        for trace_dir in (shm, tmp_path / "traces"):
            trace_dir.mkdir(exist_ok=True)
            (trace_dir / "a.pt.trace.json").write_text("{}")
            (trace_dir / "b.pt.trace.json").write_text("{}")
            traces = TraceDir.open(trace_dir, os.geteuid())
            listed = {n: ident for n, (_s, _m, ident) in traces.files().items()}
            (trace_dir / "b.pt.trace.json").unlink()
            if trace_dir == shm:
                os.mkfifo(trace_dir / "b.pt.trace.json")
            else:
                (trace_dir / "b.pt.trace.json").symlink_to(trace_dir / "a.pt.trace.json")
            watch = Watch(trace_dir / "b.pt.trace.json")
            c_fd = os.open(capture, os.O_RDONLY | os.O_DIRECTORY)
            try:
                assert _move_into(traces, "a.pt.trace.json", listed["a.pt.trace.json"], dir_fd=c_fd,
                                  uid=65534, gid=65534) == ""  # fmt: skip
                why = _move_into(traces, "b.pt.trace.json", listed["b.pt.trace.json"], dir_fd=c_fd,
                                 uid=65534, gid=65534)  # fmt: skip
                assert watch.opened() == []
            finally:
                watch.close()
                traces.close()
                os.close(c_fd)
            # The inode may be the listed one's, reused: judged again on what it is now.
            assert why.endswith("; left where it was, not read"), why
            assert not stat.S_ISREG(os.lstat(trace_dir / "b.pt.trace.json").st_mode)
            assert sorted(os.listdir(capture)) == ["a.pt.trace.json"]
            assert os.stat(capture / "a.pt.trace.json").st_uid == 65534  # handed over
            for p in capture.iterdir():
                p.unlink()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_summarize_given_a_fifo_or_a_device_says_it_is_not_a_capture_folder_at_once(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "capture"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        r = kimi_mode("--summarize", str(path))
        assert r.returncode == 2 and "Not a directory" in r.stderr, r.stderr


def test_the_rank_summarizer_never_runs_code_from_the_callers_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m` puts its working directory first on the import path: root running
    `kimi-mode capture --summarize` in a folder another user writes must not run that user's
    kimi_supervisor."""
    evil = tmp_path / "cwd"
    (evil / "kimi_supervisor" / "analysis").mkdir(parents=True)
    (evil / "kimi_supervisor" / "__init__.py").write_text("")
    (evil / "kimi_supervisor" / "analysis" / "__init__.py").write_text("")
    marker = tmp_path / "ran"
    (evil / "kimi_supervisor" / "analysis" / "trace.py").write_text(
        f"open({str(marker)!r}, 'w').write('planted')\n"
    )
    traces = tmp_path / "traces"
    traces.mkdir()
    cpu_trace(traces / "1-rank-0.1.pt.trace.json.gz")
    monkeypatch.chdir(evil)
    fd = os.open(traces, os.O_RDONLY | os.O_DIRECTORY)
    try:
        summary = summarize(fd, os.listdir(traces), try_open)
    finally:
        os.close(fd)
    assert not marker.exists()
    assert [r["rank"] for r in summary["ranks"]] == [0] and not summary["errors"]


def test_a_link_in_vllms_trace_folder_is_never_read_out_into_the_askers_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's trace folder is its own user's to change: a link it puts there to a root-only
    file is neither listed as a trace nor copied out (a move across file systems copies)."""
    import errno

    from kimi_supervisor.capture import job

    traces, out = tmp_path / "traces", tmp_path / "out"
    traces.mkdir()
    out.mkdir()
    secret = tmp_path / "shadow"
    secret.write_text("root's secret")
    (traces / "rank0.pt.trace.json").symlink_to(secret)
    (traces / "rank1.pt.trace.json").write_text("{}")
    from kimi_supervisor.capture.tracedir import TraceDir

    t = TraceDir.open(traces, os.geteuid())
    listed = t.files()
    assert set(listed) == {"rank1.pt.trace.json"}
    ident = listed["rank1.pt.trace.json"][2]

    def cross_device(*_a: object, **_k: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(job.os, "rename", cross_device)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        uid, gid = os.getuid(), os.getgid()
        # Even handed the link's name with a listed identity, nothing is read through it.
        assert job._move_into(t, "rank0.pt.trace.json", ident, dir_fd=fd, uid=uid, gid=gid) != ""
        assert job._move_into(t, "rank1.pt.trace.json", ident, dir_fd=fd, uid=uid, gid=gid) == ""
    finally:
        os.close(fd)
        t.close()
    assert sorted(os.listdir(out)) == ["rank1.pt.trace.json"]
    assert secret.read_text() == "root's secret" and (traces / "rank0.pt.trace.json").is_symlink()


def test_a_hard_link_to_another_users_file_in_vllms_trace_folder_is_never_given_to_the_asker(
    tmp_path: Path,
) -> None:
    """vLLM's user may hard-link anyone's file it can write into its trace folder; the
    capture renamed it into the asker's folder and chowned it to them (an outside review).
    A trace has one name and vLLM's user owns it: anything else stays whose it was."""
    from kimi_supervisor.capture.job import _move_into
    from kimi_supervisor.capture.tracedir import TraceDir

    traces, capture = tmp_path / "traces", tmp_path / "capture"
    traces.mkdir()
    capture.mkdir()
    alice = tmp_path / "alice.txt"
    alice.write_text("alice's")
    os.chown(alice, 4245, 4245)
    os.link(alice, traces / "rank0.pt.trace.json")
    (traces / "rank1.pt.trace.json").write_text("{}")
    os.chown(traces / "rank1.pt.trace.json", 4245, 4245)  # one name, but not vLLM's user's
    t = TraceDir.open(traces, os.geteuid())
    listed = {n: ident for n, (_s, _m, ident) in t.files().items()}
    c_fd = os.open(capture, os.O_RDONLY | os.O_DIRECTORY)
    try:
        why = _move_into(t, "rank0.pt.trace.json", listed["rank0.pt.trace.json"], dir_fd=c_fd,
                         uid=4246, gid=4246)  # fmt: skip
        assert why.startswith("a file with 2 names (a hard link"), why
        why = _move_into(t, "rank1.pt.trace.json", listed["rank1.pt.trace.json"], dir_fd=c_fd,
                         uid=4246, gid=4246)  # fmt: skip
        assert why.startswith("owned by uid 4245, not by vLLM's user"), why
    finally:
        t.close()
        os.close(c_fd)
    assert os.stat(alice).st_uid == 4245 and alice.read_text() == "alice's"


def test_a_file_named_in_bytes_that_are_not_utf8_is_shown_escaped_and_recorded() -> None:
    """Such a name in the model's folder wedged status and crashed the daemon (sd_notify, the
    history, the status JSON; an outside review): it is shown with its odd bytes escaped."""
    from kimi_supervisor.model import shown

    name = os.fsdecode(b"model-\xff.safetensors")
    assert shown(name) == "model-\\xff.safetensors" and shown("plain.json") == "plain.json"
    assert shown("\ud800x") == "\\ud800x"  # not even bytes: escaped all the same
