"""gpuop._kits.deadlines: the one thread that cuts off report connections and pod scrapes."""

from __future__ import annotations

import threading

from gpuop._kits.deadlines import Deadlines


def test_deadlines_come_in_time_order_and_a_cancelled_one_never() -> None:
    deadlines = Deadlines("test")
    called: list[str] = []
    done = threading.Event()
    try:
        later = deadlines.after(0.3, lambda: (called.append("later"), done.set()))
        deadlines.after(0.1, lambda: called.append("sooner"))  # added after, due before
        cancelled = deadlines.after(0.05, lambda: called.append("cancelled"))
        deadlines.cancel(cancelled)
        assert done.wait(5), called
        assert called == ["sooner", "later"]  # the cancelled one came due first and was dropped
        deadlines.cancel(later)  # after it ran: nothing to undo
    finally:
        deadlines.stop()
    assert not deadlines._thread.is_alive()


def test_a_failing_callback_costs_no_later_one() -> None:
    deadlines = Deadlines("test")
    done = threading.Event()
    try:
        deadlines.after(0.0, lambda: 1 / 0)  # type: ignore[func-returns-value]
        deadlines.after(0.05, done.set)
        assert done.wait(5)
    finally:
        deadlines.stop()


def test_stop_calls_what_is_still_pending_and_later_ones_at_once() -> None:
    """What waits on a deadline (a scrape reading a socket) must not outlive the stop."""
    deadlines = Deadlines("test")
    called: list[str] = []
    deadlines.after(3600, lambda: called.append("in an hour"))
    deadlines.cancel(deadlines.after(3600, lambda: called.append("cancelled")))
    deadlines.stop()
    assert called == ["in an hour"]
    deadlines.after(3600, lambda: called.append("after the stop"))
    assert called == ["in an hour", "after the stop"]
