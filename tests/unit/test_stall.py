"""What a capture cost serving (capture/stall.py), read from vLLM's own counters: a real vLLM
0.16 /metrics answer (tests/fixtures/vllm-0.16-metrics.txt, from the real-vLLM tier in profile
mode) and readings around a capture."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_supervisor.capture.stall import MIN_BEFORE_S, Sample, Stall, pick_before, sample_of

REAL = (Path(__file__).parents[1] / "fixtures" / "vllm-0.16-metrics.txt").read_text()


def test_a_real_vllm_answer_gives_its_generated_tokens_and_no_failures() -> None:
    got = sample_of(REAL, 7.0)
    assert got == Sample(7.0, 50.0, 0.0, 0.0, started=1.79641735503e09)


def test_client_errors_and_abandoned_requests_count_but_the_profilers_own_routes_do_not() -> None:
    extra = (
        'http_requests_total{handler="/v1/completions",method="POST",status="5xx"} 3.0\n'
        'http_requests_total{handler="/stop_profile",method="POST",status="5xx"} 1.0\n'
        'http_requests_total{handler="/v1/completions",method="POST",status="4xx"} 9.0\n'
    )
    # Two requests ended with an engine error, one was given up by its client.
    text = REAL.replace(
        'finished_reason="error",model_name="/var/cache/kimi-supervisor-tests/tiny-llama-'
        '151c0f78fd"} 0.0',
        'finished_reason="error",model_name="/var/cache/kimi-supervisor-tests/tiny-llama-'
        '151c0f78fd"} 2.0',
    ).replace(
        'finished_reason="abort",model_name="/var/cache/kimi-supervisor-tests/tiny-llama-'
        '151c0f78fd"} 0.0',
        'finished_reason="abort",model_name="/var/cache/kimi-supervisor-tests/tiny-llama-'
        '151c0f78fd"} 1.0',
    )
    text = text.replace("# HELP http_requests_total", extra + "# HELP http_requests_total", 1)
    got = sample_of(text, 0.0)
    assert isinstance(got, Sample) and (got.failed, got.aborted) == (5.0, 1.0)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no vllm:generation_tokens_total"),
        ("# HELP python_info x\n# TYPE python_info gauge\npython_info 1.0\n", "no vllm:gen"),
        ("not { metrics", "not Prometheus text"),
    ],
)
def test_an_answer_without_vllms_token_counter_is_no_reading_and_says_why(
    text: str, why: str
) -> None:
    got = sample_of(text, 0.0)
    assert isinstance(got, str) and why in got


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3.0", "1e300"])
@pytest.mark.parametrize(
    "series",
    [
        'vllm:generation_tokens_total{engine="0",model_name="m"}',
        'http_requests_total{handler="/v1/completions",method="POST",status="5xx"}',
        'vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"}',
    ],
)
def test_a_counter_that_is_no_count_is_no_reading_never_a_number_told(
    series: str, value: str
) -> None:
    """An outside review: +Inf in a failure counter failed a capture whose traces were saved
    (OverflowError), and NaN gave "nan tokens/s" and a history line that is not JSON."""
    name = series.split("{")[0]
    family = name.removesuffix("_total")
    text = f"# TYPE {family} counter\n{series} {value}\n"
    if not name.startswith("vllm:generation"):
        text += "# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total 5.0\n"
    got = sample_of(text, 0.0)
    assert isinstance(got, str) and "not a count" in got, got


def test_each_window_is_a_rate_and_the_line_says_what_the_clients_lost() -> None:
    stall = Stall.of(
        (Sample(0, 0), Sample(10, 1000), Sample(20, 1500), Sample(32, 1500), Sample(42, 2500))
    )
    d = stall.as_dict()
    assert d["before"] == {"seconds": 10.0, "tokens_per_s": 100.0}
    assert d["recording"] == {"seconds": 10.0, "tokens_per_s": 50.0}
    assert d["flush"] == {"seconds": 12.0, "tokens_per_s": 0.0}
    assert d["after"] == {"seconds": 10.0, "tokens_per_s": 100.0}
    assert (d["slowdown"], d["failed"], d["aborted"]) == (0.5, 0, 0)
    assert stall.line() == (
        "serving: 100 tokens/s before, 50 tokens/s while recording (50 % slower), "
        "0 tokens/s in the 12.0 s flush, 100 tokens/s after; no request failed"
    )


def test_failures_count_from_the_profilers_start_to_the_last_reading_of_the_same_vllm() -> None:
    stall = Stall.of(
        (Sample(0, 0), Sample(10, 100, 1, 0), Sample(20, 200, 1, 0), Sample(30, 200, 4, 2),
        Sample(40, 300, 5, 2)),
    )  # fmt: skip
    assert (stall.failed, stall.aborted) == (4, 2)
    assert stall.line().endswith("; 4 request(s) failed, 2 given up by their clients")


def test_a_vllm_restarted_between_two_readings_is_told_by_its_start_time_not_its_counters() -> None:
    """The new vLLM's counter already past the old one's: only its start time tells."""
    old, new = 1.0e9, 1.0e9 + 700
    stall = Stall.of(
        (Sample(0, 0, started=old), Sample(10, 100, started=old), Sample(40, 140, started=old),
        Sample(52, 150, started=old), Sample(652, 5000, started=new)),
    )  # fmt: skip
    after = stall.as_dict()["after"]
    assert after["tokens_per_s"] is None and "started at another time" in after["not_measured"]
    assert stall.failed == 0  # counted to the flush's end, the last reading of that vLLM


def test_abandoned_requests_going_back_is_another_vllm_never_a_negative_count() -> None:
    stall = Stall.of((Sample(0, 0), Sample(10, 100, 0, 5), Sample(20, 200, 0, 5),
                     Sample(30, 300, 0, 1), "x"))  # fmt: skip
    assert stall.as_dict()["flush"]["tokens_per_s"] is None
    assert stall.aborted == 0 and "-" not in stall.line()


def test_a_window_whose_counters_went_back_is_not_measured_never_a_negative_rate() -> None:
    """Another vLLM answered (a restart in between: the counters start again at 0)."""
    stall = Stall.of((Sample(0, 0), Sample(10, 1000), Sample(20, 1500), Sample(32, 1500),
                     Sample(42, 20)))  # fmt: skip
    after = stall.as_dict()["after"]
    assert after["tokens_per_s"] is None and "went back" in after["not_measured"]
    # The failures still count up to the flush's end, the last reading of this vLLM.
    assert stall.failed == 0


def test_a_missing_reading_says_why_in_each_window_it_opens_or_closes() -> None:
    stall = Stall.of(
        ("no liveness reading of this vLLM yet", Sample(10, 1000), "/metrics: timed out",
        Sample(32, 1500), "profiling.stall_after_s is 0"),
    )  # fmt: skip
    d = stall.as_dict()
    assert d["before"]["not_measured"] == "no liveness reading of this vLLM yet"
    assert d["recording"]["not_measured"] == "/metrics: timed out"
    assert d["flush"]["not_measured"] == "/metrics: timed out"
    assert d["after"]["not_measured"] == "profiling.stall_after_s is 0"
    assert d["slowdown"] is None and d["failed"] == 0
    line = stall.line()
    assert "before not measured (no liveness reading of this vLLM yet)" in line
    assert "while recording not measured (/metrics: timed out)" in line


def test_no_reading_after_the_profilers_start_leaves_the_failures_uncounted() -> None:
    stall = Stall.of((Sample(0, 0), "/metrics: refused", "x", "y", "z"))
    assert stall.failed is None
    assert stall.line().endswith("failed requests not counted (no reading spans the capture)")


def test_the_before_window_opens_at_this_vllms_newest_reading_old_enough_to_give_a_rate() -> None:
    readings = [(80.0, 7, 10.0), (90.0, 7, 20.0), (97.0, 7, 27.0), (99.0, 8, 1.0)]
    assert pick_before(readings, 7, 100.0) == Sample(90.0, 20.0)  # 97 is under 5 s old
    assert pick_before(readings, 8, 100.0) == f"its only reading is under {MIN_BEFORE_S:g} s old"
    assert pick_before(readings, 9, 100.0) == "no liveness reading of this vLLM yet"


def test_a_counter_is_believed_only_within_what_this_vllm_can_do() -> None:
    """10 times the fastest this vLLM has shown (its liveness readings), within MIN_CEILING and
    MAX_TOKENS_PER_S: a counter that jumps 9,000-fold under the absolute ceiling is no rate."""
    from kimi_supervisor.capture.stall import MIN_CEILING, ceiling_of

    seen = [(0.0, 7, 0.0), (10.0, 7, 1000.0), (20.0, 7, 2000.0), (5.0, 8, 9e9)]
    assert ceiling_of(seen, 7) == MIN_CEILING  # 100 tokens/s: 1000, raised to the floor
    assert ceiling_of([(0.0, 7, 0.0), (1.0, 7, 20_000.0)], 7) == 200_000
    stall = Stall.of(
        (Sample(0, 100), Sample(10, 1100), Sample(20, 1100 + 9_000_000), "x", "y"),
        ceiling=ceiling_of(seen, 7),
    )  # fmt: skip
    assert stall.get("recording").tokens_per_s is None
    assert "past what this vLLM can make" in stall.get("recording").why_not


@pytest.mark.parametrize(
    ("edges", "measured", "failed"),
    [
        pytest.param(
            [(0, 10), (10, 2**53)],
            [False, False, False, False],
            None,
            id="a counter that jumps by 2**53 is not measured, nor any window after it",
        ),
        pytest.param(
            [(0, 100), (10, 1100), (20, 50), (30, 150)],
            [True, False, False, False],
            None,
            id="after a counter went back no later window is believed",
        ),
        pytest.param(
            [(0, 100), (10, 1100), (20, 2100), (30, 3100), (40, 4100)],
            [True, True, True, True],
            0,
            id="counters that rise as a host can are measured in every window",
        ),
        pytest.param(
            [(0, 100), (10, 100 + 9_000_000), (20, 9_001_100)],
            [True, True, False, False],
            0,
            id="900000 tokens a second is still a host's and is measured",
        ),
    ],
)
def test_a_counter_is_believed_only_within_what_a_host_can_do(
    edges: list[tuple[float, float]], measured: list[bool], failed: int | None
) -> None:
    readings: list[Sample | str | None] = [Sample(at, tokens) for at, tokens in edges]
    readings += ["not reached"] * (5 - len(readings))
    stall = Stall.of(readings)
    assert [w.tokens_per_s is not None for w in stall.windows] == measured
    assert stall.failed == failed
    for w in stall.windows:
        assert w.tokens_per_s is None or w.tokens_per_s <= 1_000_000
        assert (w.tokens_per_s is None) == bool(w.why_not)
