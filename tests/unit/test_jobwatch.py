"""The operator's watch of its jobs (gpuop.controller.jobwatch): what it delivers, in which order,
how it resumes, relists and waits, and that one job's events never hold another's.

The API server here is a script (each list's and each watch's answer, in turn); the same watch
against a real kube-apiserver is in tests/controlplane/test_api.py."""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuop.api.identity import TRAINING_LABEL
from gpuop.controller import jobwatch
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import _event
from gpuop.controller.reconciler import Reconciler
from gpuop.controller.settings import OperatorSettings
from support.specs import minimal
from support.toyjob import Store, ToyJobApi
from support.waiting import wait_for


def _job(name: str, version: int, *, uid: str | None = None) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ml", "uid": uid or f"u-{name}", "resourceVersion": str(version)}
    meta["labels"] = {TRAINING_LABEL: name}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta, "spec": {"big": "x"}}


Answer = list[dict[str, Any]] | ApiError  # a list's items, or its error


class ScriptedKube:
    """Answers each list and each watch from its script, in turn; once a script is spent, a list
    fails (404) and a watch blocks until the test ends, as an idle stream does."""

    def __init__(self, lists: list[tuple[Answer, str]], watches: list[list[dict[str, Any]] | ApiError]):
        self.lists = lists
        self.watches = watches
        self.watched_from: list[str] = []
        self.watched_at: list[float] = []  # when each watch was opened (monotonic)
        self.listed = 0
        self.idle = threading.Event()

    def shutdown(self) -> None:  # what urllib3's shutdown() does to the open stream: it ends
        self.idle.set()

    def list_objects(self, api_version: str, plural: str, namespace: str | None, selector: str):  # type: ignore[no-untyped-def]
        assert selector == TRAINING_LABEL
        self.listed += 1
        if not self.lists:
            raise ApiError(404, "NotFound", "spent")
        answer, version = self.lists.pop(0)
        if isinstance(answer, ApiError):
            raise answer
        return copy.deepcopy(answer), version

    def watch_objects(self, api_version, plural, namespace, selector, version, *, timeout_seconds, opened):  # type: ignore[no-untyped-def]
        self.watched_from.append(version)
        self.watched_at.append(time.monotonic())
        opened(self)  # as the real one hands over its response, whose shutdown() ends the stream
        if not self.watches:
            self.idle.wait()
            return
        answer = self.watches.pop(0)
        if isinstance(answer, ApiError):
            raise answer
        for event in answer:
            if isinstance(event, ApiError):
                raise event
            yield copy.deepcopy(event)


def _watching(kube: ScriptedKube) -> tuple[jobwatch.JobWatch, list[tuple[str | None, str, str]]]:
    seen: list[tuple[str | None, str, str]] = []
    lock = threading.Lock()

    def handle(event_type: str | None, job: dict[str, Any]) -> None:
        with lock:
            meta = job["metadata"]
            seen.append((event_type, meta["name"], str(meta.get("resourceVersion", "-"))))

    watch = jobwatch.JobWatch(kube, [("kubeflow.org/v1", "pytorchjobs")], ["ml"], handle, workers=4)  # type: ignore[arg-type]
    watch.start()
    return watch, seen


@pytest.fixture(autouse=True)
def _quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobwatch, "NOT_SERVED_RETRY_SECONDS", 0.05)
    monkeypatch.setattr(jobwatch, "RECONNECT_SECONDS", 0.05)


def test_a_list_then_a_watch_from_its_version_resumed_from_the_last_version_seen() -> None:
    kube = ScriptedKube(
        lists=[([_job("a", 3)], "10")],
        watches=[
            [{"type": "ADDED", "object": _job("b", 11)}, {"type": "MODIFIED", "object": _job("a", 12)}],
            # The stream ended (the server's timeout): resumed from 12, no list.
            [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}}],
            [{"type": "DELETED", "object": _job("b", 21)}],
        ],
    )
    watch, seen = _watching(kube)
    try:
        wait_for(check=lambda: len(seen) == 4, timeout=5, what="four events")
        wait_for(check=lambda: len(kube.watched_from) == 4, timeout=5, what="the idle watch")
        assert kube.listed == 1
        assert kube.watched_from == ["10", "12", "20", "21"]  # a bookmark moves the version only
        assert sorted(seen, key=str) == sorted([(None, "a", "3"), ("ADDED", "b", "11"), ("MODIFIED", "a", "12"),
                                       ("DELETED", "b", "21")], key=str)  # fmt: skip
        assert [s for s in seen if s[1] == "a"] == [(None, "a", "3"), ("MODIFIED", "a", "12")]
        assert [s for s in seen if s[1] == "b"] == [("ADDED", "b", "11"), ("DELETED", "b", "21")]
    finally:
        kube.idle.set()
        watch.close()


def test_a_version_the_server_forgot_lists_again_and_tells_the_jobs_gone_meanwhile() -> None:
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                        "message": "too old resource version: 10 (50)"}}  # fmt: skip
    kube = ScriptedKube(
        lists=[([_job("a", 3), _job("b", 4)], "10"), ([_job("a", 40), _job("c", 41)], "50")],
        watches=[[gone]],
    )
    watch, seen = _watching(kube)
    try:
        wait_for(check=lambda: len(seen) == 5, timeout=5, what="five events")
        wait_for(check=lambda: kube.watched_from == ["10", "50"], timeout=5, what="the watch from the relist")
        assert ("DELETED", "b", "-") in seen  # only who it was: its last version is not known
        assert [s for s in seen if s[1] == "a"] == [(None, "a", "3"), (None, "a", "40")]
        assert (None, "c", "41") in seen
    finally:
        kube.idle.set()
        watch.close()


def test_a_job_api_not_served_is_looked_for_again_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    missing = ApiError(404, "NotFound", "the server could not find the requested resource")
    kube = ScriptedKube(
        lists=[(missing, ""), (missing, ""), (missing, ""), ([_job("a", 3)], "10")], watches=[]
    )
    with caplog.at_level(logging.INFO, logger="gpuop.controller.jobwatch"):
        watch, seen = _watching(kube)
        try:
            wait_for(check=lambda: seen == [(None, "a", "3")], timeout=5, what="the job once served")
        finally:
            kube.idle.set()
            watch.close()
    said = [r.getMessage() for r in caplog.records if "not served here" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("pytorchjobs in ml: not served here")


_ERROR_500 = {"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "InternalError",
                                          "message": "etcd leader changed"}}  # fmt: skip


def test_a_broken_stream_is_opened_again_from_the_last_version_without_a_list() -> None:
    kube = ScriptedKube(
        lists=[([], "10")],
        watches=[
            [{"type": "ADDED", "object": _job("a", 11)}, ApiError(0, "Unreachable", "connection reset")],
            ApiError(0, "Unreachable", "connection refused"),  # the API server restarting
            [{"type": "MODIFIED", "object": _job("a", 12)}, _ERROR_500],  # the server's trouble
            [{"type": "MODIFIED", "object": _job("a", 13)}, {"type": "ADDED", "object": "not an object"}],
            [{"type": "MODIFIED", "object": _job("a", 14)}],
        ],
    )
    watch, seen = _watching(kube)
    try:
        wait_for(check=lambda: len(seen) == 4, timeout=5, what="four events")
        assert kube.listed == 1
        assert kube.watched_from[:5] == ["10", "11", "11", "12", "13"]
        assert [v for _, _, v in seen] == ["11", "12", "13", "14"]
    finally:
        kube.idle.set()
        watch.close()


def test_a_stream_that_ends_at_once_is_not_opened_again_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobwatch, "RECONNECT_SECONDS", 0.1)
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "old"}}
    kube = ScriptedKube(lists=[([], str(v)) for v in range(1000)], watches=[[], [], [], [gone]] * 250)
    watch, _ = _watching(kube)
    try:
        wait_for(check=lambda: len(kube.watched_at) >= 6, timeout=30, what="six watches")
    finally:
        kube.idle.set()
        watch.close()
    # Each stream opened RECONNECT_SECONDS or more after the one before, the 410's relist
    # included: without the pause, hundreds a second. (A slow machine only widens the gaps.)
    opened = kube.watched_at[:6]
    gaps = [later - earlier for earlier, later in itertools.pairwise(opened)]
    assert min(gaps) >= 0.09, gaps  # 0.1 s, less the timer's rounding
    assert kube.listed >= 2  # the 410 of the fourth watch made it list again


def test_one_jobs_events_run_in_order_one_at_a_time_and_a_slow_one_holds_no_other() -> None:
    serial = jobwatch.Serial(4, "t")
    release = threading.Event()
    ran: list[tuple[str, int]] = []
    running: dict[str, int] = {"slow": 0, "quick": 0}
    overlap: list[str] = []
    lock = threading.Lock()

    def call(key: str, i: int) -> Callable[[], None]:
        def run() -> None:
            with lock:
                running[key] += 1
                if running[key] > 1:
                    overlap.append(key)
            if key == "slow" and i == 0:
                release.wait(5)
            time.sleep(0.001)
            with lock:
                running[key] -= 1
                ran.append((key, i))

        return run

    try:
        for i in range(20):
            serial.submit("slow", call("slow", i))
            serial.submit("quick", call("quick", i))
        # The slow key's first call holds its own 19 others, not the quick key's 20.
        wait_for(
            check=lambda: len([r for r in ran if r[0] == "quick"]) == 20, timeout=5, what="the quick key"
        )
        assert not [r for r in ran if r[0] == "slow"]
        release.set()
        wait_for(check=lambda: len(ran) == 40, timeout=5, what="every call")
        assert [i for k, i in ran if k == "slow"] == list(range(20))
        assert [i for k, i in ran if k == "quick"] == list(range(20))
        assert not overlap
    finally:
        release.set()
        serial.close()


def test_a_failing_call_leaves_its_keys_later_calls_to_run() -> None:
    serial = jobwatch.Serial(2, "t")
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("a defect")

    try:
        serial.submit("k", boom)
        serial.submit("k", lambda: ran.append(1))
        wait_for(check=lambda: ran == [1], timeout=5, what="the call after the failure")
    finally:
        serial.close()


def test_close_ends_the_streams_at_once() -> None:
    kube = ScriptedKube(lists=[([], "10")], watches=[])
    watch, _ = _watching(kube)
    wait_for(check=lambda: kube.watched_from == ["10"], timeout=5, what="the watch")
    started = time.monotonic()
    watch.close()  # cuts the idle stream (shutdown), which would otherwise wait forever
    assert time.monotonic() - started < 2
    assert not any(s.thread.is_alive() for s in watch._streams)


def test_a_standby_keeps_its_jobs_up_to_date_but_reconciles_none(toy: ToyJobApi) -> None:
    """The jobs' watch runs on every replica: on a standby (not leading) a job event updates
    what it knows and queues nothing, so leading again later does not reconcile it by itself;
    taking over (take_over) reconciles with the job as last seen, and a leader queues its job
    events again."""
    store = Store()
    leading = [True]
    reconciler = Reconciler(
        store,  # type: ignore[arg-type]
        OperatorSettings(),
        clock=lambda: datetime(2026, 11, 25, 10, tzinfo=UTC),
        leading=lambda: leading[0],
    )
    try:
        body = minimal()
        body["metadata"] |= {"name": "t", "namespace": "default", "uid": "u-t", "generation": 1}
        store.trainings[("default", "t")] = store._stamp(copy.deepcopy(body))
        reconciler.training_event("ADDED", store.get_training("default", "t") or {})
        reconciler.run_pending()
        job = store.job()
        assert store.trainings[("default", "t")]["status"]["phase"] == "Created"
        writes = store.status_writes

        leading[0] = False  # a standby now
        job["status"] = {"state": "Running", "began": "2026-11-25T10:00:00Z"}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
        leading[0] = True  # an event the standby had queued would be reconciled now: none was
        assert reconciler.run_pending() == 0
        assert store.status_writes == writes
        tracked = reconciler._table.get(("default", "t"))
        assert tracked is not None
        assert tracked.child is not None
        assert tracked.child["status"]["state"] == "Running"  # known, though not reconciled

        reconciler.take_over()  # the Lease taken: every known training is reconciled
        reconciler.run_pending()
        assert store.trainings[("default", "t")]["status"]["phase"] == "Running"

        job["status"] = {"state": "Done", "began": "2026-11-25T10:00:00Z", "since": "2026-11-25T10:05:00Z"}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))  # a leader queues it
        reconciler.run_pending()
        assert store.trainings[("default", "t")]["status"]["phase"] == "Succeeded"
    finally:
        reconciler.close()


def test_a_watch_line_that_is_not_a_json_object_breaks_the_stream_not_the_operator() -> None:
    assert _event(b'{"type": "ADDED", "object": {}}') == {"type": "ADDED", "object": {}}
    for line in (b"not json", b"[1, 2]", b'"a string"', b"\xff\xfe"):
        with pytest.raises(ApiError) as caught:
            _event(line)
        assert caught.value.status == 0  # resumed from the last version seen, as a broken stream


def test_cutting_a_stream_that_ended_meanwhile_is_no_error() -> None:
    """urllib3's shutdown() says ValueError once its response has given the socket back (the
    stream ended between the read of ``response`` and the cut); close() on SIGTERM raised it,
    and the operator exited 1."""

    class Ended:
        def shutdown(self) -> None:
            raise ValueError("Cannot shutdown socket as self._sock_shutdown is not set")

    stream = object.__new__(jobwatch._Stream)
    stream.response = Ended()  # type: ignore[assignment]
    stream.cut()
