"""Two captures side by side (`kimi-mode capture --compare A B`, analysis/compare.py): the
synthetic captures of tests/synthetic_traces.py, with the skew or the transfer
changed between them, and the 2x H200 fixture."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from kimi_supervisor.analysis.compare import CompareError, compare, verdict
from kimi_supervisor.analysis.ranks import summarize_folder
from kimi_supervisor.cli.output import OutputLine
from kimi_supervisor.ports.safeopen import try_open
from tests.synthetic_traces import write_capture

from .test_capture import FIXTURE, kimi_mode

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
    assert (
        "the skew went down by -0.300 ms per call (all-reduce arrival spread p50), "
        "all-reduce wait -1.80 ms per step" in c["verdict"]
    )
    assert c["kind"] == "decode" and not c["notes"]


def test_slower_transfers_read_as_the_data_moving_slower(tmp_path: Path) -> None:
    write_capture(tmp_path / "a", world=2, steps=STEPS, layers=LAYERS, transfer_us=30.0)
    write_capture(tmp_path / "b", world=2, steps=STEPS, layers=LAYERS, transfer_us=130.0)
    c = compare(
        summarize_folder(tmp_path / "a", try_open)[0], summarize_folder(tmp_path / "b", try_open)[0]
    )
    assert "all-reduce transfer +0.80 ms per step: the data moves slower" in c["verdict"]


def test_a_capture_against_itself_moves_nothing_beyond_the_noise_floor(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "a")
    s = summarize_folder(tmp_path / "a", try_open)[0]
    c = compare(s, s)
    assert all(r["delta"] == 0 for r in c["rows"] + c["top"])
    assert "nothing moved by more than the noise floor" in c["verdict"]


def test_captures_of_different_step_kinds_are_refused_with_what_to_do(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "a")
    s = summarize_folder(tmp_path / "a", try_open)[0]
    prefill = json.loads(json.dumps(s))
    for r in prefill["ranks"]:
        r["scope"] = "prefill steps"
    with pytest.raises(CompareError, match="compare two captures of the same load"):
        compare(s, prefill)


def test_kimi_mode_compare_needs_no_daemon_prints_the_verdict_and_validates_as_json(
    tmp_path: Path,
) -> None:
    shutil.copytree(FIXTURE, tmp_path / "fixture")
    write_capture(tmp_path / "synthetic", world=2, steps=STEPS, layers=4, late=0, late_us=200.0)
    a, b = str(tmp_path / "fixture"), str(tmp_path / "synthetic")
    r = kimi_mode("--compare", a, b)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[:2] == [f"A: {a}", f"B: {b}"]
    assert "verdict: decode step p50" in r.stdout and "all-reduce wait" in r.stdout
    r = kimi_mode("--compare", a, b, "--json")
    assert r.returncode == 0, r.stderr
    line = TypeAdapter(OutputLine).validate_json(r.stdout)
    assert line.type == "compare" and line.kind == "decode"  # type: ignore[union-attr]
    # A summary.json of an older version is made again: it lacks the split.
    old = tmp_path / "fixture" / "summary.json"
    old.write_text(json.dumps({**json.loads(old.read_text()), "version": 1}))
    assert kimi_mode("--compare", a, b).returncode == 0
    assert json.loads(old.read_text())["version"] == 2


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


def test_a_rank_late_before_each_collective_reads_as_skew_though_one_transfer_moved_more() -> None:
    """Measured on real gloo traces (2 ranks, one 1 ms late before each of three collectives):
    each wait grew 0.4-0.6 ms, the all-reduce's transfer 0.87 ms by chance. Judged one figure at
    a time that read "the data moves slower"; the waits, summed over the step, are the skew."""
    fa = {"step p50": 5.6, "compute": 2.34}
    fb = {"step p50": 9.5, "compute": 1.63}
    for coll, (wa, wb, ta, tb, sa, sb) in {
        "all-gather": (0.076, 0.661, 0.967, 0.865, 0.037, 1.198),
        "all-reduce": (0.333, 0.705, 1.088, 1.956, 0.142, 1.135),
        "reduce-scatter": (0.183, 0.599, 1.246, 1.392, 0.184, 1.101),
    }.items():
        fa |= {f"{coll} wait": wa, f"{coll} transfer": ta, f"{coll} arrival spread p50": sa}
        fb |= {f"{coll} wait": wb, f"{coll} transfer": tb, f"{coll} arrival spread p50": sb}
    said = verdict(fa, fb, "decode")
    assert "the skew went up by +1.161 ms per call (all-gather arrival spread p50)" in said, said
    assert "the collectives' wait +1.37 ms per step" in said, said
