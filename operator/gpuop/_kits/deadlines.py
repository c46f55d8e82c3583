"""Deadlines kept by one thread: a callback called when its time comes, unless cancelled.

Why one thread: the report endpoint gives every connection a deadline, and a timer thread per
connection doubled the threads each report starts (the handler's and its timer's) at 200
reports a second; the pod scrape gives every request of a tick one. A callback runs on that
thread, so it must be quick (a socket's shutdown, as both use it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(order=True)
class Deadline:
    """One callback's time; :meth:`Deadlines.cancel` empties it, and it is dropped when due."""

    at: float
    number: int  # ties in ``at`` go in the order they came
    callback: Callable[[], None] | None = field(compare=False)


class Deadlines:
    """Calls each callback once its time has come, unless cancelled first, all from one thread."""

    def __init__(self, name: str) -> None:
        self._due: list[Deadline] = []  # a heap
        self._numbers = itertools.count()
        self._changed = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def after(self, seconds: float, callback: Callable[[], None]) -> Deadline:
        """Call ``callback`` in ``seconds`` (at once if :meth:`stop` has begun)."""
        deadline = Deadline(time.monotonic() + seconds, next(self._numbers), callback)
        with self._changed:
            if not self._stopped:
                heapq.heappush(self._due, deadline)
                if self._due[0] is deadline:
                    self._changed.notify()
                return deadline
        _call(callback)
        return deadline

    def cancel(self, deadline: Deadline) -> None:
        deadline.callback = None  # dropped when it comes due: a cancelled one costs its slot until then

    def stop(self) -> None:
        """Call every callback still pending now (what waits on one must not outlive this),
        then end the thread."""
        with self._changed:
            self._stopped = True
            self._changed.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._stopped and (not self._due or self._due[0].at > time.monotonic()):
                    self._changed.wait(self._due[0].at - time.monotonic() if self._due else None)
                if self._stopped:
                    pending, self._due = self._due, []
                    break
                callback = heapq.heappop(self._due).callback
            _call(callback)
        for deadline in pending:
            _call(deadline.callback)


def _call(callback: Callable[[], None] | None) -> None:
    if callback is None:
        return
    try:
        callback()
    except Exception:  # one callback's failure must not end the thread every deadline relies on
        log.exception("a deadline's callback failed")
