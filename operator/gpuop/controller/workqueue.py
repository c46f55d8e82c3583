"""The operator's one work queue: the only way a GpuTraining gets reconciled.

client-go's workqueue, in the small: every source of work (Kopf's training events, the job
watch, the scrape tick, a clock) only *adds a key*; a bounded set of workers take keys and
reconcile them. Three properties make the reconcile simple to reason about:

- **deduplicated**: a key added ten times before a worker takes it is taken once, so a burst of
  events for one training costs one reconcile of its latest state;
- **one worker per key**: a key added while a worker has it is held back (the dirty set) and
  queued again when that worker is done, so two reconciles of one training never interleave and
  no lock per training is needed;
- **clocks are delays**: :meth:`add_after` puts a key in after a time (a deadline, a retry), and
  :meth:`retry` does so with a per-key exponential backoff that :meth:`forget` resets.

Keys come out in the order they went in (a FIFO). A key added with :meth:`add_low` comes out
only when no key added with :meth:`add` is ready: a burst's first statuses, handed back once
every job of it is made (:mod:`gpuop.controller.jobsfirst`), must not hold up the jobs of the
trainings that arrive after them.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable
from typing import Final, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# A failed key's first retry comes after this, each further one after twice the last, up to
# RETRY_MAX: an API server that answers again is used again within a second. (The scrape tick
# queues a failed training at each of its rounds as well, so the retries never space out
# beyond the tick's interval.)
RETRY_BASE: Final = 0.5
RETRY_MAX: Final = 60.0


class WorkQueue(Generic[K]):
    """Keys waiting to be worked. Thread-safe."""

    def __init__(
        self,
        retry_base: float = RETRY_BASE,
        retry_max: float = RETRY_MAX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Seconds, for add_after's times: the monotonic clock, or a test's own.
        self._clock = clock
        self._retry_base = retry_base
        self._retry_max = retry_max
        self._cond = threading.Condition()
        self._ready: collections.deque[K] = collections.deque()
        # Keys added with add_low: taken when _ready is empty. A key moved up by add() stays
        # here too, and is skipped when met (its entry in _low_keys is gone).
        self._ready_low: collections.deque[K] = collections.deque()
        self._low_keys: set[K] = set()
        self._dirty: set[K] = set()  # added and not yet taken: ready, or held back while worked
        self._processing: set[K] = set()  # taken by a worker, not yet done
        # Keys to add later: the soonest time each is due (monotonic), and a heap of the same;
        # heap entries whose time is no longer the key's are stale and dropped when met.
        self._due_at: dict[K, float] = {}
        self._delayed: list[tuple[float, int, K]] = []
        self._order = itertools.count()  # breaks ties in the heap without comparing keys
        self._failures: dict[K, int] = {}
        self._shutting_down = False

    # -- adding ---------------------------------------------------------------------------

    def add(self, key: K) -> None:
        """Queue ``key`` unless it is queued already; held back if a worker has it."""
        with self._cond:
            self._add(key)

    def add_low(self, key: K) -> None:
        """Queue ``key`` behind every key added with :meth:`add`, even those added after it."""
        with self._cond:
            if self._shutting_down or key in self._dirty:
                return
            self._dirty.add(key)
            self._low_keys.add(key)
            if key not in self._processing:
                self._ready_low.append(key)
                self._cond.notify()

    def _add(self, key: K) -> None:
        if self._shutting_down:
            return
        if key in self._dirty:
            if key not in self._low_keys:
                return
            self._low_keys.discard(key)  # moved up: its entry in _ready_low is skipped
            if key in self._processing:
                return
        else:
            self._dirty.add(key)
            if key in self._processing:
                return
        self._ready.append(key)
        self._cond.notify()

    def add_after(self, key: K, seconds: float) -> None:
        """Queue ``key`` in ``seconds``; an earlier time already asked for stays."""
        if seconds <= 0:
            self.add(key)
            return
        due = self._clock() + seconds
        with self._cond:
            if self._shutting_down or self._due_at.get(key, float("inf")) <= due:
                return
            self._due_at[key] = due
            soonest = self._delayed[0][0] if self._delayed else None
            heapq.heappush(self._delayed, (due, next(self._order), key))
            if soonest is None or due < soonest:
                # Every waiter: one that wakes at its own timeout instead would use up the call.
                self._cond.notify_all()

    def retry(self, key: K) -> float:
        """Queue ``key`` again after its backoff, which doubles with each retry until
        :meth:`forget`; returns the delay."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        # The exponent is capped: a key failing for days must not overflow a float.
        delay = min(self._retry_max, self._retry_base * 2.0 ** min(failures, 64))
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """``key`` was worked without error: a retry it waits for is dropped, and its next one
        starts from the first backoff."""
        with self._cond:
            self._failures.pop(key, None)
            self._due_at.pop(key, None)  # its heap entry, now stale, is dropped when met

    # -- taking ---------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> K | None:
        """The next key to work, waiting for one; None once shut down or after ``timeout``.
        The caller owns the key until :meth:`done`."""
        deadline = None if timeout is None else self._clock() + timeout
        with self._cond:
            while True:
                if self._shutting_down:
                    return None
                key = self._take_ready()
                if key is not None:
                    return key
                now = self._clock()
                soonest = self._delayed[0][0] if self._delayed else None
                waits = [t - now for t in (deadline, soonest) if t is not None]
                if deadline is not None and now >= deadline:
                    return None
                self._cond.wait(max(0.0, min(waits)) if waits else None)

    def take_ready(self) -> K | None:
        """The next key that is ready now, without waiting (None when none is, or once shut
        down)."""
        with self._cond:
            return None if self._shutting_down else self._take_ready()

    def _take_ready(self) -> K | None:
        self._promote_due(self._clock())
        while self._ready or self._ready_low:
            if self._ready:
                key = self._ready.popleft()
            else:
                key = self._ready_low.popleft()
                if key not in self._low_keys or key in self._processing:
                    continue  # moved up by add() and queued there, or an entry left by that
                self._low_keys.discard(key)
            self._dirty.discard(key)
            self._processing.add(key)
            return key
        return None

    def _promote_due(self, now: float) -> None:
        while self._delayed and self._delayed[0][0] <= now:
            due, _, key = heapq.heappop(self._delayed)
            if self._due_at.get(key) == due:
                del self._due_at[key]
                self._add(key)

    def done(self, key: K) -> None:
        """A worker is done with ``key``: queued again if it was added meanwhile."""
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                (self._ready_low if key in self._low_keys else self._ready).append(key)
                self._cond.notify()

    # -- the rest -------------------------------------------------------------------------

    def shut_down(self) -> None:
        """Wake every waiting worker with None; no key is handed out and adds are ignored from
        now on (keys still queued are dropped)."""
        with self._cond:
            self._shutting_down = True
            self._cond.notify_all()

    def __len__(self) -> int:
        """Keys ready to be worked now (not those delayed or held back while worked)."""
        with self._cond:
            return len(self._dirty - self._processing)

    def delayed(self) -> int:
        """Keys waiting for their time (add_after, retry)."""
        with self._cond:
            return len(self._due_at)
