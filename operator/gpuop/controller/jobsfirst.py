"""Every job of a burst of new trainings before any of their first statuses.

When many GpuTrainings arrive at once (a sweep, a pipeline's fan-out, an operator restart with a
backlog), each needs two writes to get going: its job, then its Created status. Made in arrival
order, one training's status write holds a worker while the next training's job waits, and a
job is what starts the work. So while any new training still waits for its job, a training's
first status is left for later; the last one of the burst to get its job hands every status
left back to the work queue. On the real API server (bench/operator_scale.py, N=1,000 on 2
cores) the create->child p99 went from 20-23 s to 6-10 s; the writes are the same.

A first status is left for later :data:`AT_MOST` after its training was first seen, and no
longer, whatever the others do: a training whose own API calls are slow, or a steady stream of
new ones where some always wait, must not keep another's status unwritten. The reconciler puts
each key left in the work queue again at that deadline (``add_after``).

This module only keeps the two sets; the reconciler adds the keys to its queue.
"""

from __future__ import annotations

import threading
import time
from typing import Final

from gpuop.api.identity import TrainingKey

# Seconds after it was first seen that a first status may wait. 30 s, about the time the
# operator took to make 1,000 jobs on the slower of two 2-core hosts measured: a bound shorter
# than the burst makes the early trainings' statuses come due mid-burst, where they compete with
# the last jobs. On the faster host (a burst in ~14 s) 15 and 30 s measured alike
# (docs/benchmarks.md). The cost: a status up to 30 s late in a burst.
AT_MOST: Final = 30.0


class JobsFirst:
    """Which trainings wait for their job, and whose first statuses are left until none does.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._awaiting: set[TrainingKey] = set()  # seen with no job, not yet reconciled
        # First statuses left for later: until when (monotonic), and the spec generation then
        # (an edit of the spec is worked at once, not left).
        self._later: dict[TrainingKey, tuple[float, object]] = {}

    def awaits(self, key: TrainingKey) -> None:
        """``key`` was seen with no job, and is queued: a reconcile will make it."""
        with self._lock:
            self._awaiting.add(key)

    def leave_for_later(self, key: TrainingKey, first_seen: float, generation: object) -> float | None:
        """``key`` has its job. Seconds its first status may wait (others still wait for their
        jobs, and it was first seen less than :data:`AT_MOST` ago), or None: write it now."""
        now = time.monotonic()
        by = first_seen + AT_MOST
        with self._lock:
            self._awaiting.discard(key)
            if now >= by or not self._awaiting:
                return None
            self._later[key] = (by, generation)
            return by - now

    def write_now(self, key: TrainingKey) -> None:
        """``key``'s first status is not left for later, whatever the others do: its job has
        ended, and its result must be written before the job's TTL may delete it."""
        with self._lock:
            self._awaiting.discard(key)
            self._later.pop(key, None)

    def waits(self, key: TrainingKey, generation: object) -> bool:
        """Whether ``key``'s first status is left for later, and nothing but a change of its
        spec's generation should have it reconciled before then."""
        with self._lock:
            left = self._later.get(key)
            if left is None:
                return False
            if time.monotonic() >= left[0] or left[1] != generation:
                del self._later[key]
                return False
            return True

    def settled(self, key: TrainingKey) -> list[TrainingKey]:
        """``key``'s reconcile is over, whatever it did: it waits for its job no more. Every
        first status left for later when none waits now (to be queued at once)."""
        with self._lock:
            self._awaiting.discard(key)
            if self._awaiting or not self._later:
                return []
            due = list(self._later)
            self._later.clear()
            return due

    def forget(self, key: TrainingKey) -> list[TrainingKey]:
        """``key`` is gone; as :meth:`settled`, for the statuses it held back."""
        with self._lock:
            self._later.pop(key, None)
        return self.settled(key)
