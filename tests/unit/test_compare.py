"""Captures side by side (`kimi-mode capture --compare A B`, or several a side;
analysis/compare.py): the synthetic captures of tests/synthetic_traces.py, with the skew or the
transfer changed between them, the 2x H200 fixture, and real gloo captures; each change judged
against the noise of the steps and, with several captures a side, of the runs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from kimi_supervisor.analysis.compare import CompareError, compare, judge
from kimi_supervisor.analysis.ranks import summarize_folder
from kimi_supervisor.cli.output import OutputLine
from kimi_supervisor.ports.safeopen import try_open
from tests.synthetic_traces import write_capture

from .test_capture import FIXTURE, kimi_mode
from .test_real_collectives import FIXTURES, capture

STEPS, LAYERS = 12, 8


def test_less_skew_reads_as_the_skew_going_down_with_the_wait_delta_per_step(
    tmp_path: Path,
) -> None:
    write_capture(tmp_path / "a", world=4, steps=STEPS, layers=LAYERS, late=1, late_us=400.0)
    write_capture(tmp_path / "b", world=4, steps=STEPS, layers=LAYERS, late=1, late_us=100.0)
    c = compare(
        summarize_folder(tmp_path / "a", try_open)[0], summarize_folder(tmp_path / "b", try_open)[0]
    )
    rows = {r["what"]: r for r in c["rows"]}
    # Three of four ranks wait 300 us less at each of 8 all-reduces: 1.8 ms per step on average.
    assert rows["all-reduce wait"]["delta"] == pytest.approx(-0.3 * LAYERS * 3 / 4, rel=0.02)
    assert rows["all-reduce transfer"]["delta"] == pytest.approx(0, abs=0.01)
    assert c["verdict"].startswith(
        "the wait shrank -1.80 ms per step (noise ±0.05), the skew went down: arrival spread "
        "p50 -0.30 ms per call (noise ±0.05), carried by rank 1"
    ), c["verdict"]
    assert "0.40 ms after the next latest (median) against 0.10 in B" in c["verdict"]
    assert c["kind"] == "decode" and not c["notes"]


def test_slower_transfers_read_as_the_data_moving_slower(tmp_path: Path) -> None:
    write_capture(tmp_path / "a", world=2, steps=STEPS, layers=LAYERS, transfer_us=30.0)
    write_capture(tmp_path / "b", world=2, steps=STEPS, layers=LAYERS, transfer_us=130.0)
    c = compare(
        summarize_folder(tmp_path / "a", try_open)[0], summarize_folder(tmp_path / "b", try_open)[0]
    )
    assert c["verdict"].startswith(
        "the data moves slower: transfer +0.80 ms per step (noise ±0.05)"
    ), c["verdict"]


def test_a_capture_against_itself_moves_nothing_beyond_the_noise_floor(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "a")
    s = summarize_folder(tmp_path / "a", try_open)[0]
    c = compare(s, s)
    assert all(r["delta"] == 0 for r in c["rows"] + c["top"])
    assert c["verdict"].startswith("no change beyond the noise: step p50 +0.00"), c["verdict"]
    assert "run-to-run noise not measured (one capture a side" in c["verdict"]


def test_captures_of_different_step_kinds_are_refused_with_what_to_do(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "a")
    s = summarize_folder(tmp_path / "a", try_open)[0]
    prefill = json.loads(json.dumps(s))
    for r in prefill["ranks"]:
        r["scope"] = "prefill steps"
    with pytest.raises(CompareError, match="compare captures of the same load"):
        compare(s, prefill)


def test_kimi_mode_compare_needs_no_daemon_prints_the_verdict_and_validates_as_json(
    tmp_path: Path,
) -> None:
    shutil.copytree(FIXTURE, tmp_path / "fixture")
    write_capture(tmp_path / "synthetic", world=2, steps=STEPS, layers=4, late=0, late_us=200.0)
    a, b = str(tmp_path / "fixture"), str(tmp_path / "synthetic")
    r = kimi_mode("--compare", a, b)
    assert r.returncode == 0, r.stderr
    assert " ".join(r.stdout.split()).startswith(f"A: {a} B: {b} ")  # wrapped to the width
    assert "\nverdict: " in r.stdout and "all-reduce wait" in r.stdout
    r = kimi_mode("--compare", a, b, "--json")
    assert r.returncode == 0, r.stderr
    line = TypeAdapter(OutputLine).validate_json(r.stdout)
    assert line.type == "compare" and line.kind == "decode"  # type: ignore[union-attr]
    # A summary.json of an older version is made again: it lacks the split.
    old = tmp_path / "fixture" / "summary.json"
    old.write_text(json.dumps({**json.loads(old.read_text()), "version": 1}))
    assert kimi_mode("--compare", a, b).returncode == 0
    assert json.loads(old.read_text())["version"] == 3


def test_kimi_mode_compare_of_a_missing_folder_or_with_a_capture_flag_is_a_usage_error(
    tmp_path: Path,
) -> None:
    shutil.copytree(FIXTURE, tmp_path / "a")
    r = kimi_mode("--compare", str(tmp_path / "a"), str(tmp_path / "missing"))
    assert r.returncode == 2 and "--compare B" in r.stderr and "No such file" in r.stderr
    r = kimi_mode("--compare", str(tmp_path / "a"), str(tmp_path / "a"), "--seconds", "3")
    assert r.returncode == 2 and "--compare takes no capture: drop --seconds" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = kimi_mode("--compare", str(tmp_path / "a"), str(empty))
    assert r.returncode == 2 and "B has no summarized rank" in r.stderr


def test_captures_of_different_collectives_or_a_lost_rank_say_so_and_show_no_zeros() -> None:
    """A split that one side lacks was read as 0 ms there (B's all-gather skew went unsaid and
    its figures showed 0.000); a rank B could not read was not said."""
    summary, _ = capture("gloo-2ranks-5ms")
    a, b = json.loads(json.dumps(summary)), json.loads(json.dumps(summary))
    del a["across_ranks"]["kinds"]["decode"]["collectives"]["all_gather"]
    del b["across_ranks"]["kinds"]["decode"]["collectives"]["all_reduce"]
    b["errors"] = [{"rank": 1, "file": "x.pt.trace.json.gz", "error": "cut short"}]
    c = compare(a, b)
    rows = {r["what"]: r for r in c["rows"]}
    assert rows["all-gather wait"]["a"] is None and rows["all-gather wait"]["delta"] is None
    assert rows["all-reduce wait"]["b"] is None
    assert any("only A has all_reduce; only B has all_gather" in n for n in c["notes"]), c
    assert any("B: rank(s) 1 could not be read" in n for n in c["notes"]), c
    TypeAdapter(OutputLine).validate_python({"v": 1, "type": "compare", "a": "A", "b": "B", **c})


def test_captures_of_different_rank_counts_are_said_not_like_for_like_in_the_verdict() -> None:
    two, _ = capture("gloo-2ranks-5ms")
    four, _ = capture("gloo-4ranks-1ms")
    said = compare(two, four)["verdict"]
    assert said.startswith("not like for like, A has 2 ranks and B 4"), said


@pytest.mark.parametrize("bad", [float("nan"), "2.6", None, float("inf")])
def test_a_summary_json_with_a_non_number_is_made_again_from_the_traces(
    tmp_path: Path, bad: object
) -> None:
    for name in ("gloo-2ranks-0ms", "gloo-2ranks-5ms"):
        shutil.copytree(FIXTURES / name, tmp_path / name)
    a, b = str(tmp_path / "gloo-2ranks-0ms"), str(tmp_path / "gloo-2ranks-5ms")
    assert kimi_mode("--summarize", b).returncode == 0
    written = tmp_path / "gloo-2ranks-5ms" / "summary.json"
    spoiled = json.loads(written.read_text())
    spoiled["across_ranks"]["kinds"]["decode"]["collectives"]["all_reduce"]["wait_ms"] = bad
    written.write_text(json.dumps(spoiled))  # NaN and Infinity as Python writes them
    r = kimi_mode("--compare", a, b, "--json")
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout)  # strict JSON: no NaN
    assert "the wait grew" in line["verdict"], line
    remade = json.loads(written.read_text())  # and written again, whole
    wait = remade["across_ranks"]["kinds"]["decode"]["collectives"]["all_reduce"]["wait_ms"]
    assert isinstance(wait, float) and math.isfinite(wait), wait


def test_captures_of_different_collectives_judge_only_the_step_not_the_wait() -> None:
    """The per-step rows sum every collective of a step; where one side has a collective the
    other lacks, they measure what is not compared (an outside review: "all-reduce wait +1.00"
    for an unchanged all-reduce beside B's new all-gather)."""
    a, _ = capture("gloo-2ranks-0ms")
    b, _ = capture("gloo-2ranks-5ms")
    a = json.loads(json.dumps(a))
    del a["across_ranks"]["kinds"]["decode"]["collectives"]["all_gather"]
    c = compare(a, b)
    assert set(c["tests"]) == {"step"} and "the wait" not in c["verdict"], c["verdict"]


@pytest.mark.parametrize(
    ("where", "bad"),
    [("device", ["cpu"]), ("errors", 5), ("errors", [{"rank": [1]}]), ("typical", ["x"]),
     ("shares", "x"), ("shares", {"1": float("nan")}), ("calls", "9"), ("by_ms", "2"),
     ("spread_ms", None)],
)  # fmt: skip
def test_a_summary_with_unhashable_or_misshapen_fields_is_refused_not_a_traceback(
    where: str, bad: object
) -> None:
    from kimi_supervisor.analysis.compare import malformed

    s, _ = capture("gloo-2ranks-5ms")
    s = json.loads(json.dumps(s))
    if where == "device":
        s["ranks"][0]["device"] = bad
    elif where == "typical":
        s["ranks"][0]["step_times"]["decode"]["typical"] = bad
    elif where in ("shares", "calls", "by_ms"):
        s["across_ranks"]["kinds"]["decode"]["collectives"]["all_reduce"]["last_to_arrive"][
            where] = bad  # fmt: skip
    elif where == "spread_ms":
        s["across_ranks"]["per_step"]["rows"][3][7] = bad
    else:
        s["errors"] = bad
    assert malformed(s), where
    with pytest.raises(CompareError, match="summary cannot be read"):
        compare(s, s)


STEADY = [5.0, 5.2, 4.9, 5.1, 5.0, 4.8, 5.2, 5.1, 4.9, 5.0, 5.1, 4.9]


@pytest.mark.parametrize(
    ("a", "b", "beyond", "run_measured"),
    [
        pytest.param([STEADY], [STEADY], False, False, id="one capture against itself is no move"),
        pytest.param([STEADY], [[x + 1 for x in STEADY]], True, False,
                     id="a 1 ms shift over 0.1 ms of step noise is beyond it"),
        pytest.param([STEADY, [x + 1.5 for x in STEADY]], [[x + 0.5 for x in STEADY]] * 2, False,
                     True, id="a shift smaller than the captures' own spread is within the noise"),
        pytest.param([STEADY] * 3, [[x + 1 for x in STEADY]] * 3, True, True,
                     id="a shift every capture agrees on is beyond the run-to-run noise"),
        pytest.param([STEADY[:3]], [[x + 9 for x in STEADY[:3]]], False, False,
                     id="three steps are too few to judge any move"),
    ],
)  # fmt: skip
def test_a_part_is_said_to_move_only_beyond_the_noise_of_its_steps_and_of_its_runs(
    a: list[list[float]], b: list[list[float]], beyond: bool, run_measured: bool
) -> None:
    t = judge(a, b, rounds=300)
    assert t["beyond"] is beyond, t
    assert (t["run_noise"] is not None) is run_measured, t


def test_three_captures_of_one_state_against_three_say_no_change_with_run_noise_measured() -> None:
    control, _ = capture("gloo-2ranks-0ms")
    delayed, _ = capture("gloo-2ranks-5ms")
    c = compare([control] * 3, [json.loads(json.dumps(control)) for _ in range(3)], rounds=200)
    assert c["verdict"].startswith("no change beyond the noise"), c["verdict"]
    assert "run to run, a bootstrap over the 3 and 3 captures of the sides" in c["verdict"]
    c = compare([control] * 3, [delayed] * 3, rounds=200)
    assert c["verdict"].startswith("the wait grew +"), c["verdict"]
    assert (
        "carried by rank 1: last to arrive in 100 % of the calls of all-gather, all-reduce, "
        "reduce-scatter in B" in c["verdict"]
    )


def test_one_capture_a_side_says_run_noise_is_unmeasured_and_still_names_the_late_rank() -> None:
    control, _ = capture("gloo-2ranks-0ms")
    delayed, _ = capture("gloo-2ranks-5ms")
    c = compare(control, delayed, rounds=200)
    assert "carried by rank 1" in c["verdict"], c["verdict"]
    assert c["verdict"].endswith("run-to-run noise not measured (one capture a side: give "
                                 "several, `A1 A2 -- B1 B2`)")  # fmt: skip
    late = {r["collective"]: r for r in c["late"]}
    assert late["all_reduce"]["b"]["rank"] == 1 and late["all_reduce"]["b"]["share"] == 1.0
    assert late["all_reduce"]["b"]["by_ms"] > 4.5  # 5 ms late, after the next latest


def test_the_verdict_never_leads_with_a_part_that_moved_less_than_its_noise() -> None:
    control, _ = capture("gloo-2ranks-0ms")
    delayed, _ = capture("gloo-2ranks-5ms")
    for a, b in ((control, delayed), (delayed, control), (control, control)):
        c = compare(a, b, rounds=200)
        head = c["verdict"].split(";")[0]
        within = [p for p, t in c["tests"].items() if not t["beyond"]]
        assert not any(head.startswith(w) for w in ("step", "transfer", *within)), c["verdict"]


def test_captures_of_one_side_with_different_rank_counts_are_refused() -> None:
    two, _ = capture("gloo-2ranks-5ms")
    four, _ = capture("gloo-4ranks-1ms")
    with pytest.raises(CompareError, match="A's captures are of 2 and 4 ranks"):
        compare([two, four], [two])


def test_kimi_mode_compare_takes_several_captures_a_side_and_folders_of_captures(
    tmp_path: Path,
) -> None:
    for side, name in (("a", "gloo-2ranks-0ms"), ("b", "gloo-2ranks-5ms")):
        for i in range(2):
            shutil.copytree(FIXTURES / name, tmp_path / side / f"capture-{i}")
    a1, a2 = (str(tmp_path / "a" / f"capture-{i}") for i in range(2))
    r = kimi_mode("--compare", a1, a2, "--", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stdout.split())  # as wrapped to the terminal's width
    assert f"A2: {a2}" in said and f"B2: {tmp_path / 'b' / 'capture-1'}" in said
    assert "carried by rank 1" in said and "last to arrive, per collective" in said
    assert "each part against its noise" in said
    r = kimi_mode("--compare", a1, a2, str(tmp_path / "b"))
    assert r.returncode == 2 and "with -- between the sides" in r.stderr
