"""Test doubles for the product's ports, kept out of the product: a clock that moves only when
slept on, and a systemd port for hosts without systemd (the lent GPU host)."""

from __future__ import annotations

from kimi_supervisor.ports.systemd import SystemdError, UnitStatus, Who


class FakeClock:
    """A clock that moves only when slept on: deterministic deadlines in tests."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


class NoSystemd:
    """For hosts without systemd (the lent GPU test host): the unit is reported not loaded and
    inactive, and start/stop/kill are refused. A teardown then starts at its stray step, with the
    unit's processes started by the caller."""

    def status(self, unit: str) -> UnitStatus:
        return UnitStatus(unit, "not-found", "inactive", "dead", 0, 0, "")

    def start(self, unit: str) -> None:
        raise SystemdError(f"cannot start {unit}: no systemd on this host")

    def stop(self, unit: str) -> None:
        pass  # nothing to stop: the unit does not exist here

    def kill(self, unit: str, who: Who, sig: int) -> None:
        pass

    def reset_failed(self, unit: str) -> None:
        pass

    def cgroup_pids(self, unit: str) -> list[int]:
        return []

    def activated_at(self, unit: str) -> float | None:
        return None

    def environment(self, unit: str) -> dict[str, str]:
        return {}

    def run_as(self, unit: str) -> int | None:
        return None  # no unit: only the uids of the processes the caller started count

    def daemon_reload(self) -> None:
        pass

    def jobs(self) -> dict[str, str]:
        return {}

    def move_to_scope(self, name: str, pid: int, description: str, devices: bool = False) -> None:
        raise SystemdError(f"cannot make the scope {name}: no systemd on this host")
