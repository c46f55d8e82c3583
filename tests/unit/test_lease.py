"""Which replica leads (gpuop.controller.lease): the Lease's rules, against an in-memory API
server that keeps one Lease and a few pods, on a monotonic timer and a clock the test moves.

The same Lease between real replicas is in tests/e2e_local/test_survival.py."""

from __future__ import annotations

import copy
import itertools
import logging
import random
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from gpuop.controller import lease as lease_module
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import Kube
from gpuop.controller.lease import LEASE_SECONDS, RENEW_DEADLINE_SECONDS, WARN_EVERY_SECONDS, LeaderLease
from support.waiting import ManualClock

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
LABEL = "gpuop.io/leader"  # what the chart's report Service selects


def _stamp(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class FakeKube:
    """The Lease and pod verbs of :class:`~gpuop.controller.kube.Kube`, on dicts, as the API
    server answers them: a write on a stale resourceVersion, or a create of a Lease that exists,
    is a 409. ``events`` is every write, in order."""

    def __init__(self, pods: dict[str, dict[str, str]] | None = None) -> None:
        self.lease: dict[str, Any] | None = None
        self.pods = pods or {}  # name -> labels
        self.events: list[tuple[str, str | None, str | None]] = []
        self.fail_get: ApiError | None = None
        self.fail_replace: ApiError | None = None
        self.on_failed_replace: Callable[[], None] = lambda: None
        self.before_write: Callable[[], object] | None = None  # once, as the next write begins
        self._versions = itertools.count(1)

    def _interpose(self) -> None:
        hook, self.before_write = self.before_write, None
        if hook is not None:
            hook()

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.fail_get is not None:
            raise self.fail_get
        return copy.deepcopy(self.lease)

    def create_lease(self, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        self._interpose()
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists')
        meta = {"name": name, "namespace": namespace, "resourceVersion": str(next(self._versions))}
        self.lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                      "spec": copy.deepcopy(spec)}  # fmt: skip
        self.events.append(("create", spec.get("holderIdentity"), None))
        return copy.deepcopy(self.lease)

    def replace_lease(self, lease: dict[str, Any], timeout: float = 3.0) -> dict[str, Any]:
        self._interpose()
        if self.fail_replace is not None:
            self.on_failed_replace()
            raise self.fail_replace
        assert self.lease is not None
        if lease["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified")
        self.lease = copy.deepcopy(lease)
        self.lease["metadata"]["resourceVersion"] = str(next(self._versions))
        self.events.append(("replace", lease["spec"].get("holderIdentity"), None))
        return copy.deepcopy(self.lease)

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        key, value = selector.split("=")
        return [{"metadata": {"name": name, "labels": dict(labels)}}
                for name, labels in self.pods.items() if labels.get(key) == value]  # fmt: skip

    def label_pod(self, namespace: str, name: str, key: str, value: str | None) -> None:
        self.events.append(("label", name, value))
        if name not in self.pods:
            return  # a pod that is gone is no error
        if value is None:
            self.pods[name].pop(key, None)
        else:
            self.pods[name][key] = value

    def holder(self) -> str | None:
        return None if self.lease is None else self.lease["spec"].get("holderIdentity")


def _replica(kube: FakeKube, identity: str, timer: ManualClock, **kwargs: Any) -> LeaderLease:
    return LeaderLease(cast(Kube, kube), "ns", "l", identity, timer=timer,
                       clock=lambda: T0 + timedelta(seconds=timer.now), **kwargs)  # fmt: skip


@pytest.fixture
def timer() -> ManualClock:
    return ManualClock(start=0.0)


def test_a_free_lease_is_created_and_held(timer: ManualClock) -> None:
    kube = FakeKube()
    a = _replica(kube, "a", timer)
    assert not a.leading()
    assert a.try_acquire_or_renew()
    assert a.leading()
    assert kube.lease is not None
    assert kube.lease["metadata"] | {"resourceVersion": "-"} == {
        "name": "l",
        "namespace": "ns",
        "resourceVersion": "-",
    }
    assert kube.lease["spec"] == {
        "holderIdentity": "a",
        "leaseDurationSeconds": 15,
        "acquireTime": _stamp(0),
        "renewTime": _stamp(0),
        "leaseTransitions": 0,
    }
    timer.now = 2
    assert a.try_acquire_or_renew()  # a renewal: renewTime moves, acquireTime stays
    assert kube.lease["spec"]["renewTime"] == _stamp(2)
    assert kube.lease["spec"]["acquireTime"] == _stamp(0)
    assert kube.lease["spec"]["leaseTransitions"] == 0


def test_another_takes_it_only_once_it_saw_the_record_unchanged_for_its_duration(timer: ManualClock) -> None:
    """The record's renewTime is years old by the standby's clock (clocks are never compared):
    what counts is how long the standby itself has seen the record unchanged."""
    kube = FakeKube()
    a = LeaderLease(
        cast(Kube, kube), "ns", "l", "a", timer=timer, clock=lambda: datetime(2020, 1, 1, tzinfo=UTC)
    )
    b = _replica(kube, "b", timer)
    assert a.try_acquire_or_renew()  # and then a stops renewing (killed)
    timer.now = 5
    assert not b.try_acquire_or_renew()  # first seen now: 15 s from here
    timer.now = 5 + LEASE_SECONDS - 0.1
    assert not b.try_acquire_or_renew()
    assert not b.leading()
    assert kube.holder() == "a"
    timer.now = 5 + LEASE_SECONDS
    assert not a.leading()  # long past its renew deadline: never two leaders at once
    assert b.try_acquire_or_renew()
    assert b.leading()
    assert kube.lease is not None
    assert kube.lease["spec"]["holderIdentity"] == "b"
    assert kube.lease["spec"]["leaseTransitions"] == 1
    assert kube.lease["spec"]["acquireTime"] == _stamp(timer.now)


def test_a_lease_its_holder_keeps_renewing_is_never_taken(timer: ManualClock) -> None:
    kube = FakeKube()
    a, b = _replica(kube, "a", timer), _replica(kube, "b", timer)
    for second in range(0, 10 * LEASE_SECONDS, 2):
        timer.now = second
        assert a.try_acquire_or_renew()
        timer.now = second + 1
        assert not b.try_acquire_or_renew()
        assert a.leading()
        assert not b.leading()
    assert kube.holder() == "a"


def test_a_released_lease_is_taken_at_the_next_round(timer: ManualClock) -> None:
    kube = FakeKube()
    a, b = _replica(kube, "a", timer), _replica(kube, "b", timer)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # b has seen it held
    a.release()
    assert not a.leading()
    assert kube.lease is not None
    assert not kube.lease["spec"]["holderIdentity"]
    assert kube.lease["spec"]["leaseDurationSeconds"] == 1
    assert b.try_acquire_or_renew()  # no wait: nobody holds it
    assert kube.holder() == "b"
    assert kube.lease["spec"]["leaseDurationSeconds"] == LEASE_SECONDS
    assert kube.lease["spec"]["leaseTransitions"] == 1


def test_a_leader_that_cannot_renew_stops_at_the_renew_deadline(
    timer: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each failed round takes 2 s here; run() goes on while the last renewal is younger than
    the deadline, then says the Lease is lost, once, and returns."""
    monkeypatch.setattr(lease_module, "RETRY_SECONDS", 0.0)
    monkeypatch.setattr(lease_module, "RETRY_FAILED_RENEWAL_SECONDS", 0.0)
    kube = FakeKube()
    lost: list[float] = []
    a = _replica(kube, "a", timer, on_lost=lambda: lost.append(timer.now))
    assert a.try_acquire_or_renew()
    seen: list[tuple[float, bool]] = []

    def one_failed_round() -> None:
        timer.now += 2
        seen.append((timer.now, a.leading()))
        if timer.now > 60:
            a.stop()  # a run() that never gives up: the assertions below say so

    kube.fail_replace, kube.on_failed_replace = ApiError(503, "ServiceUnavailable", "down"), one_failed_round
    a.run()
    assert seen == [(2, True), (4, True), (6, True), (8, True), (RENEW_DEADLINE_SECONDS, False)]
    assert lost == [RENEW_DEADLINE_SECONDS]
    assert not a.leading()


def test_a_holder_that_finds_another_holder_stops_at_once(timer: ManualClock) -> None:
    kube = FakeKube()
    a = _replica(kube, "a", timer)
    assert a.try_acquire_or_renew()
    assert kube.lease is not None
    kube.lease["spec"]["holderIdentity"] = "c"  # taken by another (a stalled meanwhile): a write,
    kube.lease["metadata"]["resourceVersion"] = "99"  # so the API server gave it a new version
    timer.now = 1
    assert not a.try_acquire_or_renew()
    assert not a.leading()  # not 10 s later: at once
    assert kube.holder() == "c"


def test_a_write_race_lost_is_no_warning(timer: ManualClock, caplog: pytest.LogCaptureFixture) -> None:
    """Both see no Lease; b creates it between a's read and a's create: a's create is a 409, a
    is not leading, and that is no WARNING (read again next round)."""
    kube = FakeKube()
    a, b = _replica(kube, "a", timer), _replica(kube, "b", timer)
    kube.before_write = b.try_acquire_or_renew
    assert not a.try_acquire_or_renew()
    assert not a.leading()
    assert b.leading()
    assert kube.holder() == "b"
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_the_leader_labels_its_pod_alone_and_unlabels_it_before_releasing(timer: ManualClock) -> None:
    kube = FakeKube(pods={"a": {}, "dead-leader": {LABEL: "true"}, "b": {"app": "gpuop"}})
    a = _replica(kube, "a", timer, pod="a")
    a.on_lead = a.stop  # one round of run(): it takes the Lease and labels its pod
    a.run()
    assert kube.pods == {"a": {LABEL: "true"}, "dead-leader": {}, "b": {"app": "gpuop"}}
    kube.events.clear()
    a.release()
    assert kube.pods["a"] == {}
    assert kube.events == [("label", "a", None), ("replace", None, None)]  # the label goes first


def test_an_unreadable_lease_is_one_warning_naming_the_fix_and_never_leads(
    timer: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=lease_module.__name__)
    kube = FakeKube()
    kube.fail_get = ApiError(403, "Forbidden", 'leases.coordination.k8s.io "l" is forbidden')
    a = _replica(kube, "a", timer)
    for second in range(0, int(WARN_EVERY_SECONDS), 2):
        timer.now = second
        assert not a.try_acquire_or_renew()
        assert not a.leading()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "403 Forbidden" in warnings[0]
    assert "grant get, create and update on coordination.k8s.io leases in ns" in warnings[0]
    assert "--standalone" in warnings[0]
    timer.now = WARN_EVERY_SECONDS
    assert not a.try_acquire_or_renew()
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 2  # once a minute
    kube.fail_get = None
    assert a.try_acquire_or_renew()
    assert "the Lease ns/l is read and written again" in [r.getMessage() for r in caplog.records]


def test_a_release_during_a_round_is_not_a_lost_lease(
    timer: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM's release() may come while run() is in a round (it waits for the round's lock).
    Once the round ends, release() sets the renewal to None; run(), seeing itself no longer
    leading, must not take that for a lost Lease (on_lost: exit status 1, an ERROR)."""
    kube = FakeKube()
    lost: list[float] = []
    a = _replica(kube, "a", timer, on_lost=lambda: lost.append(timer.now))
    assert a.try_acquire_or_renew()
    runner = threading.current_thread()
    waiting = threading.Event()

    class RoundLock:
        """The lock run() and release() share; the round's end lets release() run first, as the
        scheduler may."""

        def __init__(self) -> None:
            self.real = threading.Lock()
            self.releaser: threading.Thread | None = None

        def __enter__(self) -> None:
            if threading.current_thread() is not runner:
                waiting.set()
            self.real.acquire()

        def __exit__(self, *exc: object) -> None:
            self.real.release()
            if threading.current_thread() is runner and self.releaser is not None:
                self.releaser.join(5)

    lock = RoundLock()
    monkeypatch.setattr(a, "_lock", lock)

    def release_now() -> None:  # during the round's write
        lock.releaser = threading.Thread(target=a.release)
        lock.releaser.start()
        assert waiting.wait(5)

    kube.before_write = release_now
    a.run()
    assert not lock.releaser.is_alive()  # type: ignore[union-attr]
    assert not kube.holder()  # released
    assert lost == []


class FlakyKube(FakeKube):
    """An API server that fails a fifth of the Lease calls (a 503, or a reply lost after the
    write was made), as tests/controlplane's fault proxy does."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.random = random.Random(seed)
        self.gets = 0

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        if self.random.random() < 0.2:
            raise ApiError(503, "ServiceUnavailable", "injected")
        return super().get_lease(namespace, name)

    def replace_lease(self, lease: dict[str, Any], timeout: float = 3.0) -> dict[str, Any]:
        fault = self.random.random()
        if fault < 0.1:
            raise ApiError(503, "ServiceUnavailable", "injected")
        written = super().replace_lease(lease, timeout)
        if fault < 0.2:
            raise ApiError(0, "Timeout", "the reply was lost")  # written all the same
        return written


@pytest.mark.parametrize("seed", range(10))
def test_a_leader_keeps_its_lease_on_an_api_server_that_fails_a_fifth_of_its_calls(
    timer: ManualClock, seed: int
) -> None:
    """A renewal is one write of the Lease as last written (no read while nothing changed), and
    a failed one is tried again after RETRY_FAILED_RENEWAL_SECONDS, not a whole round later:
    with rounds 2 s apart and two calls each, an operator behind a fault proxy lost its Lease
    within a minute. Two minutes of rounds here (the fault proxy's test runs about one), each
    call taking a second; no Lease outlives such an API server for long."""
    kube = FlakyKube(seed)
    a = _replica(kube, "a", timer)
    while not a.try_acquire_or_renew():
        timer.now += 1
    gets = kube.gets
    rounds = 0
    while timer.now < 120:
        held = a.try_acquire_or_renew()
        timer.now += 1 + (lease_module.RETRY_SECONDS if held else lease_module.RETRY_FAILED_RENEWAL_SECONDS)
        assert a.leading(), f"lost at {timer.now:.1f}s"
        rounds += 1
    assert kube.holder() == "a"
    assert kube.gets - gets < rounds / 2  # a renewal writes without reading; reads follow failures
