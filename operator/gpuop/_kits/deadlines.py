"""Deadlines kept by one thread: a callback called when its time comes, unless cancelled.

Why one thread: the report endpoint gives every connection a deadline, and a timer thread per
connection doubled the threads each report starts (the handler's and its timer's) at 200
reports a second; the pod scrape gives every request of a tick one. A callback runs on that
thread, so it must be quick and never raise (a socket's shutdown, as both use it).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any


class Deadlines:
    """Calls each callback once its time has come, unless cancelled first, all from one thread."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._due: list[list[Any]] = []  # heap of [at, number, callback or None once cancelled]
        self._numbers = itertools.count()
        self._changed = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def after(self, seconds: float, callback: Callable[[], None]) -> list[Any]:
        """Call ``callback`` in ``seconds``; the handle is for :meth:`cancel`."""
        entry = [self.clock() + seconds, next(self._numbers), callback]
        with self._changed:
            heapq.heappush(self._due, entry)
            if self._due[0] is entry:
                self._changed.notify()
        return entry

    def cancel(self, entry: list[Any]) -> None:
        entry[2] = None  # dropped when it comes due: a cancelled entry costs its slot until then

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._stopped and (not self._due or self._due[0][0] > self.clock()):
                    self._changed.wait(self._due[0][0] - self.clock() if self._due else None)
                if self._stopped:
                    return
                callback = heapq.heappop(self._due)[2]
            if callback is not None:
                callback()
