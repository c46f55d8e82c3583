"""Every job of a burst of new trainings before any of their first statuses.

When many GpuTrainings arrive at once (a sweep, a pipeline's fan-out, an operator restart with a
backlog), each needs two writes to get going: its job, then its Created status. Made in arrival
order, one training's status write holds a worker while the next training's job waits, and a
job is what starts the work. So while any new training still waits for its job, a training's
first status is left for later; once none waits, the statuses left are written by a pool of
their own. On the real API server (bench/operator_scale.py, N=1,000 on 2 cores, with the other
changes of that day) the create->child p99 went from 20-23 s to 6-10 s; the writes are the same.

A first status is left for later :data:`AT_MOST` after its training was first seen, and no
longer, whatever the others do: a training whose own API calls are slow, or a steady stream of
new ones where some always wait, must not keep another's status unwritten. A thread of its own
writes the statuses whose time is up.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from gpuop.api.identity import TrainingKey

# Seconds after it was first seen that a first status may wait. 30 s, about the time the
# operator took to make 1,000 jobs on the slower of two 2-core hosts measured: a bound shorter
# than the burst makes the early trainings' statuses come due mid-burst, where they compete with
# the last jobs. On the faster host (a burst in ~14 s) 15 and 30 s measured alike
# (docs/benchmarks.md). The cost: a status up to 30 s late in a burst.
AT_MOST: Final = 30.0


def deadline(first_seen: float) -> float:
    """When a first status left for later stops waiting (monotonic), its training first seen at
    ``first_seen``."""
    return first_seen + AT_MOST


class JobsFirst:
    """Which trainings wait for their job, and the first statuses left until none does."""

    def __init__(self, reconcile: Callable[[TrainingKey], object], workers: int) -> None:
        self._reconcile = reconcile
        self._lock = threading.Condition()
        self._waiting: set[TrainingKey] = set()  # seen with no job, their reconcile not over yet
        self._later: dict[TrainingKey, float] = {}  # first statuses left for later: by when (monotonic)
        # The same, soonest first, for the thread that hands them over. Entries no longer in
        # _later (handed over, forgotten) are dropped when met. Without it each wake scanned
        # every status left: quadratic in a burst's size.
        self._deadlines: list[tuple[float, TrainingKey]] = []
        self._stopping = False
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="statuses")
        self._due = threading.Thread(target=self._hand_over_when_due, name="statuses-due", daemon=True)
        self._due.start()

    def waits(self, key: TrainingKey) -> None:
        """``key`` was seen with no job: its reconcile is on its way."""
        with self._lock:
            self._waiting.add(key)

    def done(self, key: TrainingKey) -> None:
        """``key``'s reconcile is over (its job made, or it could not be): it waits no more."""
        with self._lock:
            self._waiting.discard(key)
            if not self._waiting and self._later:
                self._lock.notify()

    def leave_for_later(self, key: TrainingKey, first_seen: float) -> bool:
        """Whether ``key``'s first status waits, because other trainings wait for their jobs and
        it was first seen less than :data:`AT_MOST` ago."""
        by = deadline(first_seen)
        if time.monotonic() >= by:
            return False
        with self._lock:
            if self._stopping or len(self._waiting) - (key in self._waiting) <= 0:
                return False
            if self._later.get(key) == by:
                return True  # left already (its job's own event reconciles it again)
            soonest = self._deadlines[0][0] if self._deadlines else None
            self._later[key] = by
            heapq.heappush(self._deadlines, (by, key))
            if soonest is None or by < soonest:
                self._lock.notify()  # due before the one the thread waits for
            return True

    def forget(self, key: TrainingKey) -> None:
        with self._lock:
            was_waiting = key in self._waiting
            self._waiting.discard(key)
            self._later.pop(key, None)
            if was_waiting and not self._waiting and self._later:
                self._lock.notify()  # it was the last one waiting

    def _take_due(self, now: float) -> list[TrainingKey]:
        """Take the statuses to hand over now: all once none waits, else those whose time is up.
        Leaves the next live deadline on top of the heap."""
        if not self._waiting:
            due = list(self._later)
            self._later.clear()
            self._deadlines.clear()
            return due
        due = []
        # Past deadlines are taken, and stale ones (handed over, forgotten) dropped wherever they
        # are due: what stays on top is the next live deadline, the one to wait for.
        while self._deadlines:
            by, key = self._deadlines[0]
            live = self._later.get(key) == by
            if live and by > now:
                break
            heapq.heappop(self._deadlines)
            if live:
                del self._later[key]
                due.append(key)
        return due

    def _hand_over_when_due(self) -> None:
        """Give the pool every status left for later once none waits for its job, and each one
        whose time is up whatever the others do."""
        with self._lock:
            while not self._stopping:
                now = time.monotonic()
                due = self._take_due(now)
                if not due:
                    self._lock.wait(self._deadlines[0][0] - now if self._deadlines else None)
                    continue
                for key in due:
                    try:
                        self._pool.submit(self._reconcile, key)
                    except RuntimeError:  # shut down: the operator is stopping
                        return

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._due.join(5)
        self._pool.shutdown(wait=True, cancel_futures=True)
