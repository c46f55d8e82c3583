"""Every job of a burst of new trainings before any of their first statuses.

When many GpuTrainings arrive at once (a sweep, a pipeline's fan-out, an operator restart with a
backlog), each needs two writes to get going: its job, then its Created status. Made in arrival
order, one training's status write holds a worker while the next training's job waits, and a
job is what starts the work. So while any new training still waits for its job, a training's
first status is left for later; once none waits, the statuses left are written by a pool of
their own. On the real API server (bench/operator_scale.py, N=1,000 on 2 cores, with the other
changes of that day) the create->child p99 went from 20-23 s to 6-10 s; the writes are the same.

A training's first status waits at most :data:`AT_MOST` after it was first seen: a steady
stream of new trainings, where some always wait, must not keep the statuses unwritten (the
tick writes them then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)

AT_MOST: Final = 30.0  # seconds a first status may be left for later


class JobsFirst:
    """Which trainings wait for their job, and the first statuses left until none does."""

    def __init__(self, reconcile: Callable[[Key], object], workers: int) -> None:
        self._reconcile = reconcile
        self._lock = threading.Lock()
        self._waiting: set[Key] = set()  # seen with no job, their reconcile not done yet
        self._later: dict[Key, None] = {}  # first statuses left for later, in order
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="statuses")

    def waits(self, key: Key) -> None:
        """``key`` was seen with no job: its reconcile is on its way."""
        with self._lock:
            self._waiting.add(key)

    def done(self, key: Key) -> None:
        """``key``'s reconcile is over (its job made, or it could not be): it waits no more.
        The last one to stop waiting hands the statuses left for later to the pool."""
        with self._lock:
            self._waiting.discard(key)
            if self._waiting or not self._later:
                return
            due, self._later = list(self._later), {}
        for later in due:
            try:
                self._pool.submit(self._reconcile, later)
            except RuntimeError:  # shut down: the operator is stopping, the next one writes it
                return

    def leave_for_later(self, key: Key, first_seen: float) -> bool:
        """Whether ``key``'s first status waits, because other trainings wait for their jobs
        (and it was first seen less than :data:`AT_MOST` ago)."""
        if time.monotonic() - first_seen >= AT_MOST:
            return False
        with self._lock:
            others = len(self._waiting) - (key in self._waiting)
            if others <= 0:
                return False
            self._later[key] = None
            return True

    def forget(self, key: Key) -> None:
        with self._lock:
            self._waiting.discard(key)
            self._later.pop(key, None)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
