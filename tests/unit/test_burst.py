"""A burst of new trainings: every job before any status, and no reconcile for an echo.

Through the real Reconciler on the toy backend's in-memory store (support.toyjob), with watch
events delivered as Kopf delivers them: the training's, then the job's once it exists. Tests
that need two trainings in flight at once start the reconciler's workers; the others work its
queue in the test's own thread (run_pending).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuop.controller import jobsfirst
from gpuop.controller.jobsfirst import JobsFirst
from gpuop.controller.reconciler import Reconciler
from gpuop.controller.settings import OperatorSettings
from support.specs import minimal
from support.toyjob import Store, ToyJobApi


def _add(store: Store, name: str) -> dict[str, Any]:
    body = minimal()
    body["metadata"] |= {"name": name, "namespace": "default", "uid": f"u-{name}", "generation": 1}
    store.trainings[("default", name)] = store._stamp(copy.deepcopy(body))
    return store.get_training("default", name) or {}


def _reconciler(store: Store) -> Reconciler:
    return Reconciler(
        store,  # type: ignore[arg-type]
        OperatorSettings(),
        clock=lambda: datetime(2026, 11, 25, 10, tzinfo=UTC),
    )


def _reconciles(reconciler: Reconciler) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for metric in reconciler.metrics.reconciles.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def _record_reconciles(reconciler: Reconciler) -> list[str]:
    """The names of the trainings reconciled from now on, in order (the list fills as they are)."""
    real = reconciler.reconcile
    asked: list[str] = []

    def recording(key: tuple[str, str]) -> str:
        asked.append(key[1])
        return real(key)

    reconciler.reconcile = recording  # type: ignore[method-assign]
    return asked


def _job_of(store: Store, name: str) -> dict[str, Any]:
    return copy.deepcopy(
        next(o for o in store.objects.values() if o["kind"] == "ToyJob" and o["metadata"]["name"] == name)
    )


def test_the_echo_of_our_own_writes_is_not_reconciled_and_news_is(toy: ToyJobApi) -> None:
    store = Store()
    reconciler = _reconciler(store)
    try:
        reconciler.training_event("ADDED", _add(store, "t"))
        reconciler.run_pending()
        assert store.trainings[("default", "t")]["status"]["phase"] == "Created"  # alone: at once
        before, writes = _reconciles(reconciler), store.status_writes

        reconciler.job_event("ADDED", _job_of(store, "t"))  # the job we made, as its watch shows it
        reconciler.training_event("MODIFIED", store.get_training("default", "t") or {})  # our status
        assert reconciler.queued() == 0  # not even queued
        reconciler.run_pending()
        assert _reconciles(reconciler) == before
        assert store.status_writes == writes

        job = store.job()
        job["status"] = {"state": "Running", "began": "2026-11-25T10:00:00Z"}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))  # news: reconciled
        reconciler.run_pending()
        assert sum(_reconciles(reconciler).values()) == sum(before.values()) + 1
        assert store.trainings[("default", "t")]["status"]["phase"] == "Running"
    finally:
        reconciler.close()


def test_an_echo_that_comes_while_its_reconcile_still_runs_is_put_down_when_taken(toy: ToyJobApi) -> None:
    """The event is queued (the reconcile it echoes has not said what it saw yet), and the key,
    taken after that reconcile, is found to hold nothing new."""
    store = Store()
    reconciler = _reconciler(store)
    try:
        reconciler.training_event("ADDED", _add(store, "t"))
        key = ("default", "t")
        taken = reconciler._queue.take_ready()
        assert taken == key
        assert reconciler.reconcile(key) == "created"
        tracked = reconciler._table.get(key)
        assert tracked is not None
        done, tracked.reconciled = tracked.reconciled, None  # as it was before that reconcile ended
        reconciler.training_event("MODIFIED", store.get_training(*key) or {})  # our status, echoed
        assert reconciler.queued() == 0  # held back: a worker has the key
        tracked.reconciled = done
        reconciler._queue.done(key)  # the reconcile ends: the key is queued again behind it
        before = _reconciles(reconciler)
        assert reconciler.run_pending() == 1
        assert _reconciles(reconciler) == before  # taken, and put down unreconciled
    finally:
        reconciler.close()


def test_a_first_status_handed_back_waits_behind_a_training_that_arrives_after_it(toy: ToyJobApi) -> None:
    """A burst's statuses, handed back when its last job is made, hold up no job of a training
    that arrives meanwhile: the job is what starts the work."""
    store = Store()
    reconciler = _reconciler(store)
    asked = _record_reconciles(reconciler)
    try:
        reconciler.training_event("ADDED", _add(store, "a"))
        reconciler.training_event("ADDED", _add(store, "b"))
        queue = reconciler._queue
        for _ in range(2):  # "a" makes its job and leaves its status ("b" waits); "b" does both
            key = queue.take_ready()
            assert key is not None
            reconciler._work(key)
            queue.done(key)
        assert _status(store, "a") is None
        assert _status(store, "b") is not None
        reconciler.training_event("ADDED", _add(store, "c"))  # arrives as "a"'s status is handed back
        reconciler.run_pending()
        assert asked == ["a", "b", "c", "a"]
        assert (_status(store, "a") or {}).get("phase") == "Created"
    finally:
        reconciler.close()


def test_a_first_status_handed_back_while_the_reconcile_that_left_it_still_runs_is_written(
    toy: ToyJobApi,
) -> None:
    """The reconcile that left it for later keeps that decision: the hand-back that comes before
    it ends (the last other training got its job meanwhile) must find the key still to do."""
    store = Store()
    reconciler = _reconciler(store)
    left = reconciler._first_status_later

    def left_then_handed_back(tracked: Any, generation: object) -> float | None:
        leaves = left(tracked, generation)
        if tracked.body["metadata"]["name"] == "a":  # "b" gets its job at this moment, elsewhere
            reconciler._queue_statuses(reconciler._jobs_first.settled(("default", "b")))
        return leaves

    reconciler._first_status_later = left_then_handed_back  # type: ignore[method-assign]
    reconciler._sync._first_status_later = left_then_handed_back
    try:
        reconciler.training_event("ADDED", _add(store, "a"))
        reconciler.training_event("ADDED", _add(store, "b"))
        reconciler.run_pending()
        assert (_status(store, "a") or {}).get("phase") == "Created"
        assert (_status(store, "b") or {}).get("phase") == "Created"
    finally:
        reconciler.close()


def test_a_key_queued_while_leading_is_put_down_once_it_stands_by(toy: ToyJobApi) -> None:
    leading = [True]
    store = Store()
    reconciler = Reconciler(
        store,  # type: ignore[arg-type]
        OperatorSettings(),
        clock=lambda: datetime(2026, 11, 25, 10, tzinfo=UTC),
        leading=lambda: leading[0],
    )
    try:
        reconciler.training_event("ADDED", _add(store, "t"))  # Kopf delivered it while leading
        leading[0] = False
        reconciler.run_pending()
        assert _reconciles(reconciler) == {}
        assert not _job_made(store, "t")
    finally:
        reconciler.close()


class _HeldStore(Store):
    """A store whose create of one training's job waits until the test lets it go."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.reached = threading.Event()
        self.release = threading.Event()

    def create_object(self, obj: Mapping[str, Any], plural: str) -> dict[str, Any]:
        if obj["kind"] == "ToyJob" and obj["metadata"]["name"] == self.held:
            self.reached.set()
            assert self.release.wait(10)
        return super().create_object(obj, plural)


def _eventually(what: Callable[[], object], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, f"not within {seconds:g} s"
        time.sleep(0.01)


def _status(store: Store, name: str) -> dict[str, Any] | None:
    status: dict[str, Any] | None = store.trainings[("default", name)].get("status")
    return status


def _job_made(store: Store, name: str) -> bool:
    return any(o["kind"] == "ToyJob" and o["metadata"]["name"] == name for o in store.objects.values())


@dataclass
class _Burst:
    """Two new trainings: "slow", whose job create is held until ``release``, and "fast"."""

    store: _HeldStore
    reconciler: Reconciler
    fast: dict[str, Any]

    def release(self) -> None:
        self.store.release.set()


@contextlib.contextmanager
def _slow_waits_for_its_job() -> Iterator[_Burst]:
    """A burst in which "slow" waits for its job (a worker held in its create) while the test
    delivers "fast"'s events to the other worker; everything released and closed afterwards."""
    store = _HeldStore(held="slow")
    reconciler = _reconciler(store)
    slow_body, fast_body = _add(store, "slow"), _add(store, "fast")
    burst = _Burst(store, reconciler, fast_body)
    reconciler.start(workers=2)
    try:
        reconciler.training_event("ADDED", slow_body)
        assert store.reached.wait(10)  # "slow" is waiting for its job
        yield burst
    finally:
        burst.release()
        reconciler.close()  # waits for the Events, which are posted off the reconcile's thread


def test_while_others_wait_for_their_jobs_a_first_status_is_written_once_none_waits(toy: ToyJobApi) -> None:
    with _slow_waits_for_its_job() as burst:
        store, reconciler = burst.store, burst.reconciler
        reconciler.training_event("ADDED", burst.fast)
        _eventually(lambda: _reconciles(reconciler).get("created") == 1)
        assert _job_of(store, "fast")["metadata"]["ownerReferences"][0]["uid"] == "u-fast"
        assert _status(store, "fast") is None  # its job first, not its status
        reconciler.job_event("ADDED", _job_of(store, "fast"))  # its job's event: "slow" still waits
        assert reconciler.queued() == 1  # "fast" at its deadline, and nothing more
        assert _status(store, "fast") is None

        burst.release()
        # The last of the burst to get its job: nobody waits, so its status is written at once,
        # and the one left for later is queued again, with no event needed.
        _eventually(lambda: (_status(store, "slow") or {}).get("phase") == "Created")
        _eventually(lambda: (_status(store, "fast") or {}).get("phase") == "Created")
        assert _reconciles(reconciler).get("created") == 2
    assert store.events == ["ToyJobCreated", "ToyJobCreated"]  # one each, the deferred one too


def test_while_its_first_status_waits_only_a_spec_edit_or_a_lost_job_reconciles_a_training(
    toy: ToyJobApi,
) -> None:
    """Its job's echo and its controller's updates are left to the reconcile that writes the first
    status (it sees them then), and so is the tick; a spec edit is worked as it comes. In a burst
    those events each cost a reconcile that did nothing (1.6-1.8 a training, bench/operator_scale.py)."""
    with _slow_waits_for_its_job() as burst:
        store, reconciler = burst.store, burst.reconciler
        asked = _record_reconciles(reconciler)
        reconciler.training_event("ADDED", burst.fast)
        _eventually(lambda: _job_made(store, "fast") and reconciler.queued() == 1)  # its deadline
        assert _status(store, "fast") is None  # left for later
        reconciler.job_event("ADDED", _job_of(store, "fast"))  # the echo of its create
        assert asked == ["fast"]

        lost = next(
            k for k, o in store.objects.items() if o["metadata"]["name"] == "fast" and o["kind"] == "ToyJob"
        )
        reconciler.job_event("DELETED", store.objects.pop(lost))
        _eventually(lambda: lost in store.objects)  # made again
        _eventually(lambda: len(asked) == 2)
        assert asked == ["fast", "fast"]

        job = store.objects[lost]
        job["status"] = {"state": "Running", "began": "2026-11-25T10:00:00Z"}
        reconciler.job_event("MODIFIED", copy.deepcopy(store._stamp(job)))  # its controller's news
        reconciler.tick()  # queues "slow" alone, which a worker has: held back
        time.sleep(0.2)
        assert asked == ["fast", "fast"]

        edited = store.trainings[("default", "fast")]
        edited["metadata"]["generation"] = 2
        edited["spec"]["runPolicy"] = {"suspend": True}
        reconciler.training_event("MODIFIED", copy.deepcopy(store._stamp(edited)))
        _eventually(lambda: store.objects[lost]["spec"]["paused"] is True)  # patched while "slow" waits
        assert asked == ["fast", "fast", "fast"]
        assert _status(store, "fast") is None

        burst.release()
        # Queued again once none waits, and written with all it was not reconciled for.
        _eventually(lambda: (_status(store, "fast") or {}).get("observedGeneration") == 2)
        status = _status(store, "fast") or {}
        assert status["phase"] == "Running"


def test_a_job_that_ends_while_its_first_status_waits_has_its_result_written_at_once(toy: ToyJobApi) -> None:
    """A short program's job may end within the burst, and its TTL delete it, before the last
    other job is made: its result, read from the job, must not wait for them (else the status
    written after the job's TTL deleted it takes the time of that write as its completion)."""
    with _slow_waits_for_its_job() as burst:
        store, reconciler = burst.store, burst.reconciler
        reconciler.training_event("ADDED", burst.fast)
        _eventually(lambda: _job_made(store, "fast") and reconciler.queued() == 1)  # its deadline
        assert _status(store, "fast") is None  # left for later
        made = next(
            k for k, o in store.objects.items() if o["metadata"]["name"] == "fast" and o["kind"] == "ToyJob"
        )
        job = store.objects[made]
        job["status"] = {"state": "Done", "began": "2026-11-25T10:00:00Z", "since": "2026-11-25T10:00:03Z"}
        reconciler.job_event("MODIFIED", copy.deepcopy(store._stamp(job)))
        # Within 5 s: at 10 "slow"'s held create gives up, which would end the burst anyway.
        _eventually(lambda: (_status(store, "fast") or {}).get("phase") == "Succeeded", seconds=5)
        assert (_status(store, "fast") or {})["completionTime"] == "2026-11-25T10:00:03Z"  # the job's
        assert not _job_made(store, "slow")  # "slow" still waits for its job: the burst is not over


def test_a_job_deleted_as_it_ended_is_written_as_ended_and_never_made_again(toy: ToyJobApi) -> None:
    """A job its controller deletes as soon as it ends (a TTL of seconds, an operator busy
    meanwhile): its DELETED event can be the first the operator hears of its end. That end is
    the training's, and the job is not made and run a second time."""
    store = Store()
    reconciler = _reconciler(store)
    try:
        reconciler.training_event("ADDED", _add(store, "t"))
        reconciler.run_pending()
        assert store.created == ["ToyConfig", "ToyJob"]
        assert _status(store, "t")["phase"] == "Created"  # type: ignore[index]
        made = next(k for k, o in store.objects.items() if o["kind"] == "ToyJob")
        job = store.objects.pop(made)  # ended, then deleted by its TTL, before any reconcile
        job["status"] = {"state": "Done", "began": "2026-11-25T10:00:00Z", "since": "2026-11-25T10:00:03Z"}
        reconciler.job_event("DELETED", copy.deepcopy(store._stamp(job)))
        reconciler.run_pending()
        assert store.created == ["ToyConfig", "ToyJob"]  # not made again
        ended = _status(store, "t") or {}
        assert (ended["phase"], ended["completionTime"]) == ("Succeeded", "2026-11-25T10:00:03Z"), ended
        # Its next pass, at once, finds the job gone and says so.
        reconciler.run_pending()
        conditions = {c["type"]: c for c in (_status(store, "t") or {})["conditions"]}
        assert conditions["JobDeleted"]["status"] == "True", conditions
        assert (_status(store, "t") or {})["phase"] == "Succeeded"
        assert store.created == ["ToyConfig", "ToyJob"]
    finally:
        reconciler.close()


def test_a_first_status_is_left_for_later_only_so_long(
    toy: ToyJobApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steady stream of new trainings, where some always wait, must not keep statuses unwritten."""
    monkeypatch.setattr(jobsfirst, "AT_MOST", 0.0)
    with _slow_waits_for_its_job() as burst:
        burst.reconciler.training_event("ADDED", burst.fast)
        # At once, in the reconcile that made its job (counted as that reconcile returns).
        _eventually(lambda: _reconciles(burst.reconciler) == {"created": 1})
        assert _status(burst.store, "fast") is not None


def test_a_training_slow_to_get_its_job_holds_anothers_first_status_only_so_long(
    toy: ToyJobApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No event and no tick needed: the status whose time is up is written while "slow" still waits."""
    monkeypatch.setattr(jobsfirst, "AT_MOST", 2.0)  # long enough for "fast"'s reconcile on a loaded machine
    with _slow_waits_for_its_job() as burst:
        burst.reconciler.training_event("ADDED", burst.fast)
        _eventually(lambda: _job_made(burst.store, "fast"))
        assert _status(burst.store, "fast") is None  # left for later
        _eventually(lambda: (_status(burst.store, "fast") or {}).get("phase") == "Created")
        assert not burst.store.release.is_set()  # "slow" still waits for its job
        assert _status(burst.store, "slow") is None


class _EditedMeanwhileStore(Store):
    """A store in which the user edits the spec while the operator's status patch is on its way:
    the patch's reply carries the edit, and the edit's own event comes after, older than it."""

    def __init__(self) -> None:
        super().__init__()
        self.edit_on_next_status = False
        self.edit_event: dict[str, Any] | None = None

    def patch_training_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        if self.edit_on_next_status:
            self.edit_on_next_status = False
            body = self.trainings[(namespace, name)]
            body["metadata"]["generation"] += 1
            body["spec"]["workers"] = 3
            self.edit_event = copy.deepcopy(self._stamp(body))
        return super().patch_training_status(namespace, name, patch)


def test_a_spec_edited_while_our_status_write_was_on_its_way_is_reconciled(toy: ToyJobApi) -> None:
    store = _EditedMeanwhileStore()
    reconciler = _reconciler(store)
    try:
        store.edit_on_next_status = True
        reconciler.training_event("ADDED", _add(store, "t"))
        assert reconciler.run_pending() == 2  # the reply brought the edit: queued again at once
        assert store.edit_event is not None
        status = store.trainings[("default", "t")]["status"]
        assert status["observedGeneration"] == 2
        assert status["workers"]["total"] == 3
        writes = store.status_writes
        reconciler.training_event("MODIFIED", store.edit_event)  # older than our status write's reply
        reconciler.run_pending()
        assert store.status_writes == writes
    finally:
        reconciler.close()


def test_a_late_deleted_event_of_an_older_object_of_that_name_leaves_the_new_one(toy: ToyJobApi) -> None:
    store = Store()
    reconciler = _reconciler(store)
    try:
        old = _add(store, "t")
        reconciler.training_event("ADDED", old)
        reconciler.run_pending()
        renewed = copy.deepcopy(old)
        renewed["metadata"]["uid"] = "u-t-2"  # deleted and created again under the same name
        store.trainings[("default", "t")] = store._stamp(renewed)
        reconciler.training_event("ADDED", store.get_training("default", "t") or {})
        reconciler.run_pending()
        reconciler.training_event("DELETED", old)  # the old one's deletion, seen last
        assert reconciler.tracked() == 1
        reconciler.training_event("DELETED", store.get_training("default", "t") or {})
        assert reconciler.tracked() == 0
    finally:
        reconciler.close()


def test_statuses_left_for_later_are_all_queued_once_none_waits_and_each_only_so_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JobsFirst alone: a status is left only while another training waits for its job, and only
    until its deadline or a new generation of its spec; the last one waiting settles them all."""
    monkeypatch.setattr(jobsfirst, "AT_MOST", 10.0)
    gate = JobsFirst()
    now = time.monotonic()
    assert gate.leave_for_later(("ns", "alone"), now, 1) is None  # none waits: written now
    gate.awaits(("ns", "waiting"))
    gate.awaits(("ns", "late"))
    wait = gate.leave_for_later(("ns", "late"), now - 5.0, 1)
    assert wait is not None
    assert 4.0 < wait <= 5.0  # queued again at its deadline
    assert gate.leave_for_later(("ns", "past"), now - 10.0, 1) is None  # its time is up
    assert gate.leave_for_later(("ns", "edited"), now, 1) is not None
    assert gate.waits(("ns", "late"), 1)
    assert not gate.waits(("ns", "edited"), 2)  # a new spec is worked at once
    assert not gate.waits(("ns", "edited"), 1)  # and is no longer left
    assert gate.settled(("ns", "other")) == []  # "waiting" still waits
    assert gate.forget(("ns", "waiting")) == [("ns", "late")]  # the last one waiting is gone
    assert not gate.waits(("ns", "late"), 1)
    assert gate.settled(("ns", "late")) == []  # handed over once
