"""What one call costs in CPU, measured on the calling thread alone.

``time.process_time()`` counts every thread of the pytest process, including ones an earlier
test left running: a case measured at 0.155 s alone was charged 1.0009 s in a full run. The
calling thread's own clock counts only the call. Bounds on it are set an order of magnitude
over what was measured: they catch a regression into the pathological case each test
guards against (a RecursionError, an unbounded expansion, a billion-digit number), not a
slow or busy machine. Timing goals belong in bench/.

The cycle collector is off during the call. With the whole unit suite in the heap, a full
collection that the call's allocations happen to trigger costs 0.1 s by itself, which charged
a 17 ms parse 0.13 s: that is the heap's cost, paid wherever it falls, not the call's. (A
``gc.collect()`` before each call costs as much, and the property tests make thousands.)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def thread_seconds(call: Callable[[], T]) -> tuple[T, float]:
    """The call's result and the CPU seconds this thread spent in it (raises what it raises)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.thread_time()
        result = call()
        return result, time.thread_time() - started
    finally:
        if was_enabled:
            gc.enable()
