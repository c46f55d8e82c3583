"""What one call costs in CPU, measured on the calling thread alone.

``time.process_time()`` counts every thread of the pytest process, including ones an earlier
test left running: a case measured at 0.155 s alone was charged 1.0009 s in a full run. The
calling thread's own clock counts only the call. Bounds on it are set an order of magnitude
over what was measured: they catch a regression into the pathological case each test
guards against (a RecursionError, an unbounded expansion, a billion-digit number), not a
slow or busy machine. Timing goals belong in bench/.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def thread_seconds(call: Callable[[], T]) -> tuple[T, float]:
    """The call's result and the CPU seconds this thread spent in it (raises what it raises)."""
    started = time.thread_time()
    result = call()
    return result, time.thread_time() - started
