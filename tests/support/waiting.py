"""Waiting for something a test expects: polled, with a timeout that names what never came."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout: float = 20.0,
    every: float = 0.1,
    tolerate: tuple[type[Exception], ...] = (),
) -> Any:
    """Poll until ``check`` returns something truthy; fail naming ``what``. Exceptions of the
    ``tolerate`` kinds (a command that fails while a cluster settles) count as 'not yet'."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except tolerate as exc:
            last = str(exc)[-500:]
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")


class ManualClock:
    """A monotonic clock the test moves (``clock.now += 5``): throttles, rate buckets and caches
    are tested on time the test decides, never on sleeps."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
