"""A burst of new trainings: every job before any status, and no reconcile for an echo.

Through the real Reconciler on the toy backend's in-memory store (support.toyjob), with watch
events delivered as Kopf delivers them: the training's, then the job's once it exists.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuop.controller import jobsfirst
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
        OperatorSettings(peering_name=None),
        clock=lambda: datetime(2026, 11, 25, 10, tzinfo=UTC),
    )


def _reconciles(reconciler: Reconciler) -> dict[str, float]:
    return {
        sample.labels["outcome"]: sample.value
        for metric in reconciler.metrics.reconciles.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    }


def _job_of(store: Store, name: str) -> dict[str, Any]:
    return copy.deepcopy(
        next(o for o in store.objects.values() if o["kind"] == "ToyJob" and o["metadata"]["name"] == name)
    )


def test_the_echo_of_our_own_writes_is_not_reconciled_and_news_is(toy: ToyJobApi) -> None:
    store = Store()
    reconciler = _reconciler(store)
    try:
        reconciler.training_event("ADDED", _add(store, "t"))
        assert store.trainings[("default", "t")]["status"]["phase"] == "Created"  # alone: at once
        before, writes = _reconciles(reconciler), store.status_writes

        reconciler.job_event("ADDED", _job_of(store, "t"))  # the job we made, as its watch shows it
        reconciler.training_event("MODIFIED", store.get_training("default", "t") or {})  # our status
        assert _reconciles(reconciler) == before
        assert store.status_writes == writes

        job = store.job()
        job["status"] = {"state": "Running", "began": "2026-11-25T10:00:00Z"}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))  # news: reconciled
        assert sum(_reconciles(reconciler).values()) == sum(before.values()) + 1
        assert store.trainings[("default", "t")]["status"]["phase"] == "Running"
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


def _wait_for_status(store: Store, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while "status" not in store.trainings[("default", name)] and time.monotonic() < deadline:
        time.sleep(0.01)
    status: dict[str, Any] = store.trainings[("default", name)]["status"]
    return status


@dataclass
class _Burst:
    """Two new trainings: "slow", whose job create is held until ``release``, and "fast"."""

    store: _HeldStore
    reconciler: Reconciler
    fast: dict[str, Any]
    slow: threading.Thread

    def release(self) -> None:
        self.store.release.set()
        self.slow.join(10)


@contextlib.contextmanager
def _slow_waits_for_its_job() -> Iterator[_Burst]:
    """A burst in which "slow" waits for its job (its reconcile held in the create) while the
    test delivers "fast"'s events; everything released and closed afterwards."""
    store = _HeldStore(held="slow")
    reconciler = _reconciler(store)
    slow_body, fast_body = _add(store, "slow"), _add(store, "fast")
    slow = threading.Thread(target=reconciler.training_event, args=("ADDED", slow_body))
    burst = _Burst(store, reconciler, fast_body, slow)
    try:
        slow.start()
        assert store.reached.wait(10)  # "slow" is waiting for its job
        yield burst
    finally:
        burst.release()
        reconciler.close()  # waits for the Events, which are posted off the reconcile's thread


def test_while_others_wait_for_their_jobs_a_first_status_is_written_once_none_waits(toy: ToyJobApi) -> None:
    with _slow_waits_for_its_job() as burst:
        store, reconciler = burst.store, burst.reconciler
        reconciler.training_event("ADDED", burst.fast)
        assert _job_of(store, "fast")["metadata"]["ownerReferences"][0]["uid"] == "u-fast"
        assert "status" not in store.trainings[("default", "fast")]  # its job first, not its status
        reconciler.job_event("ADDED", _job_of(store, "fast"))  # its job's event: "slow" still waits
        assert "status" not in store.trainings[("default", "fast")]

        burst.release()
        # The last of the burst to get its job: nobody waits, so its status is written at once,
        # and the one left for later by the pool, with no event needed.
        assert store.trainings[("default", "slow")]["status"]["phase"] == "Created"
        assert _wait_for_status(store, "fast")["phase"] == "Created"
        assert _reconciles(reconciler).get("created") == 2
    assert store.events == ["ToyJobCreated", "ToyJobCreated"]  # one each, the deferred one too


def test_while_its_first_status_waits_only_a_spec_edit_or_a_lost_job_reconciles_a_training(
    toy: ToyJobApi,
) -> None:
    """Its job's echo and its controller's updates are left to the reconcile that writes the first
    status (it sees them then), and so is the tick; a spec edit is applied at once. In a burst those
    events each cost a reconcile that did nothing (1.6-1.8 a training, bench/operator_scale.py)."""
    with _slow_waits_for_its_job() as burst:
        store, reconciler = burst.store, burst.reconciler
        real = reconciler.reconcile
        asked: list[str] = []

        def recording(key: tuple[str, str]) -> str:
            asked.append(key[1])
            return "held" if key[1] == "slow" else real(key)  # "slow"'s lock is held in its create

        reconciler.reconcile = recording  # type: ignore[method-assign]
        reconciler.training_event("ADDED", burst.fast)
        assert "status" not in store.trainings[("default", "fast")]  # left for later
        reconciler.job_event("ADDED", _job_of(store, "fast"))  # the echo of its create
        assert asked == ["fast"]

        lost = next(
            k for k, o in store.objects.items() if o["metadata"]["name"] == "fast" and o["kind"] == "ToyJob"
        )
        reconciler.job_event("DELETED", store.objects.pop(lost))
        assert asked == ["fast", "fast"]
        assert lost in store.objects  # made again at once

        job = store.objects[lost]
        job["status"] = {"state": "Running", "began": "2026-11-25T10:00:00Z"}
        reconciler.job_event("MODIFIED", copy.deepcopy(store._stamp(job)))  # its controller's news
        reconciler.tick()
        assert asked == ["fast", "fast", "slow"]  # the tick's only for "slow"

        edited = store.trainings[("default", "fast")]
        edited["metadata"]["generation"] = 2
        edited["spec"]["runPolicy"] = {"suspend": True}
        reconciler.training_event("MODIFIED", copy.deepcopy(store._stamp(edited)))
        assert asked[-1] == "fast"
        assert store.objects[lost]["spec"]["paused"] is True  # patched while "slow" still waits
        assert "status" not in store.trainings[("default", "fast")]

        burst.release()
        status = _wait_for_status(store, "fast")  # by the pool, with all it was not reconciled for
        assert status["observedGeneration"] == 2
        assert status["phase"] == "Running"


def test_a_first_status_whose_hand_over_was_lost_is_written_by_the_tick_past_its_deadline(
    toy: ToyJobApi,
) -> None:
    """Events and the tick leave a waiting first status to its hand-over only until its deadline:
    a hand-over lost (forgotten by a DELETED of an older object of that name, handled at the same
    time in another thread) must not leave the status unwritten for good. Its deadline is moved
    into the past rather than waited for: no timer of the test's races the reconciler's."""
    with _slow_waits_for_its_job() as burst:
        store, reconciler = burst.store, burst.reconciler
        real = reconciler.reconcile
        reconciler.reconcile = lambda key: "held" if key[1] == "slow" else real(key)  # type: ignore[method-assign]
        reconciler.training_event("ADDED", burst.fast)
        reconciler._jobs_first.forget(("default", "fast"))  # its hand-over lost
        reconciler.tick()
        assert "status" not in store.trainings[("default", "fast")]  # before its deadline: left alone
        tracked = reconciler._table.get(("default", "fast"))
        assert tracked is not None
        tracked.first_seen -= jobsfirst.AT_MOST  # its deadline has passed
        reconciler.tick()
        assert store.trainings[("default", "fast")]["status"]["phase"] == "Created"
        assert burst.slow.is_alive()  # "slow" still waits for its job: none but the tick wrote it


def test_a_first_status_is_left_for_later_only_so_long(
    toy: ToyJobApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A steady stream of new trainings, where some always wait, must not keep statuses unwritten."""
    monkeypatch.setattr(jobsfirst, "AT_MOST", 0.0)
    with _slow_waits_for_its_job() as burst:
        burst.reconciler.training_event("ADDED", burst.fast)
        assert burst.store.trainings[("default", "fast")]["status"]["phase"] == "Created"  # at once


def test_a_training_slow_to_get_its_job_holds_anothers_first_status_only_so_long(
    toy: ToyJobApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No event and no tick needed: the status whose time is up is written while "slow" still waits."""
    monkeypatch.setattr(jobsfirst, "AT_MOST", 2.0)  # long enough for "fast"'s reconcile on a loaded machine
    with _slow_waits_for_its_job() as burst:
        burst.reconciler.training_event("ADDED", burst.fast)
        assert "status" not in burst.store.trainings[("default", "fast")]  # left for later
        assert _wait_for_status(burst.store, "fast")["phase"] == "Created"
        assert burst.slow.is_alive()  # "slow" still waits for its job
        assert "status" not in burst.store.trainings[("default", "slow")]


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
        assert store.edit_event is not None
        assert store.trainings[("default", "t")]["status"]["observedGeneration"] == 1
        reconciler.training_event("MODIFIED", store.edit_event)  # older than our status write's reply
        status = store.trainings[("default", "t")]["status"]
        assert status["observedGeneration"] == 2
        assert status["workers"]["total"] == 3
    finally:
        reconciler.close()


def test_a_late_deleted_event_of_an_older_object_of_that_name_leaves_the_new_one(toy: ToyJobApi) -> None:
    store = Store()
    reconciler = _reconciler(store)
    try:
        old = _add(store, "t")
        reconciler.training_event("ADDED", old)
        renewed = copy.deepcopy(old)
        renewed["metadata"]["uid"] = "u-t-2"  # deleted and created again under the same name
        store.trainings[("default", "t")] = store._stamp(renewed)
        reconciler.training_event("ADDED", store.get_training("default", "t") or {})
        reconciler.training_event("DELETED", old)  # the old one's deletion, seen last
        assert reconciler.tracked() == 1
        reconciler.training_event("DELETED", store.get_training("default", "t") or {})
        assert reconciler.tracked() == 0
    finally:
        reconciler.close()


def test_statuses_left_for_later_are_handed_over_as_each_comes_due_and_all_once_none_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JobsFirst alone: the soonest first while some still wait, none that was forgotten, and every
    one left at once when the last waiting training gets its job."""
    monkeypatch.setattr(jobsfirst, "AT_MOST", 10.0)
    handed: list[tuple[str, str]] = []
    gate = jobsfirst.JobsFirst(handed.append, workers=1)
    try:
        gate.waits(("ns", "waiting"))
        now = time.monotonic()
        with gate._lock:  # the hand-over thread sees all four calls at once, however slow the machine
            assert gate.leave_for_later(("ns", "late"), now - 5.0)  # due in 5 s
            assert gate.leave_for_later(("ns", "soon"), now - 9.5)  # due in 0.5 s
            assert gate.leave_for_later(("ns", "gone"), now - 9.6)  # due in 0.4 s, but forgotten first
            gate.forget(("ns", "gone"))
        deadline = time.monotonic() + 3.0
        while not handed and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert handed == [("ns", "soon")]
        gate.done(("ns", "waiting"))  # nobody waits now: the rest at once, not in 5 s
        deadline = time.monotonic() + 2.0
        while len(handed) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handed == [("ns", "soon"), ("ns", "late")]
        assert not gate.leave_for_later(("ns", "alone"), time.monotonic())  # none waits: written now
    finally:
        gate.close()


def test_a_status_left_for_later_twice_is_handed_over_once_and_the_hand_over_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its job's own event reconciles a training again, which leaves its status for later a second
    time with the same deadline: handed over twice, the thread handing them over once died."""
    monkeypatch.setattr(jobsfirst, "AT_MOST", 10.0)
    handed: list[tuple[str, str]] = []
    gate = jobsfirst.JobsFirst(handed.append, workers=1)

    def handed_over(count: int) -> None:
        deadline = time.monotonic() + 3.0
        while len(handed) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # and nothing more after it

    try:
        gate.waits(("ns", "waiting"))
        first_seen = time.monotonic() - 9.5  # due in 0.5 s
        with gate._lock:  # both before the hand-over thread looks, however slow the machine
            assert gate.leave_for_later(("ns", "twice"), first_seen)
            assert gate.leave_for_later(("ns", "twice"), first_seen)
        handed_over(1)
        assert handed == [("ns", "twice")]
        assert gate.leave_for_later(("ns", "next"), time.monotonic() - 9.5)
        handed_over(2)
        assert handed == [("ns", "twice"), ("ns", "next")]
    finally:
        gate.close()
