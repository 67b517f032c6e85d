"""The systemd port: the only module that talks to a systemd manager (over D-Bus, via pystemd).

Calls return as soon as the manager has queued the job; callers that need to wait poll
`status()` against their own deadline. Works against the system manager or a user manager
(the sandbox's), chosen by config `systemd.scope`.
"""

from __future__ import annotations

import os
import pwd
import signal
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kimi_supervisor.model import unit_up

Who = Literal["main", "control", "all"]


class SystemdError(Exception):
    """The manager could not be reached or refused a request; the message says which and why."""


@dataclass(frozen=True)
class UnitStatus:
    unit: str
    load_state: str
    active_state: str
    sub_state: str
    main_pid: int
    exec_main_status: int
    result: str

    @property
    def up(self) -> bool:
        return unit_up(self.active_state)

    @property
    def inactive(self) -> bool:
        return self.active_state in ("inactive", "failed")


class SystemdPort(Protocol):
    def status(self, unit: str) -> UnitStatus: ...
    def start(self, unit: str) -> None: ...
    def stop(self, unit: str) -> None: ...
    def kill(self, unit: str, who: Who, sig: int) -> None: ...
    def reset_failed(self, unit: str) -> None: ...
    def cgroup_pids(self, unit: str) -> list[int]: ...
    def activated_at(self, unit: str) -> float | None: ...
    def run_as(self, unit: str) -> int | None: ...
    def environment(self, unit: str) -> dict[str, str]: ...
    def daemon_reload(self) -> None: ...
    def jobs(self) -> dict[str, str]: ...
    def move_to_scope(
        self, name: str, pid: int, description: str, *, devices: bool = False
    ) -> None: ...


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class PystemdSystemd:
    """SystemdPort over pystemd. One D-Bus connection, opened lazily and reopened after errors;
    use it from one thread."""

    def __init__(self, scope: Literal["system", "user"] = "system", bus_address: str = "") -> None:
        self.scope = scope
        self.bus_address = bus_address
        self._bus: Any = None
        # Loaded proxies ("" is the manager), by unit name. Loading introspects the object (an
        # XML parse, most of a call's cost); properties are still read fresh on every call.
        self._units: dict[str, Any] = {}

    # -- connection --
    def _connect(self) -> Any:
        if self._bus is not None:
            return self._bus
        from pystemd.dbuslib import DBus, DBusAddress

        if self.scope == "system":
            bus = DBus(user_mode=False)
        else:
            address = self.bus_address or os.environ.get("DBUS_SESSION_BUS_ADDRESS", "")
            if not address:
                raise SystemdError(
                    "systemd scope is 'user' but no bus address is known: set "
                    "systemd.bus_address or DBUS_SESSION_BUS_ADDRESS"
                )
            bus = DBusAddress(address.encode())
        try:
            bus.open()
        except Exception as e:
            raise SystemdError(f"cannot connect to the {self.scope} systemd manager: {e}") from e
        self._bus = bus
        return bus

    def close(self) -> None:
        self._units.clear()
        if self._bus is not None:
            try:
                self._bus.close()
            finally:
                self._bus = None

    def _unit(self, unit: str) -> Any:
        from pystemd.systemd1 import Unit

        if unit in self._units:
            return self._units[unit]
        try:
            u = Unit(unit.encode(), bus=self._connect())
            u.load()
            self._units[unit] = u
            return u
        except SystemdError:
            raise
        except Exception as e:
            self.close()
            raise SystemdError(f"{unit}: cannot load from the {self.scope} manager: {e}") from e

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            # A broken connection is reopened on the next call; the error says what failed.
            self.close()
            raise SystemdError(f"{what} failed: {e}") from e

    def _manager(self) -> Any:
        if "" in self._units:
            return self._units[""]
        from pystemd.systemd1 import Manager

        m = Manager(bus=self._connect())
        try:
            m.load()
        except Exception as e:
            self.close()
            raise SystemdError(f"cannot reach the {self.scope} manager: {e}") from e
        self._units[""] = m
        return m

    # -- the port --
    def status(self, unit: str) -> UnitStatus:
        """Two round trips while the unit runs (ListUnitsByNames, MainPID): the daemon calls this
        on every tick, and every blocking round trip costs a wake-up."""
        m = self._manager()

        def read() -> UnitStatus:
            rows = m.Manager.ListUnitsByNames([unit.encode()])
            _name, _desc, load, active, sub, *_rest = rows[0]
            load_state, active_state = _s(load), _s(active)
            main_pid, exec_status, result = 0, 0, ""
            # A running unit whose file was moved away reads "not-found" after a daemon-reload
            # and still runs its MainPID: read it, or a healthy vLLM would read as dead.
            if load_state == "loaded" or active_state not in ("inactive", "failed"):
                service = self._unit(unit).Service
                main_pid = int(service.MainPID)
                if active_state in ("inactive", "failed"):
                    exec_status, result = int(service.ExecMainStatus), _s(service.Result)
            return UnitStatus(
                unit=unit,
                load_state=load_state,
                active_state=active_state,
                sub_state=_s(sub),
                main_pid=main_pid,
                exec_main_status=exec_status,
                result=result,
            )

        return self._call(f"reading {unit}", read)  # type: ignore[no-any-return]

    def start(self, unit: str) -> None:
        u = self._unit(unit)
        self._call(f"starting {unit}", u.Unit.Start, b"replace")

    def stop(self, unit: str) -> None:
        u = self._unit(unit)
        self._call(f"stopping {unit}", u.Unit.Stop, b"replace")

    def kill(self, unit: str, who: Who, sig: int) -> None:
        u = self._unit(unit)
        self._call(
            f"killing {unit} ({who}, {signal.Signals(sig).name})", u.Unit.Kill, who.encode(), sig
        )

    def reset_failed(self, unit: str) -> None:
        u = self._unit(unit)
        self._call(f"reset-failed {unit}", u.Unit.ResetFailed)

    def activated_at(self, unit: str) -> float | None:
        """When the unit last left `inactive` (epoch seconds; None if never, or unknown)."""
        u = self._unit(unit)
        usec = int(self._call(f"reading {unit}", lambda: u.Unit.InactiveExitTimestamp))
        return usec / 1e6 if usec > 0 else None

    def run_as(self, unit: str) -> int | None:
        """The uid the unit's processes run as: its `User=`, a number or a name resolved here;
        none set, the manager's own user (root for the system manager; for a user manager, this
        process's user, which that manager runs the daemon as). None when it cannot be said: the
        unit is not loaded, its user has no entry (yet), or it has `DynamicUser=` (a uid picked
        at each start)."""
        u = self._unit(unit)

        def read() -> tuple[str, str, bool]:
            return _s(u.Unit.LoadState), _s(u.Service.User), bool(u.Service.DynamicUser)

        load_state, user, dynamic = self._call(f"reading {unit}", read)
        if load_state != "loaded" or dynamic:
            return None
        if not user:
            return 0 if self.scope == "system" else os.geteuid()
        if user.isdigit():
            return int(user)
        try:
            return pwd.getpwnam(user).pw_uid
        except KeyError:
            return None

    def environment(self, unit: str) -> dict[str, str]:
        """The unit's `Environment=` as the manager holds it (not what an `EnvironmentFile=`
        adds: the manager reads those files only when it starts the unit)."""
        u = self._unit(unit)
        pairs = self._call(f"reading {unit}'s environment", lambda: list(u.Service.Environment))
        return dict(_s(p).split("=", 1) for p in pairs if "=" in _s(p))

    def cgroup_pids(self, unit: str) -> list[int]:
        u = self._unit(unit)

        def read() -> list[int]:
            # A unit running with its file gone ("not-found", "masked") still has processes.
            loaded = _s(u.Unit.LoadState) == "loaded"
            if not loaded and _s(u.Unit.ActiveState) in ("inactive", "failed"):
                return []
            return sorted({int(pid) for _path, pid, _cmd in u.Service.GetProcesses()})

        return self._call(f"listing the processes of {unit}", read)  # type: ignore[no-any-return]

    def daemon_reload(self) -> None:
        self._call("daemon-reload", self._manager().Manager.Reload)

    def jobs(self) -> dict[str, str]:
        """Unit -> the type of the job queued or running for it ("restart", "start", ...)."""
        rows = self._call("listing jobs", self._manager().Manager.ListJobs)
        return {_s(name): _s(kind) for _id, name, kind, *_rest in rows}

    def move_to_scope(
        self, name: str, pid: int, description: str, *, devices: bool = False
    ) -> None:
        """Move `pid` into a new transient scope `name` (as `systemd-run --scope` does): its
        own cgroup, outside the caller's unit, so that the unit's stop never waits for it. The
        scope is collected once empty; it allows only the standard pseudo devices, unless
        `devices` (NVML's process opens the GPUs' nodes)."""
        properties: dict[bytes, Any] = {
            b"Description": description.encode(),
            b"CollectMode": b"inactive-or-failed",
            b"_custom": (b"PIDs", b"au", [pid]),  # pystemd knows no signature for PIDs
        }
        if not devices:
            properties[b"DevicePolicy"] = b"closed"
        self._call(
            f"making the scope {name} for PID {pid}",
            self._manager().Manager.StartTransientUnit,
            name.encode(),
            b"fail",
            properties,
        )
