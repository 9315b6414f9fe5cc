"""Failed authentications per client address, so a flood of guessed keys is cut off before it costs a
lookup each.

A fixed one-minute window per address: past `per_min` failures in it the address is refused (429, with
the seconds until its window ends as Retry-After) before its key is even looked at, valid or not. State
is in memory, per ingress process (N ingress replicas allow up to N x per_min); the number of addresses
tracked is bounded: when full, expired windows go first, and if every one is live the table is cleared
(a flood from that many addresses resets the counts rather than growing memory).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

WINDOW_S = 60.0


class AuthFailureLimiter:
    def __init__(self, per_min: int, max_addresses: int = 10_000, clock: Callable[[], float] = time.monotonic):
        """`per_min`: failures allowed per address and minute (0 = no limit)."""
        self.per_min, self.max_addresses, self.clock = per_min, max_addresses, clock
        self._windows: dict[str, tuple[float, int]] = {}  # address -> (window start, failures in it)
        self._lock = threading.Lock()

    def retry_after(self, address: str) -> float | None:
        """Seconds until `address` may try again, or None when it may try now."""
        if not self.per_min:
            return None
        now = self.clock()
        with self._lock:
            window = self._windows.get(address)
        if window is None or window[1] < self.per_min or now - window[0] >= WINDOW_S:
            return None
        return window[0] + WINDOW_S - now

    def record_failure(self, address: str) -> None:
        if not self.per_min:
            return
        now = self.clock()
        with self._lock:
            start, count = self._windows.get(address, (now, 0))
            if now - start >= WINDOW_S:
                start, count = now, 0
            if address not in self._windows and len(self._windows) >= self.max_addresses:
                self._make_room(now)
            self._windows[address] = (start, count + 1)

    def _make_room(self, now: float) -> None:
        for address in [a for a, (start, _) in self._windows.items() if now - start >= WINDOW_S]:
            del self._windows[address]
        if len(self._windows) >= self.max_addresses:
            self._windows.clear()
