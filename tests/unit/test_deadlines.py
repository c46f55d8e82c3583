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
