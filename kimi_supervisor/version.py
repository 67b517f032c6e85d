"""The installed package's version, for `--version` (one definition for both commands)."""

from __future__ import annotations


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kimi-supervisor")
    except PackageNotFoundError:
        return "unknown (not installed)"
