"""The report waiting to go, and the thread that sends it.

One report waits at a time: a newer one replaces it, since it says all the older one said. A
daemon thread, started on first use, posts it through the :class:`~gpureport._sending.Endpoint`
and retries one the server refused for now (429, 5xx, no connection) while no newer one comes.
The caller's thread only swaps the waiting report under a lock, so a report never waits on the
network in the training loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpureport._sending import Endpoint


class Outbox:
    """The waiting report, the sender thread, and the sequence numbers that tell a caller when
    its report was tried.

    ``changed`` is the reporter's condition, shared so that the reporter's own state and what
    waits here change together. When nothing waits, the thread asks ``idle(closing)`` (with
    ``changed`` held) for a report of its own to send (a checkpoint no report has said yet), and
    looks again after ``retry_delay`` while ``wants_idle()`` holds.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        changed: threading.Condition,
        *,
        retries: int,
        retry_delay: float,
        min_interval: float,
        idle: Callable[[bool], bytes | None],
        wants_idle: Callable[[], bool],
    ) -> None:
        self._endpoint = endpoint
        self._changed = changed
        # A refused report is tried again this often, after retry_delay, then twice that, ...
        # (at most min_interval apart).
        self.retries, self.retry_delay, self._min_interval = retries, retry_delay, min_interval
        self._idle, self._wants_idle = idle, wants_idle
        # Guarded by changed: the waiting report, the sequence numbers of the last report put
        # and of the last one the thread settled, and whether that one was answered 200.
        self._pending: tuple[int, bytes] | None = None
        self._queued = 0
        self._settled = 0
        self._settled_ok = False
        self.thread: threading.Thread | None = None
        self.closed = False

    def put(self, body: bytes) -> int:
        """Queue ``body`` in place of any report still waiting; its sequence number."""
        with self._changed:
            self._queued += 1
            self._pending = (self._queued, body)
            self._wake()
            return self._queued

    def nudge(self) -> None:
        """Have the thread ask ``idle`` now (the reporter has something to say)."""
        with self._changed:
            self._wake()

    def _wake(self) -> None:
        """Notify the thread, starting it on first use (with changed held); is_alive() also
        restarts it in a forked child, where the parent's thread does not exist."""
        self._changed.notify_all()
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._send_forever, name="gpureport", daemon=True)
            self.thread.start()

    def wait_for(self, sequence: int, timeout: float) -> bool:
        """Wait until report ``sequence`` was tried; whether the last one tried was answered 200
        (False after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._settled < sequence:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return self._settled_ok

    def flush(self, timeout: float) -> bool:
        """:meth:`wait_for` the last report put so far."""
        with self._changed:
            target = self._queued
        return self.wait_for(target, timeout)

    def close(self, timeout: float) -> None:
        """Stop the thread once what waits was tried (waiting up to ``timeout``); later puts are
        the caller's to refuse (:attr:`closed`)."""
        with self._changed:
            self.closed = True
            self._changed.notify_all()
            thread = self.thread
        if thread is not None:
            thread.join(timeout)

    def _take_idle(self, closing: bool) -> None:
        body = self._idle(closing)  # with changed held
        if body is not None:
            self._queued += 1
            self._pending = (self._queued, body)

    def _send_forever(self) -> None:
        while True:
            with self._changed:
                while self._pending is None and not self.closed:
                    self._changed.wait(self.retry_delay if self._wants_idle() else None)
                    self._take_idle(closing=False)
                if self._pending is None:
                    self._take_idle(closing=True)  # closing: what the reporter still owes
                if self._pending is None:
                    return  # closed, and nothing left to send
                sequence, body = self._pending
                self._pending = None
            ok = self._endpoint.post(body)
            delay = self.retry_delay
            for _ in range(self.retries):
                if ok or not self._endpoint.retryable:
                    break
                # A report the server refused for now (429: past its rate, as a pause right after
                # a checkpoint and a step report can be; 5xx; no connection) is sent again unless
                # a newer one, which says all it says, has come meanwhile.
                with self._changed:
                    self._changed.wait_for(lambda: self._pending is not None, timeout=delay)
                    if self._pending is not None:
                        break
                ok = self._endpoint.post(body)
                delay = min(2 * delay, self._min_interval or delay)
            with self._changed:
                self._settled, self._settled_ok = sequence, ok
                self._changed.notify_all()
