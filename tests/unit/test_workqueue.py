"""The operator's work queue (gpuop.controller.workqueue): a key is taken once however often it
was added, keys come out in the order they went in, one key is never with two workers at once,
delays and retries put keys in later, and shut_down ends every wait.

Timing tests assert only lower bounds that the queue's own clock guarantees, and upper bounds of
seconds that a loaded machine still meets: what they catch is a key that comes far too late or
never (a wait nobody wakes)."""

from __future__ import annotations

import itertools
import sys
import threading
import time

import pytest

from gpuop.controller.workqueue import WorkQueue

# Far beyond any delay these tests ask for, and far below "never": a wake-up that is missed
# shows as a thread still waiting after this long.
PATIENCE = 3.0


def _take_all(queue: WorkQueue[str]) -> list[str]:
    """Every key ready now, in the order taken (each left taken: no done())."""
    taken = []
    while (key := queue.take_ready()) is not None:
        taken.append(key)
    return taken


class _Getter:
    """A worker blocked in ``queue.get(timeout)`` in a thread: what it got, and when."""

    def __init__(self, queue: WorkQueue[str], timeout: float | None = None) -> None:
        self.queue = queue
        self.result: str | None = None
        self.returned_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self._thread.start()

    def _run(self, timeout: float | None) -> None:
        self.result = self.queue.get(timeout)
        self.returned_at = time.monotonic()

    def join(self) -> bool:
        """Whether it returned within PATIENCE; a thread still waiting is released (shut_down)
        so that no test leaves it behind."""
        self._thread.join(PATIENCE)
        if self._thread.is_alive():
            self.queue.shut_down()
            self._thread.join(PATIENCE)
            return False
        return True


# -- adding and taking ------------------------------------------------------------------------


def test_a_key_added_several_times_before_it_is_taken_is_taken_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for _ in range(5):
        queue.add("a")
    queue.add("b")
    queue.add("a")

    assert len(queue) == 2
    assert _take_all(queue) == ["a", "b"]
    assert queue.get(timeout=0.01) is None


def test_keys_come_out_in_the_order_they_were_first_added() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ["c", "a", "d", "b", "a", "c"]:
        queue.add(key)

    assert _take_all(queue) == ["c", "a", "d", "b"]


def test_get_returns_a_ready_key_at_once_and_take_ready_returns_none_when_none_is() -> None:
    queue: WorkQueue[str] = WorkQueue()
    assert queue.take_ready() is None

    queue.add("a")

    assert queue.get() == "a"
    assert queue.take_ready() is None


def test_a_key_done_without_being_added_again_does_not_come_out_again() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.take_ready() == "a"

    queue.done("a")

    assert queue.take_ready() is None
    assert len(queue) == 0


# -- one worker per key -----------------------------------------------------------------------


def test_a_key_added_while_a_worker_has_it_is_not_taken_by_another_until_it_is_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.get() == "a"

    queue.add("a")
    queue.add("a")

    assert len(queue) == 0  # held back, not ready
    assert queue.take_ready() is None
    assert queue.get(timeout=0.05) is None
    queue.done("a")
    assert len(queue) == 1
    assert queue.take_ready() == "a"
    assert queue.take_ready() is None  # once, however often it was added meanwhile


def test_a_key_added_while_a_worker_has_it_is_queued_behind_keys_added_before_it_was_done() -> None:
    """Its place in line is when it was done, not when it was added again: "b" and "c" came
    before the done() and go first, although "a" was added again before "c"."""
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.take_ready() == "a"

    queue.add("b")
    queue.add("a")
    queue.add("c")
    queue.done("a")
    queue.add("d")

    assert _take_all(queue) == ["b", "c", "a", "d"]


def test_a_worker_blocked_in_get_takes_a_key_held_back_from_another_when_it_is_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.take_ready() == "a"
    queue.add("a")
    getter = _Getter(queue)
    time.sleep(0.05)  # let it block (it would find "a" held back either way)
    assert getter.result is None

    queue.done("a")

    assert getter.join(), "the worker was not woken by done()"
    assert getter.result == "a"


# -- the low lane -----------------------------------------------------------------------------


def _drain(queue: WorkQueue[str]) -> list[str]:
    taken = []
    while (key := queue.take_ready()) is not None:
        taken.append(key)
        queue.done(key)
    return taken


def test_a_key_added_low_comes_out_after_every_key_added_plainly_even_later_ones() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add_low("status-1")
    queue.add("job-1")
    queue.add_low("status-2")
    queue.add("job-2")

    assert len(queue) == 4
    assert _drain(queue) == ["job-1", "job-2", "status-1", "status-2"]


def test_a_key_added_low_then_plainly_moves_up_and_comes_out_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add_low("a")
    queue.add("b")
    queue.add("a")
    queue.add_low("a")  # already queued, and up: stays up

    assert _drain(queue) == ["b", "a"]


def test_a_key_added_low_while_a_worker_has_it_is_queued_low_when_it_is_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.take_ready() == "a"
    queue.add_low("a")
    queue.add("b")

    assert queue.take_ready() == "b"
    assert queue.take_ready() is None  # "a" is worked
    queue.done("a")
    queue.add("c")
    assert _drain(queue) == ["c", "a"]
    queue.done("b")


def test_a_low_entry_left_behind_by_a_move_up_never_hands_a_worked_key_to_a_second_worker() -> None:
    """The move-up leaves "a"'s first entry in the low lane; "a" is taken from the plain lane and,
    while worked, added low again: the old entry must not hand it out a second time."""
    queue: WorkQueue[str] = WorkQueue()
    queue.add_low("a")
    queue.add("a")
    assert queue.take_ready() == "a"
    queue.add_low("a")

    assert queue.take_ready() is None
    queue.done("a")
    assert queue.take_ready() == "a"
    queue.done("a")
    assert queue.take_ready() is None


# -- delays -----------------------------------------------------------------------------------


def test_a_key_added_after_a_delay_is_not_ready_before_it_and_ready_after() -> None:
    queue: WorkQueue[str] = WorkQueue()
    asked = time.monotonic()
    queue.add_after("a", 0.1)

    assert queue.take_ready() is None
    assert len(queue) == 0
    assert queue.delayed() == 1
    assert queue.get(timeout=PATIENCE) == "a"
    assert time.monotonic() - asked >= 0.1
    assert queue.delayed() == 0


def test_an_earlier_add_after_of_a_key_wins_over_a_later_one() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add_after("a", 0.05)
    queue.add_after("a", 60)  # later: ignored
    assert queue.delayed() == 1
    assert queue.get(timeout=PATIENCE) == "a"

    queue.done("a")
    queue.add_after("b", 60)
    queue.add_after("b", 0.05)  # earlier: replaces
    assert queue.delayed() == 1
    assert queue.get(timeout=PATIENCE) == "b"
    queue.done("b")
    assert queue.delayed() == 0  # neither the 60 s "a" nor the 60 s "b" is still waiting


def test_a_key_whose_delay_was_replaced_by_an_earlier_one_comes_out_once() -> None:
    """The replaced (later) time is left in the queue's heap; when it comes round it must not
    add the key a second time."""
    queue: WorkQueue[str] = WorkQueue()
    queue.add_after("a", 0.15)
    queue.add_after("a", 0.05)
    assert queue.get(timeout=PATIENCE) == "a"
    queue.done("a")

    time.sleep(0.15)

    assert queue.take_ready() is None


@pytest.mark.parametrize("seconds", [0, -1.0])
def test_add_after_no_delay_is_add(seconds: float) -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("first")

    queue.add_after("a", seconds)

    assert queue.delayed() == 0
    assert len(queue) == 2
    assert _take_all(queue) == ["first", "a"]


def test_a_key_due_while_a_worker_has_it_is_queued_again_when_it_is_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.take_ready() == "a"
    queue.add_after("a", 0.05)

    time.sleep(0.1)

    assert queue.take_ready() is None
    queue.done("a")
    assert queue.take_ready() == "a"


@pytest.mark.parametrize("far_key_first", [False, True], ids=["nothing-delayed", "a-far-key-delayed"])
def test_a_get_blocked_with_nothing_ready_wakes_for_a_delayed_key_when_it_is_due(far_key_first: bool) -> None:
    """With a far key delayed first (60 s), the blocked worker sleeps until that one: the nearer
    key added after must shorten the sleep."""
    queue: WorkQueue[str] = WorkQueue()
    if far_key_first:
        queue.add_after("far", 60)
    getter = _Getter(queue)  # no timeout: only a delayed key can end its wait
    time.sleep(0.05)
    asked = time.monotonic()

    queue.add_after("a", 0.1)

    assert getter.join(), "the blocked get() never woke for the delayed key"
    assert getter.result == "a"
    assert getter.returned_at is not None
    assert getter.returned_at - asked >= 0.1
    assert getter.returned_at - asked < 2.0
    assert queue.delayed() == (1 if far_key_first else 0)  # "far" still waits


# -- retries ----------------------------------------------------------------------------------


def test_retry_delays_double_per_failure_from_the_base_up_to_the_most() -> None:
    queue: WorkQueue[str] = WorkQueue(retry_base=10.0, retry_max=70.0)

    delays = [queue.retry("a") for _ in range(6)]

    assert delays == [10.0, 20.0, 40.0, 70.0, 70.0, 70.0]
    assert queue.delayed() == 1
    assert queue.take_ready() is None


def test_each_key_has_its_own_retry_backoff() -> None:
    queue: WorkQueue[str] = WorkQueue(retry_base=10.0, retry_max=1000.0)
    queue.retry("a")
    queue.retry("a")

    assert queue.retry("b") == 10.0
    assert queue.retry("a") == 40.0
    assert queue.delayed() == 2


def test_forget_starts_a_keys_next_retry_from_the_base_again() -> None:
    queue: WorkQueue[str] = WorkQueue(retry_base=10.0, retry_max=1000.0)
    queue.retry("a")
    queue.retry("a")
    queue.retry("b")

    queue.forget("a")
    queue.forget("never-retried")  # harmless

    assert queue.retry("a") == 10.0
    assert queue.retry("b") == 20.0  # another key's forget leaves this one's backoff


def test_forget_drops_a_retry_the_key_waits_for_so_a_later_delay_is_kept() -> None:
    """A key worked without error must not keep its old retry time, which would win over the
    later time asked for next (a first status's deadline)."""
    queue: WorkQueue[str] = WorkQueue(retry_base=60.0)
    queue.retry("a")
    queue.forget("a")
    assert queue.delayed() == 0

    queue.add_after("a", 0.05)

    assert queue.get(timeout=PATIENCE) == "a"


def test_a_retried_key_comes_out_after_its_backoff() -> None:
    queue: WorkQueue[str] = WorkQueue(retry_base=0.05, retry_max=1.0)
    asked = time.monotonic()

    assert queue.retry("a") == 0.05

    assert queue.take_ready() is None
    assert queue.get(timeout=PATIENCE) == "a"
    assert time.monotonic() - asked >= 0.05


def test_a_key_retried_without_end_keeps_being_retried_at_the_most() -> None:
    """At the default backoff the 1025th retry comes after about 17 hours of failures: an API
    server down for a day must not break the retry of a training."""
    queue: WorkQueue[str] = WorkQueue(retry_base=0.5, retry_max=60.0)

    delays = [queue.retry("a") for _ in range(2000)]

    assert delays[-1] == 60.0


# -- timeouts and shutting down ---------------------------------------------------------------


def test_get_returns_none_after_its_timeout_with_nothing_queued() -> None:
    queue: WorkQueue[str] = WorkQueue()
    asked = time.monotonic()

    assert queue.get(timeout=0.1) is None
    assert time.monotonic() - asked >= 0.1
    assert queue.get(timeout=0) is None


def test_get_returns_none_at_its_timeout_when_the_only_key_is_due_later() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add_after("a", 60)

    assert queue.get(timeout=0.05) is None
    assert queue.delayed() == 1


def test_shut_down_wakes_a_blocked_get_with_none() -> None:
    queue: WorkQueue[str] = WorkQueue()
    getters = [_Getter(queue) for _ in range(3)]  # no timeout: only shut_down ends their wait
    time.sleep(0.05)

    queue.shut_down()

    assert all(getter.join() for getter in getters), "a blocked get() was not woken by shut_down()"
    assert [getter.result for getter in getters] == [None, None, None]


def test_keys_still_queued_at_shut_down_are_not_handed_out() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    queue.add_low("b")

    queue.shut_down()

    assert queue.get(timeout=0.1) is None
    assert queue.take_ready() is None


def test_adds_after_shut_down_are_ignored() -> None:
    queue: WorkQueue[str] = WorkQueue(retry_base=0.01)
    queue.shut_down()

    queue.add("a")
    queue.add_after("b", 0.01)
    queue.add_after("c", 0)
    queue.retry("d")

    assert len(queue) == 0
    assert queue.delayed() == 0
    assert queue.take_ready() is None
    assert queue.get(timeout=PATIENCE) is None  # at once: no waiting once shut down


# -- many workers -----------------------------------------------------------------------------


def test_many_workers_never_hold_one_key_at_once_and_lose_no_add() -> None:
    """8 workers and a producer adding 200 keys 50 times each (and every worker adding its key
    again while it holds it, the first two times): no key is with two workers at once, and each
    key's last add comes before its last start: an add the queue lost (a key added while worked
    and never queued again, a worker never woken for a ready key) leaves it the other way."""
    queue: WorkQueue[str] = WorkQueue()
    keys = [f"k{i}" for i in range(200)]
    lock = threading.Lock()
    clock = itertools.count()  # orders adds and starts, under lock
    held: set[str] = set()
    overlaps: list[str] = []
    last_added: dict[str, int] = {}
    last_started: dict[str, int] = {}
    starts: dict[str, int] = dict.fromkeys(keys, 0)
    errors: list[BaseException] = []
    producer_done = threading.Event()

    def add(key: str) -> None:
        with lock:  # stamped before the add: the start that works this add is stamped after it
            last_added[key] = next(clock)
        queue.add(key)

    def produce() -> None:
        try:
            for round_ in range(50):
                for key in keys:
                    add(key)
                if round_ % 5 == 4:
                    time.sleep(0.001)  # let the workers catch up now and then: both empty and full queues
        except BaseException as error:
            errors.append(error)
        finally:
            producer_done.set()

    def work() -> None:
        try:
            while True:
                finished = producer_done.is_set()  # read before get(): nothing it adds comes after
                key = queue.get(timeout=0.05)
                if key is None:
                    if finished:
                        return
                    continue
                with lock:
                    if key in held:
                        overlaps.append(key)
                    held.add(key)
                    last_started[key] = next(clock)
                    starts[key] += 1
                    again = starts[key] <= 2
                if again:
                    add(key)  # as a reconcile that asks for another
                time.sleep(0)  # give way while holding it: adds land while it is worked
                with lock:
                    held.discard(key)  # before done(): then another worker may take it
                queue.done(key)
        except BaseException as error:
            errors.append(error)

    producer = threading.Thread(target=produce, daemon=True)
    workers = [threading.Thread(target=work, daemon=True) for _ in range(8)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads change far more often: many more interleavings
    try:
        for thread in [*workers, producer]:
            thread.start()
        for thread in [producer, *workers]:
            thread.join(30)
    finally:
        sys.setswitchinterval(switch)
    stuck = [thread for thread in [producer, *workers] if thread.is_alive()]
    if stuck:  # release them: a thread left running fails the session (tests/conftest.py)
        queue.shut_down()
        for thread in stuck:
            thread.join(PATIENCE)
    assert stuck == [], "a thread never finished"

    assert errors == []
    assert overlaps == []
    never = [key for key in keys if key not in last_started]
    assert never == []
    lost = [key for key in keys if last_started[key] < last_added[key]]
    assert lost == [], "keys added after their last start and never worked again"
    assert all(count >= 3 for count in starts.values())  # each worker's own two adds came out
    assert len(queue) == 0
    assert queue.take_ready() is None
