"""A switch's unavailable window and its parts (decide/downtime.py), what vLLM's argv says it
will read (decide/warmset.py), and the loop measuring both: the window in the transition's
record, status and the ETA; a warming that the switch's teardown waits for, and that neither
a --force switch nor a stop waits for."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_supervisor.decide import downtime, warmset
from kimi_supervisor.decide.downtime import Stopwatch
from kimi_supervisor.decide.progress import Progress
from kimi_supervisor.loop.inbox import Stop, Switch
from kimi_supervisor.model import Mode, State

from .loophost import LoopHost


def watch(**marks: float) -> Stopwatch:
    w = Stopwatch()
    for name, t in marks.items():
        w.mark(name, t)
    return w


def test_the_parts_of_a_window_add_up_to_it_from_the_last_200_to_the_first() -> None:
    w = watch(last_ok=100, exited=102.5, clean=103, weights=110, api=133, ready=134.5)
    assert w.parts() == {"old_exit": 2.5, "teardown": 0.5, "to_weights": 7.0,
                         "engine_init": 23.0, "to_ready": 1.5}  # fmt: skip
    assert w.window_s() == 34.5 == sum(w.parts().values())
    assert w.part_now() is None


def test_a_mark_vllm_never_printed_merges_its_part_into_the_next() -> None:
    w = watch(last_ok=0, exited=2, clean=3, api=30, ready=31)  # no shard bar, no weights line
    assert w.parts() == {"old_exit": 2, "teardown": 1, "engine_init": 27, "to_ready": 1}
    assert sum(w.parts().values()) == w.window_s()


def test_with_nothing_served_before_there_is_no_window_but_the_parts_from_the_teardown_on() -> None:
    w = watch(exited=2, clean=3, weights=5, api=9, ready=10)
    assert w.window_s() is None
    assert w.parts() == {"teardown": 1, "to_weights": 2, "engine_init": 4, "to_ready": 1}
    assert downtime.describe(w.record()).startswith("nothing served before:")


def test_a_window_that_went_on_through_a_failed_start_counts_it_as_earlier() -> None:
    w = watch(last_ok=0, resumed=60, exited=61, clean=62, weights=70, api=90, ready=91)
    assert w.parts()["earlier"] == 60 and w.window_s() == 91 == sum(w.parts().values())


def test_the_weights_count_as_loaded_at_the_shard_bar_s_100_or_at_vllm_s_line() -> None:
    w = watch(last_ok=0, exited=1, clean=2)
    w.saw(Progress("loading", 50), 3)
    assert "weights" not in w.at
    w.saw(Progress("loading", 100), 4)
    w.saw(Progress("loaded"), 5)
    w.saw(Progress("api"), 20)
    assert (w.at["weights"], w.at["api"]) == (4, 20)
    early = watch(last_ok=0)  # output before the teardown ended is the old vLLM's
    early.saw(Progress("api"), 1)
    assert "api" not in early.at


def test_what_is_left_is_the_rest_of_the_part_under_way_and_every_part_after_it() -> None:
    past = [{"kind": "transition", "outcome": "ready", "target": "profile", "argv_key": "k",
             "downtime": {"parts": {"old_exit": o, "teardown": 1, "to_weights": 10,
                                    "engine_init": 20, "to_ready": 2}}}
            for o in (3, 5, 4)]  # fmt: skip
    expected = downtime.expected_parts(past, "profile", "k")
    assert expected == {"old_exit": 4, "teardown": 1, "to_weights": 10, "engine_init": 20,
                        "to_ready": 2}  # fmt: skip
    assert downtime.expected_parts(past, "production", "k") == {}
    w = watch(last_ok=0, exited=4, clean=5, weights=13)
    assert w.part_now() == "engine_init"
    assert downtime.remaining_s(expected, w, now=18) == 15 + 2  # 5 s into 20 s, then to_ready
    assert downtime.remaining_s(expected, w, now=60) == 2  # overdue: never below zero
    assert downtime.remaining_s({"old_exit": 1}, w, now=18) is None  # the past lacks them all
    merged = {"old_exit": 4, "teardown": 1, "to_ready": 30}  # vLLM printed no progress then
    assert downtime.remaining_s(merged, w, now=18) == 30


@pytest.mark.parametrize(
    ("argv", "source"),
    [
        (["vllm", "serve", "org/m", "--tp", "8"], warmset.Source("org/m")),
        (["python", "-m", "vllm.entrypoints.openai.api_server", "--model=/m"],
         warmset.Source("/m")),
        (["vllm", "serve", "org/m", "--download-dir", "/d", "--revision=abc"],
         warmset.Source("org/m", "/d", "abc")),
        (["vllm", "serve", "--model", "org/m"], warmset.Source("org/m")),
        (["python", "-c", "code"], None),
    ],
)  # fmt: skip
def test_the_model_is_found_in_vllm_s_argv_as_vllm_reads_it(
    argv: list[str], source: warmset.Source | None
) -> None:
    assert warmset.source_of(argv) == source


def test_the_hub_cache_is_the_one_vllm_uses_first() -> None:
    src = warmset.Source("org/m")
    home = "/root"
    assert warmset.hub_caches(src, {}, home) == ["/root/.cache/huggingface/hub"]
    assert warmset.hub_caches(src, {"HF_HOME": "/hf"}, home) == ["/hf/hub"]
    assert warmset.hub_caches(src, {"HF_HOME": "/hf", "HF_HUB_CACHE": "/c"}, home) == ["/c"]
    assert warmset.hub_caches(warmset.Source("org/m", "/d"), {"HF_HUB_CACHE": "/c"}, home) == ["/d"]
    assert warmset.repo_folder("moonshotai/Kimi-K2.5") == "models--moonshotai--Kimi-K2.5"


def test_the_files_are_vllm_s_and_in_its_order_safetensors_before_any_bin() -> None:
    names = ["model-10-of-12.safetensors", "model-2-of-12.safetensors", "pytorch_model.bin",
             "config.json", "tokenizer.model", "README.md", "original"]  # fmt: skip
    assert warmset.pick(names) == ["config.json", "tokenizer.model", "model-2-of-12.safetensors",
                                   "model-10-of-12.safetensors"]  # fmt: skip
    assert warmset.pick(["a.bin", "b.json"]) == ["b.json", "a.bin"]


def test_what_does_not_fit_is_skipped_from_the_first_file_that_does_not() -> None:
    files = [("a", 40), ("b", 40), ("c", 40), ("d", 1)]
    p = warmset.plan(files, available=200, share=0.5)  # 100 bytes
    assert (p.read, p.skipped, p.budget) == ([("a", 40), ("b", 40)], [("c", 40), ("d", 1)], 100)
    assert warmset.plan(files, available=1000, share=0.5).skipped == []


# ---------------------------------------------------------------------------------- the loop
@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model-00001-of-00002.safetensors").write_bytes(os.urandom(1 << 20))
    return d


def make_host(tmp_path: Path, model: Path, warm: str = "") -> LoopHost:
    return LoopHost(tmp_path, model=model, extra=f"[warm]\n{warm}")


@pytest.fixture
def host(tmp_path: Path, model: Path) -> Iterator[LoopHost]:
    h = make_host(tmp_path, model)
    try:
        yield h
    finally:
        h.close()


def test_a_switch_records_its_window_and_parts_in_history_status_and_the_ready_event(
    host: LoopHost,
) -> None:
    host.serving(Mode.PRODUCTION)
    first = host.history("transition")[-1]
    assert first["downtime"]["window_s"] is None  # a boot: nothing served before
    host.ask(Switch(Mode.PROFILE, "op"))
    host.serving(Mode.PROFILE)
    d = host.history("transition")[-1]["downtime"]
    assert d["window_s"] is not None and d["window_s"] >= 0
    assert {"old_exit", "teardown", "to_ready"} <= set(d["parts"])
    assert abs(sum(d["parts"].values()) - d["window_s"]) < 0.01
    assert d["warm"]["read_bytes"] == (1 << 20) + 2  # the model's files, read while serving
    status = host.status()["downtime"]
    assert (status["target"], status["under_way"], status["window_s"]) == (
        "profile", False, d["window_s"]
    )  # fmt: skip
    assert status["text"].startswith("unavailable ")


def test_a_warming_that_does_not_fit_is_skipped_and_says_so(tmp_path: Path, model: Path) -> None:
    # A shard larger than the host's memory (sparse: it takes no disk).
    with open(model / "model-00002-of-00002.safetensors", "wb") as f:
        f.truncate(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 2)
    h = make_host(tmp_path, model)
    try:
        h.serving(Mode.PRODUCTION)
        h.ask(Switch(Mode.PROFILE, "op"))
        h.serving(Mode.PROFILE)
        warm = h.history("transition")[-1]["downtime"]["warm"]
        assert warm["read_bytes"] == (1 << 20) + 2 and warm["skipped_bytes"] > 0
        said = [x for x in h.lines if x["event"] == "warmed"][-1]
        assert said["skipped"] == ["model-00002-of-00002.safetensors"]
        assert "do not fit in warm.max_ram_share of MemAvailable" in said["text"]
    finally:
        h.close()


@pytest.fixture
def slow_host(tmp_path: Path, model: Path) -> Iterator[LoopHost]:
    """A model whose warming lasts (64 GB of holes read at a few GB/s, one file at a time)."""
    for i in range(8):
        with open(model / f"model-{i + 3:05d}-of-00010.safetensors", "wb") as f:
            f.truncate(8 << 30)
    h = make_host(tmp_path, model, "max_ram_share = 0.9\nthreads = 1")
    try:
        yield h
    finally:
        h.close()


def warming(h: LoopHost) -> None:
    s = h.daemon.s
    h.until(lambda: s.warm is not None and s.warm.read_bytes > 0, "the warming to read")
    assert s.state is State.WARMING and s.serving is not None  # the old mode serves meanwhile
    status = h.status()
    assert status["mode"] == "production" and status["warm"]["under_way"]


def test_a_forced_switch_during_a_warming_does_not_wait_for_it(slow_host: LoopHost) -> None:
    h = slow_host
    h.serving(Mode.PRODUCTION)
    h.ask(Switch(Mode.PROFILE, "op"))
    warming(h)
    forced = h.ask(Switch(Mode.PRODUCTION, "op2", force=True))
    assert forced.code == "accepted"
    h.until(lambda: h.daemon.s.state is not State.WARMING, "the warming to stop")
    said = [x for x in h.lines if x["event"] == "warmed"][-1]
    assert said["stopped"] == "aborted" and said["read_bytes"] < said["bytes"]
    assert said["abandoned"] == 0 and "a --force switch to production took over" in said["text"]
    h.serving(Mode.PRODUCTION)
    assert h.systemd.starts == [Mode.PRODUCTION, Mode.PRODUCTION]


def test_a_stop_during_a_warming_does_not_wait_for_it(slow_host: LoopHost) -> None:
    h = slow_host
    h.serving(Mode.PRODUCTION)
    h.ask(Switch(Mode.PROFILE, "op"))
    warming(h)
    h.daemon.ask(Stop())
    h.until(lambda: h.daemon.s.stopped_clean is not None, "the daemon to stop")
    said = [x for x in h.lines if x["event"] == "warmed"][-1]
    assert said["stopped"] == "aborted" and said["read_bytes"] < said["bytes"]
    assert said["abandoned"] == 0  # reads that progress end when their reader is killed
    assert h.systemd.starts == [Mode.PRODUCTION]  # profile was never started


def test_a_vllm_that_exits_during_a_warming_ends_it_and_the_switch_goes_on(
    slow_host: LoopHost,
) -> None:
    h = slow_host
    h.serving(Mode.PRODUCTION)
    h.ask(Switch(Mode.PROFILE, "op"))
    warming(h)
    assert h.systemd.child is not None
    h.systemd.child.kill()  # the old vLLM, the test's own child
    h.until(lambda: h.daemon.s.state is not State.WARMING, "the warming to stop")
    said = [x for x in h.lines if x["event"] == "warmed"][-1]
    assert said["stopped"] == "aborted" and "stopped: the old vLLM exited" in said["text"]
    h.serving(Mode.PROFILE)
    assert h.systemd.starts == [Mode.PRODUCTION, Mode.PROFILE]


def test_the_eta_of_a_load_is_made_of_the_past_switches_parts(host: LoopHost) -> None:
    host.serving(Mode.PRODUCTION)
    for mode in (Mode.PROFILE, Mode.PRODUCTION):
        host.ask(Switch(mode, "op"))
        host.serving(mode)
    host.systemd.load_s = 1.0  # the next load lasts a second of the fake clock
    host.ask(Switch(Mode.PROFILE, "op"))
    host.until(lambda: bool(host.status()["eta"]), "the ETA of the load")
    eta = host.status()["eta"]
    assert "(now: start to weights loaded)" in eta["text"], eta
    under_way = host.status()["downtime"]
    assert under_way["under_way"] and under_way["part"] == "to_weights"
    host.serving(Mode.PROFILE)
