"""The event bus: the loop publishes, connection threads subscribe. A subscriber that falls
behind (a stuck client) loses its subscription instead of slowing the loop down."""

from __future__ import annotations

import queue
import threading

from kimi_supervisor.messages import End, Event


class Subscription:
    def __init__(self, bus: EventBus, maxsize: int) -> None:
        self.bus = bus
        self.queue: queue.Queue[Event | End] = queue.Queue(maxsize)
        self.overflowed = False

    def get(self, timeout_s: float) -> Event | End | None:
        try:
            return self.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.bus.unsubscribe(self)


class EventBus:
    def __init__(self, maxsize: int = 10_000) -> None:
        self._subs: set[Subscription] = set()
        self._lock = threading.Lock()
        self.maxsize = maxsize

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self.maxsize)
        with self._lock:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subs.discard(sub)

    def publish(self, msg: Event | End) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            try:
                sub.queue.put_nowait(msg)
            except queue.Full:
                # The reader sees this at its next poll (at most a second later) and ends.
                sub.overflowed = True
                self.unsubscribe(sub)
