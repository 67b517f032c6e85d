"""Which files the next vLLM will read, found from its argv, and how many of them to warm (pure).

vLLM 0.16 `serve MODEL` (or `--model MODEL`) reads a local folder when MODEL is one; otherwise
the Hugging Face snapshot of MODEL in the hub's cache: `--download-dir` when given, else
$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub, as
`models--ORG--NAME/snapshots/<commit of --revision, default main>/`. From a folder it reads the
`*.safetensors` files when there are any (else `*.bin`, `*.pt`, `*.pth`), in name order, plus
its small JSON and tokenizer files.

The warming reads at most `share` of MemAvailable (measured as it begins), in the order vLLM
reads, and skips what does not fit: the page cache it fills is not taken from the serving
vLLM's memory (MemAvailable counts only what the kernel can give back without swapping), and a
share below one leaves room for the rest of the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

WEIGHTS = (".safetensors",)
OTHER_WEIGHTS = (".bin", ".pt", ".pth")
SMALL = (".json", ".model", ".txt", ".jinja", ".tiktoken")


@dataclass(frozen=True)
class Source:
    model: str
    download_dir: str | None = None
    revision: str | None = None


def _value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def source_of(argv: Sequence[str]) -> Source | None:
    """The model vLLM's argv names: the positional after `serve`, else --model."""
    model = None
    if "serve" in argv:
        i = list(argv).index("serve")
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            model = argv[i + 1]
    model = model or _value(argv, "--model")
    if not model:
        return None
    return Source(model, _value(argv, "--download-dir"), _value(argv, "--revision"))


def hub_caches(src: Source, env: Mapping[str, str], home: str) -> list[str]:
    """Where the hub's cache may hold the model, first the one vLLM uses."""
    if src.download_dir:
        return [src.download_dir]
    if env.get("HF_HUB_CACHE"):
        return [env["HF_HUB_CACHE"]]
    if env.get("HF_HOME"):
        return [str(PurePosixPath(env["HF_HOME"]) / "hub")]
    return [str(PurePosixPath(home) / ".cache" / "huggingface" / "hub")]


def repo_folder(model: str) -> str:
    """The hub cache's folder of a repository id ("org/name" -> "models--org--name")."""
    return "models--" + model.replace("/", "--")


def candidates(src: Source, env: Mapping[str, str], home: str) -> list[dict[str, str]]:
    """Where to look for the model's folder, in vLLM's order: the local folder MODEL names
    (only that, for an absolute path), then the hub caches' repository, whose `refs/<revision>`
    names the snapshot (the reader process looks: ports/pagecache.find)."""
    local = {"root": src.model}
    if PurePosixPath(src.model).is_absolute():
        return [local]
    hub = [
        {"root": cache, "repo": repo_folder(src.model), "rev": src.revision or "main"}
        for cache in hub_caches(src, env, home)
    ]
    return [local, *hub]


def pick(names: Sequence[str]) -> list[str]:
    """Of a model folder's file names, those vLLM reads, in the order it reads them."""
    weights = [n for n in names if n.endswith(WEIGHTS)]
    if not weights:
        weights = [n for n in names if n.endswith(OTHER_WEIGHTS)]
    small = [n for n in names if n.endswith(SMALL) or n.startswith("tokenizer")]
    return sorted(set(small)) + sorted(weights, key=_natural)


def _natural(name: str) -> list[object]:
    """vLLM's order of shards: numbers compared as numbers."""
    out: list[object] = []
    digits = ""
    for c in name:
        if c.isdigit():
            digits += c
            continue
        if digits:
            out.append(int(digits))
            digits = ""
        out.append(c)
    if digits:
        out.append(int(digits))
    return [(0, x) if isinstance(x, int) else (1, x) for x in out]


@dataclass(frozen=True)
class Plan:
    read: list[tuple[str, int]]  # (file, bytes) to read, in order
    skipped: list[tuple[str, int]]  # what does not fit
    budget: int  # bytes

    @property
    def read_bytes(self) -> int:
        return sum(n for _f, n in self.read)

    @property
    def skipped_bytes(self) -> int:
        return sum(n for _f, n in self.skipped)


def plan(files: Sequence[tuple[str, int]], available: int, share: float) -> Plan:
    """The files that fit in `share` of `available`, in order; the first that does not fit
    and every one after it are skipped (vLLM reads in this order: a hole would be read cold
    while later files wait warm, the cache evicting them meanwhile)."""
    budget = int(available * share)
    read: list[tuple[str, int]] = []
    used = 0
    for i, (name, size) in enumerate(files):
        if used + size > budget:
            return Plan(read, list(files[i:]), budget)
        read.append((name, size))
        used += size
    return Plan(read, [], budget)
