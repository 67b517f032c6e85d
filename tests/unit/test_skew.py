"""Waiting against moving data across the ranks of a capture (analysis/skew.py): synthetic
captures with a known injected skew (tests/synthetic_traces.py), clocks that
disagree, profilers that start a step apart, and the 2x H200 fixture measured with NCCL."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kimi_supervisor.analysis.collectives import Collective, collective
from kimi_supervisor.analysis.ranks import summarize
from kimi_supervisor.cli.summary_text import format_summary
from kimi_supervisor.ports.safeopen import try_open
from tests.synthetic_traces import write_capture

FIXTURE = Path(__file__).parents[1] / "fixtures" / "gpu-allreduce-2xh200"
STEPS, LAYERS = 12, 8


def summary_of(folder: Path) -> dict[str, Any]:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return summarize(fd, os.listdir(fd), try_open)
    finally:
        os.close(fd)


def rewrite_rank(folder: Path, rank: int, edit: Callable[[list[dict[str, Any]]], None]) -> None:
    """One rank's trace of a synthetic capture, its events edited in place and written back."""
    (path,) = folder.glob(f"*-rank-{rank}.*")
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    edit(trace["traceEvents"])
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)


def step_starts(events: list[dict[str, Any]]) -> list[float]:
    return sorted(e["ts"] for e in events if e.get("cat") == "user_annotation")


def all_reduce(summary: dict[str, Any], kind: str = "decode") -> dict[str, Any]:
    c: dict[str, Any] = summary["across_ranks"]["kinds"][kind]["collectives"]["all_reduce"]
    return c


def test_one_rank_arriving_late_is_named_and_the_others_wait_is_recovered_within_5_percent(
    tmp_path: Path,
) -> None:
    truth = write_capture(
        tmp_path, world=8, steps=STEPS, layers=LAYERS, late=5, late_us=400.0, jitter_us=60.0
    )
    s = summary_of(tmp_path)
    assert not s["errors"]
    c = all_reduce(s)
    assert {k: c["last_to_arrive"][k] for k in ("rank", "share")} == {"rank": 5, "share": 1.0}
    counted = STEPS - 1  # the first step is the profilers' start, not counted
    for p in c["per_rank"]:
        injected = truth[p["rank"]]["wait_us"] / counted / 1000
        if p["rank"] == 5:
            assert p["wait_ms"] == 0
        else:
            assert p["wait_ms"] == pytest.approx(injected, rel=0.05)
        assert p["transfer_ms"] == pytest.approx(truth[p["rank"]]["transfer_us"] / counted / 1000)
    assert c["wait_share"] > 0.8
    text = format_summary(s)
    assert "last to arrive: rank 5 in 100 % of calls" in text
    assert "mostly waiting for rank 5" in text


def test_ranks_arriving_together_read_as_moving_data(tmp_path: Path) -> None:
    write_capture(tmp_path, world=4, steps=STEPS, layers=LAYERS, transfer_us=200.0, jitter_us=4.0)
    c = all_reduce(summary_of(tmp_path))
    assert c["transfer_ms"] == pytest.approx(LAYERS * 0.2, rel=0.01)
    assert c["wait_share"] < 0.05
    assert "mostly moving data" in format_summary(summary_of(tmp_path))


def test_jitter_with_no_slow_rank_reads_as_jitter_not_as_one_rank(tmp_path: Path) -> None:
    write_capture(tmp_path, world=8, steps=STEPS, layers=LAYERS, transfer_us=5.0, jitter_us=300.0)
    c = all_reduce(summary_of(tmp_path))
    assert c["wait_share"] > 0.5 and c["last_to_arrive"]["share"] < 0.4
    assert "jitter" in format_summary(summary_of(tmp_path))


def test_ranks_on_clocks_that_disagree_are_aligned_by_their_collectives_ends_and_said_so(
    tmp_path: Path,
) -> None:
    # Traces from two hosts: one rank's times 2.3 ms behind, another's 1.5 ms ahead.
    truth = write_capture(
        tmp_path, world=4, steps=STEPS, layers=LAYERS, late=2, late_us=300.0,
        jitter_us=30.0, clock_us=[0.0, 1500.0, -2300.0, 0.0],
    )  # fmt: skip
    for path in tmp_path.glob("*-rank-*"):  # gathered from their hosts, each named by its host
        rank = path.name.split("-rank-")[1].split(".")[0]
        path.rename(path.with_name(f"node{rank}-rank-" + path.name.split("-rank-")[1]))
    s = summary_of(tmp_path)
    assert s["across_ranks"]["clock"].startswith("4 hosts, aligned by the collectives' ends")
    assert "node1 -1.500 ms ± 0.0" in s["across_ranks"]["clock"]
    c = all_reduce(s)
    assert c["last_to_arrive"]["rank"] == 2
    for p in c["per_rank"]:
        assert p["wait_ms"] == pytest.approx(truth[p["rank"]]["wait_us"] / 11 / 1000, rel=0.05)


def test_ranks_sharing_the_hosts_clock_are_not_shifted(tmp_path: Path) -> None:
    write_capture(tmp_path, world=2, steps=STEPS, layers=LAYERS, late=1, late_us=100.0)
    assert summary_of(tmp_path)["across_ranks"]["clock"].startswith("one host")


def test_ranks_of_one_host_are_never_corrected_even_when_their_ends_disagree(
    tmp_path: Path,
) -> None:
    # vLLM's names name no host: the capture's own. Ends 2 ms apart are not a reason to move
    # one host's clock: a correction would remove the real 2 ms skew.
    write_capture(
        tmp_path, world=2, steps=STEPS, layers=LAYERS, late=1, late_us=100.0,
        clock_us=[0.0, 2000.0],
    )  # fmt: skip
    a = summary_of(tmp_path)["across_ranks"]
    assert a["clock"] == "one host: the ranks share its clock, no correction"
    assert a["kinds"]["decode"]["collectives"]["all_reduce"]["arrival_spread_ms"]["p50"] > 1.5


def test_a_correction_across_hosts_is_never_larger_than_the_spread_it_explains_away(
    tmp_path: Path,
) -> None:
    write_capture(
        tmp_path, world=2, steps=STEPS, layers=LAYERS, late=1, late_us=300.0,
        clock_us=[0.0, -1500.0],
    )  # fmt: skip
    for path in tmp_path.glob("*-rank-*"):
        rank = path.name.split("-rank-")[1].split(".")[0]
        path.rename(path.with_name(f"node{rank}-rank-" + path.name.split("-rank-")[1]))
    a = summary_of(tmp_path)["across_ranks"]
    said = a["clock"].split("node1 ")[1]
    corrected = abs(float(said.split(" ms")[0]))
    assert 0 < corrected <= 1.5 + 0.3 + 0.001
    assert " ± " in said  # stated with its bound


def test_a_rank_whose_profiler_started_a_step_later_is_still_matched_step_for_step(
    tmp_path: Path,
) -> None:
    write_capture(tmp_path, world=4, steps=STEPS, layers=LAYERS, late=3, late_us=250.0)

    # Rank 1's profiler began a step late and stopped a step early: its first and last step
    # are missing from its trace (rewritten here without them).
    def drop_first_and_last(events: list[dict[str, Any]]) -> None:
        starts = step_starts(events)
        events[:] = [e for e in events if e.get("ph") == "M" or starts[1] <= e["ts"] < starts[-1]]

    rewrite_rank(tmp_path, 1, drop_first_and_last)
    a = summary_of(tmp_path)["across_ranks"]
    assert a["matched_steps"] == STEPS - 2 and a["unmatched_steps"] == 2
    assert a["shifts"] == {"0": 0, "1": -1, "2": 0, "3": 0}
    c = a["kinds"]["decode"]["collectives"]["all_reduce"]
    assert {k: c["last_to_arrive"][k] for k in ("rank", "share")} == {"rank": 3, "share": 1.0}
    assert [p["wait_ms"] for p in c["per_rank"]] == pytest.approx(
        [LAYERS * 0.25] * 3 + [0.0], rel=0.01
    )


def test_the_h200_fixtures_ranks_move_the_same_data_in_the_same_time_and_rank_0_comes_last(
    tmp_path: Path,
) -> None:
    # Measured: two H200s, NCCL ring LL, an all-reduce of 16 x 7168 bf16 (make_gpu_trace.py).
    shutil.copytree(FIXTURE, tmp_path / "c")
    s = summary_of(tmp_path / "c")
    a = s["across_ranks"]
    assert a["clock"] == "one host: the ranks share its clock, no correction"
    assert a["matched_steps"] == 13
    # The profilers' start: the first all-reduce's arrivals 164 ms apart, its ends within µs.
    assert a["transient"]["calls"] >= 1 and a["transient"]["entry_spread_ms"] > 100
    assert a["transient"]["exit_spread_ms"] < 0.05
    c = all_reduce(s)
    transfer = [p["transfer_ms"] for p in c["per_rank"]]
    assert transfer[0] == pytest.approx(transfer[1], rel=0.1)  # the same bytes on one link
    assert {k: c["last_to_arrive"][k] for k in ("rank", "share")} == {"rank": 0, "share": 1.0}
    # Rank 1's 1.5 ms of NCCL per decode step is waiting for rank 0, not moving data.
    assert c["per_rank"][1]["wait_ms"] > 20 * c["per_rank"][1]["transfer_ms"]
    assert s["ranks"][0]["collectives"]["all_reduce"]["implementations"] == ["NCCL"]
    assert s["ranks"][0]["overlap"]["overlapped_share"] == 0  # one stream: nothing overlaps
    assert s["ranks"][0]["step_times"]["decode"]["n"] == 12


@pytest.mark.parametrize(
    ("name", "kind", "impl"),
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "all_reduce", "NCCL"),
        ("ncclKernel_AllReduce_RING_LL_Sum_half(ncclWorkElem)", "all_reduce", "NCCL"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather", "NCCL"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(x)", "reduce_scatter", "NCCL"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "other", "NCCL"),
        ("void vllm::cross_device_reduce_2stage<__nv_bfloat16, 8>(vllm::RankData*, ...)",
         "all_reduce", "vLLM custom all-reduce"),
        ("void vllm::cross_device_reduce_1stage<half, 2>(...)", "all_reduce",
         "vLLM custom all-reduce"),
        ("void quickreduce::allreduce_prototype_twoshot<half, CodecQ4, false>(...)",
         "all_reduce", "vLLM quick all-reduce"),
        ("void c10d::symmetric_memory::two_shot_all_reduce_kernel<float, 8>(...)", "all_reduce",
         "symmetric memory"),
        ("multimem_all_reduce_kernel", "all_reduce", "symmetric memory"),
        ("multimem_all_gather_kernel", "all_gather", "symmetric memory"),
        ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<...>",
         "all_reduce", "FlashInfer all-reduce fusion"),
        ("_C::shm_allreduce", "all_reduce", "vLLM CPU shared memory"),
        ("_C::shm_all_gather", "all_gather", "vLLM CPU shared memory"),
        ("c10d::allreduce_", "all_reduce", "c10d"),
        ("c10d::_allgather_base_", "all_gather", "c10d"),
        ("c10d::_reduce_scatter_base_", "reduce_scatter", "c10d"),
        ("my_team_custom_allreduce_v2", "other", "unknown"),
    ],
)  # fmt: skip
def test_every_collective_is_named_by_its_row_and_an_unknown_one_is_other(
    name: str, kind: str, impl: str
) -> None:
    assert collective(name) == Collective(kind, impl)


@pytest.mark.parametrize(
    "name",
    ["nvjet_sm90_tst_64x16_64x16_2x1_v_bz_splitK_NNT", "_C::onednn_mm", "Memset (Device)",
     "vllm::unified_attention_with_output", "aten::reduce_sum"],
)  # fmt: skip
def test_compute_kernels_are_not_communication(name: str) -> None:
    assert collective(name) is None


def test_an_unknown_communication_kernel_is_counted_as_other_and_listed_by_name() -> None:
    from kimi_supervisor.analysis.trace import summarize

    ev = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_4(4)",
           "pid": 1, "tid": 1, "ts": 0.0, "dur": 100.0}]  # fmt: skip
    for link, (name, ts) in enumerate([("nvjet_gemm", 10.0), ("team_custom_allreduce_v2", 40.0)]):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                   "tid": 1, "ts": ts - 5, "dur": 1.0, "args": {"correlation": link}})  # fmt: skip
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts,
                   "dur": 20.0, "args": {"correlation": link}})  # fmt: skip
    r = summarize(io.StringIO(json.dumps({"traceEvents": ev})))
    assert r["collectives"] == {
        "other": {"ms_per_step": 0.02, "share": 0.5, "calls": 1,
                  "implementations": ["unknown"], "names": ["team_custom_allreduce_v2"]}
    }  # fmt: skip
    assert r["classes"]["communication"]["share"] == 0.5
    assert "team_custom_allreduce_v2" in format_summary({"ranks": [{**r, "rank": 0, "file": "x"}]})


def test_a_start_up_step_is_kept_in_the_rows_and_out_of_the_totals(tmp_path: Path) -> None:
    # The second step: rank 2 arrives 5 ms late at every layer (a shape compiled there). In
    # the totals it would make the others' wait per step several times the steady one.
    truth = write_capture(
        tmp_path, world=4, steps=STEPS, layers=LAYERS, late=2, late_us=200.0, startup_us=5000.0
    )
    a = summary_of(tmp_path)["across_ranks"]
    assert a["startup_steps"] == 2  # the profilers' start, and the slow one
    rows = a["per_step"]["rows"]
    assert [r[6] for r in rows[:3]] == [False, False, True]  # counted
    assert [r[7] for r in rows[:3]] == [0.2, 5.2, 0.2]  # the median arrival spread, ms
    assert rows[1][4] > 20 * rows[2][4]  # its wait, in its row
    c = a["kinds"]["decode"]["collectives"]["all_reduce"]
    for p in c["per_rank"]:
        assert p["wait_ms"] == pytest.approx(truth[p["rank"]]["wait_us"] / (STEPS - 2) / 1000)


def test_a_send_only_one_rank_makes_leaves_every_step_matched(tmp_path: Path) -> None:
    write_capture(tmp_path, world=2, steps=STEPS, layers=LAYERS, late=0, late_us=100.0)

    def add_a_send_in_step_3(events: list[dict[str, Any]]) -> None:
        step = step_starts(events)[3]
        events += [
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
             "ts": step + 2, "dur": 1, "args": {"correlation": 999999}},
            {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(x)", "pid": 0, "tid": 7,
             "ts": step + 3, "dur": 5, "args": {"correlation": 999999}},
        ]  # fmt: skip

    rewrite_rank(tmp_path, 1, add_a_send_in_step_3)
    s = summary_of(tmp_path)
    assert s["across_ranks"]["matched_steps"] == STEPS
    assert s["ranks"][1]["collectives"]["other"]["implementations"] == ["NCCL"]


def _moving(wait_ms: float, transfer_ms: float, spread_ms: float) -> dict[str, Any]:
    return {
        "verdict": {"reading": "moving data", "rank": None,
                    "thresholds": {"slow_rank_last_share": 0.8, "slow_rank_spread_p50_ms": 0.05,
                                   "waiting_share": 0.5}},
        "wait_ms": wait_ms, "transfer_ms": transfer_ms, "wait_share": wait_ms / (
            wait_ms + transfer_ms), "arrival_spread_ms": {"p50": spread_ms},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("wait_ms", "step_ms", "said"),
    [
        pytest.param(0.2, 10.0, "the wait is 0.200 ms per step (2.0 % of the 10.00 ms step), "
                     "arrivals p50 0.010 ms apart per call: removing skew would save at most that",
                     id="a wait of 2 % of the step is said not worth removing, with its figure"),
        pytest.param(4.0, 20.0, "the wait is 4.000 ms per step (20.0 % of the 20.00 ms step), "
                     "arrivals p50 0.010 ms apart per call: removing skew could save up to 4.000 "
                     "ms per step", id="a wait of 20 % of the step is said worth removing"),
    ],
)  # fmt: skip
def test_removing_skew_is_said_not_to_help_only_where_the_wait_is_small_against_the_step(
    wait_ms: float, step_ms: float, said: str
) -> None:
    from kimi_supervisor.cli.summary_text import reading

    text = reading(_moving(wait_ms, 5.0, 0.01), step_ms)
    assert said in text, text
    assert ("would not" in text) is False
