"""The progress-report endpoint. Its decisions on their own, on a clock the test moves: paths,
tokens and the rate (gpuop.observing.endpoint.RateLimiter); the TokenReview, the pod binding and
the review cache (gpuop.controller.receiver.ClusterGate). Then the ReportServer
(gpuop.observing.endpoint) with a ClusterGate, over real HTTPS on 127.0.0.1 (certificates from
support.tls), with a fake Kube whose TokenReviews and pods the test decides and counts.

Each refusal is checked by its status and by what it did not do (no report in the book, no
TokenReview spent on a request refused before it). Timing tests bound their waits: a slow client
is watched as it is cut off (each read waits at most half a second for the close), and ``close()``
runs on a thread that must return in a bound while a connection is still open.
"""

from __future__ import annotations

import http.client
import itertools
import json
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from gpuop.api.identity import TRAINING_LABEL, report_audience, report_path, report_path_training
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import Kube
from gpuop.controller.receiver import ClusterGate
from gpuop.observing.endpoint import Limits, RateLimiter, RefusalError, ReportBook, ReportServer
from gpuop.observing.reports import MAX_REPORT_BYTES
from support.tls import serving_directory
from support.waiting import ManualClock, wait_for

NS = "team"
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"
LOGGER = "gpuop.observing.endpoint"
REPORT = json.dumps({
    "trainerStatus": {
        "progressPercentage": 41,
        "estimatedRemainingSeconds": 873,
        "metrics": [{"name": "loss", "value": "0.69"}, {"name": "current_step", "value": "615"},
                    {"name": "total_steps", "value": "1500"}],
        "lastUpdatedTime": "2026-11-21T12:00:00Z",
    }
}).encode()  # fmt: skip


def path(name: str, namespace: str = NS) -> str:
    return report_path(namespace, name)


# -- a Kube whose answers the test decides ---------------------------------------------------


@dataclass(frozen=True)
class Minted:
    """What the API server knows of a token."""

    namespace: str  # its ServiceAccount's
    audiences: tuple[str, ...]
    pod: str | None  # the pod it is bound to
    uid: str | None


@dataclass
class FakeKube:
    """TokenReview and pod reads as a real API server answers them, counted."""

    tokens: dict[str, Minted] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    reviews: list[tuple[str, str, float]] = field(default_factory=list)
    down: bool = False  # the API server cannot be reached
    lock: threading.Lock = field(default_factory=threading.Lock)

    def pod(self, name: str, training: str, namespace: str = NS) -> str:
        uid = f"uid-{name}-{secrets.token_hex(4)}"
        self.pods[(namespace, name)] = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "labels": {TRAINING_LABEL: training},
            }
        }
        return uid

    def mint(
        self, *, pod: str | None, training: str = "a", namespace: str = NS, uid: str | None = None
    ) -> str:
        """A projected token of a ServiceAccount of ``namespace``, bound to ``pod`` (with its uid
        as the pod has it unless given), with the audience of ``training``'s reports."""
        if pod is not None and uid is None:
            uid = self.pods[(namespace, pod)]["metadata"]["uid"]
        token = secrets.token_urlsafe(32)
        self.tokens[token] = Minted(namespace, (report_audience(NS, training),), pod, uid)
        return token

    def review_token(self, token: str, audience: str, timeout: float) -> dict[str, Any]:
        with self.lock:
            self.reviews.append((token, audience, timeout))
        if self.down:
            raise ApiError(0, "Unreachable", "connection refused")
        minted = self.tokens.get(token)
        if minted is None:
            return {"authenticated": False, "error": "invalid bearer token"}
        if audience not in minted.audiences:
            return {"authenticated": False, "error": "token audiences are invalid for the target audiences"}
        extra = {} if minted.pod is None else {POD_NAME: [minted.pod], POD_UID: [minted.uid]}
        user = {"username": f"system:serviceaccount:{minted.namespace}:trainer", "extra": extra}
        return {"authenticated": True, "user": user, "audiences": [audience]}

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.down:
            raise ApiError(0, "Unreachable", "connection refused")
        return self.pods.get((namespace, name))

    def reviewed(self, token: str) -> int:
        with self.lock:
            return sum(1 for t, _, _ in self.reviews if t == token)


@pytest.fixture
def kube() -> FakeKube:
    fake = FakeKube()
    fake.pod("a-0", "a")
    fake.pod("a-1", "a")
    fake.pod("b-0", "b")
    return fake


# -- the decisions, no sockets ----------------------------------------------------------------


DEFAULT = Limits()


class Later:
    """A gate's refresher that keeps its background reviews until the test runs them."""

    def __init__(self) -> None:
        self.jobs: list[Callable[[], None]] = []

    def __call__(self, job: Callable[[], None]) -> None:
        self.jobs.append(job)

    def run(self) -> int:
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()
        return len(jobs)


def gatekeeper(
    kube: FakeKube | None = None,
    limits: Limits = DEFAULT,
    clock: ManualClock | None = None,
    later: Callable[[Callable[[], None]], object] | None = None,
) -> ClusterGate:
    """A gate whose background reviews wait in a :class:`Later` (never run unless the test
    gives its own and runs it), so that what a test counts is only what it made happen."""
    return ClusterGate(cast(Kube, kube or FakeKube()), limits, clock or ManualClock(), later or Later())


def verdict_times(gate: ClusterGate) -> tuple[float, float]:
    """The one kept verdict's (refresh_at, expires)."""
    (verdict,) = gate._verdicts.values()
    return verdict.refresh_at, verdict.expires


def refusal(call: Callable[[], object]) -> tuple[int, str]:
    with pytest.raises(RefusalError) as caught:
        call()
    return caught.value.status, caught.value.outcome


@pytest.mark.parametrize(
    ("target", "key"),
    [
        (path("a"), (NS, "a")),
        (path("run.v2-x", "ns-1"), ("ns-1", "run.v2-x")),
        (path("a") + "?dryRun=All", (NS, "a")),
    ],
)
def test_the_path_names_one_training(target: str, key: tuple[str, str]) -> None:
    assert RateLimiter.target(target) == key


def test_the_path_is_shaped_like_kubeflows_under_our_api() -> None:
    # What every trainer is told: a change here breaks the pods already running.
    assert report_path("team", "a") == "/apis/gpuop.io/v1alpha1/namespaces/team/gputrainings/a/status"
    assert report_path_training(report_path("team", "a")) == ("team", "a")


@pytest.mark.parametrize(
    "target",
    [
        "/",
        "/apis/gpuop.io/v1alpha1/namespaces/team/gputrainings/a",
        "/apis/gpuop.io/v1alpha1/namespaces/team/gputrainings/a/status/",
        "/apis/gpuop.io/v1alpha1/namespaces/team/gputrainings/a/status/x",
        "/apis/gpuop.io/v1alpha1/namespaces/Team/gputrainings/a/status",
        "/apis/gpuop.io/v1alpha1/namespaces//gputrainings/a/status",
        "/apis/gpuop.io/v1/namespaces/team/gputrainings/a/status",
        "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team/trainjobs/a/status",  # Kubeflow's own
    ],
)
def test_any_other_path_is_404(target: str) -> None:
    assert refusal(lambda: RateLimiter.target(target)) == (404, "not_found")


@pytest.mark.parametrize(
    ("header", "token"), [("Bearer abc.def", "abc.def"), ("bearer  abc ", "abc"), ("BEARER x", "x")]
)
def test_a_bearer_token_is_read(header: str, token: str) -> None:
    assert RateLimiter.token(header) == token


@pytest.mark.parametrize(
    "header", [None, "", "Bearer", "Bearer   ", "Basic dXNlcjpwYXNz", "abc", "Bearer " + "x" * 16385]
)
def test_no_bearer_token_is_401(header: str | None) -> None:
    assert refusal(lambda: RateLimiter.token(header)) == (401, "no_token")


def test_the_rate_allows_a_burst_then_refills_per_token() -> None:
    clock = ManualClock()
    gate = RateLimiter(Limits(burst=3, reports_per_second=0.5), clock)
    for _ in range(3):
        gate.admit("one")
    assert refusal(lambda: gate.admit("one")) == (429, "rate_limited")
    gate.admit("two")  # a bucket per token
    clock.now += 1.9  # 0.95 of a report: still none
    assert refusal(lambda: gate.admit("one")) == (429, "rate_limited")
    clock.now += 0.1
    gate.admit("one")
    assert refusal(lambda: gate.admit("one")) == (429, "rate_limited")
    clock.now += 3600  # refilled, but never above the burst
    for _ in range(3):
        gate.admit("one")
    assert refusal(lambda: gate.admit("one")) == (429, "rate_limited")


def test_a_review_is_reused_for_its_ttl_per_token_and_audience(kube: FakeKube) -> None:
    clock, later = ManualClock(), Later()
    gate = gatekeeper(kube, Limits(review_ttl_seconds=60, review_seconds=2.5), clock, later)
    token = kube.mint(pod="a-0")
    for _ in range(5):
        assert gate.authenticate((NS, "a"), token) == "a-0"
    assert kube.reviews == [(token, report_audience(NS, "a"), 2.5)]
    clock.now += 59.9
    gate.authenticate((NS, "a"), token)
    assert later.run() == 0
    assert kube.reviewed(token) == 1
    clock.now += 30.1  # reviewed again after 1 to 1.5 TTLs, by its token's hash
    gate.authenticate((NS, "a"), token)
    later.run()
    assert kube.reviewed(token) == 2
    # Another training's URL: the same token is reviewed for that audience (and refused).
    assert refusal(lambda: gate.authenticate((NS, "b"), token)) == (401, "unauthenticated")
    assert kube.reviews[-1][1] == report_audience(NS, "b")


def test_a_refusal_is_reused_for_the_ttl_too(kube: FakeKube) -> None:
    clock = ManualClock()
    gate = gatekeeper(kube, Limits(review_ttl_seconds=60), clock)
    for _ in range(3):
        assert refusal(lambda: gate.authenticate((NS, "a"), "forged")) == (401, "unauthenticated")
    assert kube.reviewed("forged") == 1
    clock.now += 90
    refusal(lambda: gate.authenticate((NS, "a"), "forged"))
    assert kube.reviewed("forged") == 2


@pytest.mark.parametrize("reporting", ["steady", "after a silence"])
def test_tokens_reviewed_together_are_reviewed_again_spread_out(kube: FakeKube, reporting: str) -> None:
    """An operator's start reviews every training's token within one report interval; were
    their verdicts to come due together, all would be reviewed again in the same seconds, every
    TTL, with the reports queued behind (bench/report_scale.py at N=1000). Steady reporters are
    reviewed again after 1 to 1.5 TTLs (in the background: run here at once), reporters back
    from a silence when their verdict ends, half as long again (on the request)."""
    clock = ManualClock()
    steady = reporting == "steady"
    gate = gatekeeper(kube, Limits(review_ttl_seconds=60), clock, (lambda job: job()) if steady else Later())
    for i in range(200):
        kube.pod(f"a-{i}", "a")
    tokens = [kube.mint(pod=f"a-{i}") for i in range(200)]
    for i, token in enumerate(tokens):
        assert gate.authenticate((NS, "a"), token) == f"a-{i}"
    first, last = (59, 91) if steady else (89, 136)
    again, start = [], clock.now
    for second in range(first, last + 1):
        clock.now = start + second
        for token in tokens:
            gate.authenticate((NS, "a"), token)
        again.append(sum(kube.reviewed(t) == 2 for t in tokens))
    assert again[0] == 0  # none before one TTL (steady), or 1.5 TTLs
    assert again[-1] == len(tokens)  # all by 1.5 TTLs (steady), or 2.25 TTLs
    per_second = [b - a for a, b in itertools.pairwise(again)]
    assert max(per_second) <= len(tokens) // 10  # no second holds more than a tenth of them


def test_an_api_server_that_cannot_say_is_asked_again(kube: FakeKube) -> None:
    gate = gatekeeper(kube)
    token = kube.mint(pod="a-0")
    kube.down = True
    assert refusal(lambda: gate.authenticate((NS, "a"), token)) == (503, "review_failed")
    assert refusal(lambda: gate.authenticate((NS, "a"), token)) == (503, "review_failed")
    kube.down = False
    assert gate.authenticate((NS, "a"), token) == "a-0"
    assert kube.reviewed(token) == 3


def test_a_pod_read_that_fails_is_503_not_a_verdict(kube: FakeKube) -> None:
    gate = gatekeeper(kube)
    token = kube.mint(pod="a-0")

    def failing_get_pod(namespace: str, name: str) -> None:
        raise ApiError(500, "InternalError", "etcd timeout")

    kube.get_pod = failing_get_pod  # type: ignore[method-assign]
    assert refusal(lambda: gate.authenticate((NS, "a"), token)) == (503, "review_failed")
    del kube.get_pod
    assert gate.authenticate((NS, "a"), token) == "a-0"


def test_a_deleted_pod_stops_counting_once_its_token_is_reviewed_again(kube: FakeKube) -> None:
    clock, later = ManualClock(), Later()
    gate = gatekeeper(kube, Limits(review_ttl_seconds=60), clock, later)
    token = kube.mint(pod="a-0")
    assert gate.authenticate((NS, "a"), token) == "a-0"
    del kube.pods[(NS, "a-0")]
    assert gate.authenticate((NS, "a"), token) == "a-0"  # within the TTL, as documented
    clock.now += 90
    gate.authenticate((NS, "a"), token)  # starts the review
    later.run()
    assert refusal(lambda: gate.authenticate((NS, "a"), token)) == (403, "forbidden")
    # Had nobody reported, the verdict would have ended by itself, and the review come inline.
    silent = gatekeeper(kube, Limits(review_ttl_seconds=60), clock, Later())
    other = kube.mint(pod="a-1")
    silent.authenticate((NS, "a"), other)
    del kube.pods[(NS, "a-1")]
    clock.now += 135
    assert refusal(lambda: silent.authenticate((NS, "a"), other)) == (403, "forbidden")


class HeldKube(FakeKube):
    """Its TokenReviews wait until the test lets them through."""

    def __init__(self) -> None:
        super().__init__()
        self.through = threading.Event()
        self.through.set()

    def review_token(self, token: str, audience: str, timeout: float) -> dict[str, Any]:
        answer = super().review_token(token, audience, timeout)
        assert self.through.wait(10), "the test never let the review through"
        return answer


def test_a_steady_reporter_waits_for_the_api_server_on_its_first_report_only() -> None:
    """Past its review time, the report that uses a verdict starts the next review on the gate's
    own threads and is answered at once; one review at a time per token."""
    kube = HeldKube()
    kube.pod("a-0", "a")
    clock = ManualClock()
    gate = ClusterGate(cast(Kube, kube), Limits(review_ttl_seconds=60), clock)
    try:
        token = kube.mint(pod="a-0")
        assert gate.authenticate((NS, "a"), token) == "a-0"
        refresh_at, expires = verdict_times(gate)
        assert expires - clock.now == pytest.approx((refresh_at - clock.now) * 1.5)
        kube.through.clear()  # the API server is slow from now on
        clock.now = refresh_at - 0.1
        gate.authenticate((NS, "a"), token)
        assert kube.reviewed(token) == 1  # not yet due
        clock.now = refresh_at
        for _ in range(3):
            began = time.monotonic()
            assert gate.authenticate((NS, "a"), token) == "a-0"
            assert time.monotonic() - began < 3.0  # not held by the review under way (held for good)
        wait_for("the background review", lambda: kube.reviewed(token) == 2, timeout=5)
        kube.through.set()
        wait_for("the new verdict kept", lambda: verdict_times(gate)[1] > expires, timeout=5)
        assert kube.reviewed(token) == 2  # three reports, one review
    finally:
        kube.through.set()
        gate.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("token-review")]


def test_a_background_review_that_refuses_ends_the_pods_reports_before_the_verdict_expires(
    kube: FakeKube,
) -> None:
    clock, later = ManualClock(), Later()
    gate = gatekeeper(kube, Limits(review_ttl_seconds=60), clock, later)
    token = kube.mint(pod="a-0")
    gate.authenticate((NS, "a"), token)
    refresh_at, expires = verdict_times(gate)
    del kube.pods[(NS, "a-0")]
    clock.now = refresh_at
    assert gate.authenticate((NS, "a"), token) == "a-0"  # the kept verdict, as documented
    assert later.run() == 1
    assert clock.now < expires
    assert refusal(lambda: gate.authenticate((NS, "a"), token)) == (403, "forbidden")
    assert later.run() == 0  # a refusal is not reviewed ahead: it serves out its life


def test_a_background_review_the_api_server_cannot_answer_keeps_the_verdict_to_its_end(
    kube: FakeKube,
) -> None:
    clock, later = ManualClock(), Later()
    gate = gatekeeper(kube, Limits(review_ttl_seconds=60), clock, later)
    token = kube.mint(pod="a-0")
    gate.authenticate((NS, "a"), token)
    refresh_at, expires = verdict_times(gate)
    kube.down = True
    clock.now = refresh_at
    gate.authenticate((NS, "a"), token)
    assert later.run() == 1  # 503: nothing kept
    assert gate.authenticate((NS, "a"), token) == "a-0"
    assert later.run() == 1  # asked again on the next report
    assert kube.reviewed(token) == 3
    clock.now = expires  # never past its life
    assert refusal(lambda: gate.authenticate((NS, "a"), token)) == (503, "review_failed")


def test_a_closed_gate_starts_no_background_review(kube: FakeKube) -> None:
    clock = ManualClock()
    gate = ClusterGate(cast(Kube, kube), Limits(review_ttl_seconds=60), clock)
    token = kube.mint(pod="a-0")
    gate.authenticate((NS, "a"), token)
    gate.close()
    clock.now = verdict_times(gate)[0]
    assert gate.authenticate((NS, "a"), token) == "a-0"
    assert kube.reviewed(token) == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("token-review")]


@pytest.mark.parametrize(
    ("review", "expected"),
    [
        # An authenticator that ignores the audience asked for: its answer names another.
        ({"authenticated": True, "audiences": ["https://kubernetes.default.svc"],
          "user": {"username": "system:serviceaccount:team:trainer", "extra": {POD_NAME: ["a-0"]}}},
         (401, "unauthenticated")),
        # A person's token (a kubeconfig user), not a ServiceAccount's.
        ({"authenticated": True, "user": {"username": "alice@example.com"}}, (401, "unauthenticated")),
        ({"authenticated": True, "user": {"username": "system:serviceaccount:team"}}, (401, "unauthenticated")),
        ({"authenticated": False}, (401, "unauthenticated")),
        ({}, (401, "unauthenticated")),
        # Bound to a pod, but the review carries an empty pod-name list.
        ({"authenticated": True, "user": {"username": "system:serviceaccount:team:trainer",
                                          "extra": {POD_NAME: []}}}, (403, "forbidden")),
    ],
)  # fmt: skip
def test_odd_reviews_are_refused(review: dict[str, Any], expected: tuple[int, str]) -> None:
    class Odd(FakeKube):
        def review_token(self, token: str, audience: str, timeout: float) -> dict[str, Any]:
            return review

    gate = gatekeeper(Odd())
    assert refusal(lambda: gate.authenticate((NS, "a"), "t")) == expected


def test_remembered_tokens_are_bounded(kube: FakeKube) -> None:
    gate = gatekeeper(kube, Limits(remembered_tokens=2))
    first, second, third = (kube.mint(pod="a-0") for _ in range(3))
    for token in (first, second, third):
        gate.authenticate((NS, "a"), token)
    gate.authenticate((NS, "a"), third)
    assert kube.reviewed(third) == 1
    gate.authenticate((NS, "a"), first)  # forgotten: the oldest
    assert kube.reviewed(first) == 2


# -- the server, over HTTPS --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return serving_directory(
        tmp_path_factory.mktemp("report-tls"), ips=["127.0.0.1"], dns_names=["localhost"]
    )


@pytest.fixture(scope="module")
def client_context(tls_dir: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))


@dataclass
class Served:
    server: ReportServer
    kube: FakeKube
    book: ReportBook
    context: ssl.SSLContext | None
    counted: list[tuple[str, float]] = field(default_factory=list)  # (outcome, seconds) per request

    def post(self, target: str, body: bytes | None = REPORT, token: str | None = None,
             headers: dict[str, str] | None = None, timeout: float = 5) -> tuple[int, dict[str, Any]]:  # fmt: skip
        if self.context is None:
            connection: http.client.HTTPConnection = http.client.HTTPConnection(
                "127.0.0.1", self.server.port, timeout=timeout
            )
        else:
            connection = http.client.HTTPSConnection(
                "127.0.0.1", self.server.port, timeout=timeout, context=self.context
            )
        sent = {"Content-Type": "application/json", **(headers or {})}
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        try:
            connection.request("POST", target, body=body, headers=sent)
            reply = connection.getresponse()
            data = reply.read()
            return reply.status, json.loads(data) if data else {}
        finally:
            connection.close()

    def connect(self, timeout: float = 5) -> socket.socket:
        """A connection, TLS handshake done."""
        plain = socket.create_connection(("127.0.0.1", self.server.port), timeout=timeout)
        if self.context is None:
            return plain
        try:
            return self.context.wrap_socket(plain, server_hostname="127.0.0.1")
        except BaseException:
            plain.close()
            raise

    def raw(self, request: bytes, timeout: float = 5) -> int:
        """Send ``request`` as it is; the status the server answers."""
        with self.connect(timeout) as connection:
            connection.sendall(request)
            return answer_of(connection)

    def count(self, outcome: str) -> int:
        return sum(1 for counted, _ in self.counted if counted == outcome)


def read_to_close(connection: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = connection.recv(65536)
        except (ssl.SSLEOFError, ConnectionResetError):
            return data
        if not chunk:
            return data
        data += chunk


def status_of(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:200]
    return int(reply.split(b" ", 2)[1])


def answer_of(connection: socket.socket) -> int:
    """The status of the answer on ``connection``, its body read whole (the server may go on
    reading what the client sent before it closes)."""
    reply = http.client.HTTPResponse(connection)
    reply.begin()
    body = json.loads(reply.read())
    assert body["error"] if reply.status != 200 else body == {}
    return reply.status


def start(kube: FakeKube, limits: Limits, tls_dir: Path | None, context: ssl.SSLContext | None) -> Served:
    """A ReportServer on 127.0.0.1 (HTTPS with ``tls_dir``), its gate a ClusterGate on ``kube``."""
    book, counted = ReportBook(), []
    server = ReportServer(ClusterGate(cast(Kube, kube), limits), book,
                          lambda outcome, seconds: counted.append((outcome, seconds)),
                          port=0, host="127.0.0.1", tls_dir=tls_dir)  # fmt: skip
    server.start()
    return Served(server, kube, book, context if tls_dir is not None else None, counted)


@pytest.fixture(scope="module")
def shared(tls_dir: Path, client_context: ssl.SSLContext) -> Iterator[Served]:
    served = start(FakeKube(), DEFAULT, tls_dir, client_context)
    yield served
    served.server.close()


@pytest.fixture
def served(shared: Served) -> Served:
    """The module's server with the default Limits (one server: each one's close() waits out
    serve_forever's half-second poll), its fake API server and book as new. Tokens are new in
    every test, so neither the review cache nor the rate buckets carry anything over."""
    kube = shared.kube
    kube.tokens.clear()
    kube.pods.clear()
    kube.reviews.clear()
    kube.down = False
    for pod, training in (("a-0", "a"), ("a-1", "a"), ("b-0", "b")):
        kube.pod(pod, training)
    for training in ("a", "b"):
        shared.book.forget((NS, training))
    shared.counted.clear()
    return shared


@pytest.fixture
def serve(kube: FakeKube, tls_dir: Path, client_context: ssl.SSLContext) -> Iterator[Callable[..., Served]]:
    """Starts a ReportServer of its own with the given Limits; closed after the test, and then
    no thread it started may be left."""
    before = set(threading.enumerate())
    made: list[Served] = []

    def make(limits: Limits = DEFAULT, *, tls: bool = True) -> Served:
        made.append(start(kube, limits, tls_dir if tls else None, client_context))
        return made[-1]

    yield make
    for served in made:
        served.server.close()
    left = [t for t in set(threading.enumerate()) - before if (t.join(timeout=2), t.is_alive())[1]]
    assert not left, f"threads left after close(): {left}"


def test_an_accepted_report_lands_in_the_book(served: Served) -> None:
    kube = served.kube
    token = kube.mint(pod="a-1")
    assert served.post(path("a"), token=token) == (200, {})
    [received] = served.book.of((NS, "a"))
    assert received.pod == "a-1"
    assert (received.report.percent, received.report.step, received.report.total_steps) == (41.0, 615, 1500)
    assert received.report.loss == pytest.approx(0.69)
    assert served.book.of((NS, "b")) == ()
    assert kube.reviews == [(token, report_audience(NS, "a"), Limits().review_seconds)]
    [(outcome, seconds)] = served.counted
    assert outcome == "accepted"
    assert 0 < seconds < 5
    # The latest report per pod: a second one replaces the first, another pod's sits beside it.
    later = json.dumps({"trainerStatus": {"progressPercentage": 99}}).encode()
    assert served.post(path("a"), later, token=token)[0] == 200
    assert served.post(path("a"), token=kube.mint(pod="a-0"))[0] == 200
    by_pod = {r.pod: r.report.percent for r in served.book.of((NS, "a"))}
    assert by_pod == {"a-1": 99.0, "a-0": 41.0}


def test_a_request_is_counted_before_its_answer_goes_out(serve: Callable[..., Served]) -> None:
    """Once a client has its answer, the operator's metrics count it. Counted after the answer,
    a client could read its answer and then the metrics before the server's thread had counted
    (test_refusals once saw 0, in a clean-clone `make test`); a slow count makes that sure."""
    served = serve()
    count = served.server.counted

    def slowly(outcome: str, seconds: float) -> None:
        time.sleep(0.3)
        count(outcome, seconds)

    served.server.counted = slowly
    assert served.post(path("a"), token=None)[0] == 401
    assert served.count("no_token") == 1
    assert served.post(path("a"), token=served.kube.mint(pod="a-0"))[0] == 200
    assert served.count("accepted") == 1


@pytest.mark.parametrize(
    ("case", "status", "outcome"),
    [
        ("unknown path", 404, "not_found"),
        ("no token", 401, "no_token"),
        ("forged token", 401, "unauthenticated"),
        ("b's token at a's URL", 401, "unauthenticated"),  # wrong audience
        ("another namespace's ServiceAccount", 403, "forbidden"),
        ("not bound to a pod", 403, "forbidden"),
        ("bound to b's pod, a's audience", 403, "forbidden"),
        ("uid of an earlier pod of that name", 403, "forbidden"),
        ("pod gone", 403, "forbidden"),
    ],
)
def test_refusals(served: Served, case: str, status: int, outcome: str) -> None:
    kube = served.kube
    target, token = path("a"), kube.mint(pod="a-0")
    token_or_none: str | None = token
    if case == "unknown path":
        target = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team/trainjobs/a/status"
    elif case == "no token":
        token_or_none = None
    elif case == "forged token":
        token = secrets.token_urlsafe(32)
    elif case == "b's token at a's URL":
        token = kube.mint(pod="b-0", training="b")
    elif case == "another namespace's ServiceAccount":
        kube.pod("a-0", "a", namespace="elsewhere")
        token = kube.mint(pod="a-0", namespace="elsewhere")
    elif case == "not bound to a pod":
        token = kube.mint(pod=None)
    elif case == "bound to b's pod, a's audience":
        token = kube.mint(pod="b-0", training="a")
    elif case == "uid of an earlier pod of that name":
        token = kube.mint(pod="a-0", uid="uid-of-a-deleted-a-0")
    elif case == "pod gone":
        del kube.pods[(NS, "a-0")]
    got, document = served.post(target, token=token if case != "no token" else token_or_none)
    assert (got, served.count(outcome)) == (status, 1)
    assert document["error"]
    assert served.book.of((NS, "a")) == ()
    if case in ("unknown path", "no token"):
        assert kube.reviews == []  # refused before the API server is asked


def test_a_review_failure_is_503_and_not_remembered(served: Served) -> None:
    kube = served.kube
    token = kube.mint(pod="a-0")
    kube.down = True
    assert served.post(path("a"), token=token)[0] == 503
    kube.down = False
    assert served.post(path("a"), token=token)[0] == 200
    assert kube.reviewed(token) == 2
    assert (served.count("review_failed"), served.count("accepted")) == (1, 1)


def test_one_token_review_per_token_per_ttl(served: Served) -> None:
    kube = served.kube
    one, two = kube.mint(pod="a-0"), kube.mint(pod="a-1")
    for _ in range(4):
        assert served.post(path("a"), token=one)[0] == 200
    assert served.post(path("a"), token=two)[0] == 200
    assert (kube.reviewed(one), kube.reviewed(two)) == (1, 1)


def test_the_rate_limit_answers_429_after_the_burst_without_a_review(
    serve: Callable[..., Served], kube: FakeKube
) -> None:
    served = serve(Limits(burst=3, reports_per_second=0.001))
    token = kube.mint(pod="a-0")
    assert [served.post(path("a"), token=token)[0] for _ in range(5)] == [200, 200, 200, 429, 429]
    assert served.count("rate_limited") == 2
    # A forged token is rate limited as well, before it costs a TokenReview.
    forged = secrets.token_urlsafe(32)
    assert [served.post(path("a"), token=forged)[0] for _ in range(5)] == [401, 401, 401, 429, 429]
    assert kube.reviewed(forged) == 1


def head(target: str, token: str | None, *lines: str) -> bytes:
    auth = [f"Authorization: Bearer {token}"] if token else []
    return ("\r\n".join([f"POST {target} HTTP/1.1", "Host: 127.0.0.1", *auth, *lines]) + "\r\n\r\n").encode()


@pytest.mark.parametrize(
    "lines",
    [
        (),
        ("Content-Length: ",),
        ("Content-Length: -1",),
        ("Content-Length: 0x10",),
        ("Transfer-Encoding: chunked",),
        ("Transfer-Encoding: chunked", "Content-Length: 10"),
    ],
)
def test_no_content_length_is_411(served: Served, lines: tuple[str, ...]) -> None:
    kube = served.kube
    assert served.raw(head(path("a"), kube.mint(pod="a-0"), *lines)) == 411
    assert kube.reviews == []


def test_a_content_length_of_other_digits_is_411(served: Served) -> None:
    kube = served.kube
    # Latin-1 headers: "²" (U+00B2) is a digit to str.isdigit() and no number to int().
    request = head(path("a"), kube.mint(pod="a-0"), "Content-Length: X").replace(b"X", "²".encode("latin-1"))
    assert served.raw(request) == 411
    assert served.count("no_length") == 1


def test_a_declared_length_over_the_bound_is_413_before_any_body(served: Served) -> None:
    kube = served.kube
    token = kube.mint(pod="a-0")
    # The body is never sent: a server that waited for it would not answer before the timeout.
    request = head(path("a"), token, f"Content-Length: {MAX_REPORT_BYTES + 1}")
    assert served.raw(request, timeout=3) == 413
    assert kube.reviews == []  # refused before the API server is asked
    at = b" " * (MAX_REPORT_BYTES - len(REPORT)) + REPORT
    assert served.post(path("a"), at, token=token)[0] == 200
    # A client that sends its whole body, one byte over, gets the 413 too (not a reset).
    assert served.post(path("a"), at + b" ", token=token)[0] == 413


def test_a_refusal_before_the_body_is_read_still_reaches_the_client(
    serve: Callable[..., Served], kube: FakeKube
) -> None:
    # http.client, like most clients, sends the headers and the body in two writes: a server
    # that answers on the headers alone and closes with the body unread resets the connection,
    # and the reset loses the answer (often: this is a race each time, run here 40 times).
    served = serve(Limits(burst=1, reports_per_second=0.001))
    token = kube.mint(pod="a-0")
    assert served.post(path("a"), token=token)[0] == 200
    answers = [served.post(path("a"), token=token)[0] for _ in range(20)]  # 429, body unread
    answers += [served.post(path("nope", "x") + "/y", token=token)[0] for _ in range(10)]  # 404
    answers += [served.post(path("a"), token=None)[0] for _ in range(10)]  # 401
    assert answers == [429] * 20 + [404] * 10 + [401] * 10


def test_plain_http_without_a_certificate_and_a_body_that_ends_early(
    serve: Callable[..., Served], kube: FakeKube
) -> None:
    served = serve(tls=False)  # no tls_dir: plain HTTP (and a half-close, which TLS cannot send alone)
    assert served.post(path("a"), token=kube.mint(pod="a-0"))[0] == 200
    with served.connect() as connection:
        connection.sendall(head(path("a"), kube.mint(pod="a-0"), "Content-Length: 100") + b'{"trainer')
        connection.shutdown(socket.SHUT_WR)
        assert status_of(read_to_close(connection)) == 400
    assert served.count("truncated") == 1


@pytest.mark.parametrize(
    "body",
    [
        b'{"trainerStatus": {"progressPercentage": NaN}}',
        b'{"trainerStatus": {"progressPercentage": 101}}',
        json.dumps(
            {"trainerStatus": {"metrics": [{"name": f"m{i}", "value": "1"} for i in range(300)]}}
        ).encode(),
        b"not json",
    ],
    ids=["nan", "percent-101", "300-metrics", "not-json"],
)
def test_an_invalid_body_is_400(served: Served, body: bytes) -> None:
    kube = served.kube
    status, document = served.post(path("a"), body, token=kube.mint(pod="a-0"))
    assert status == 400
    assert document["error"]
    assert served.book.of((NS, "a")) == ()
    assert served.count("invalid") == 1


def test_get_is_405(served: Served) -> None:
    assert served.raw(b"GET " + path("a").encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n") == 405


def test_a_client_without_our_ca_cannot_talk_to_it(served: Served) -> None:
    with (
        socket.create_connection(("127.0.0.1", served.server.port), timeout=5) as plain,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ssl.create_default_context().wrap_socket(plain, server_hostname="127.0.0.1")


def handler_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and "process_request_thread" in t.name]


def test_a_slow_client_is_cut_off_at_the_deadline(serve: Callable[..., Served], kube: FakeKube) -> None:
    deadline = 1.0
    served = serve(Limits(request_seconds=deadline))
    before = set(threading.enumerate())
    request = head(path("a"), kube.mint(pod="a-0"), f"Content-Length: {len(REPORT)}") + REPORT
    with served.connect() as connection:
        started = time.monotonic()
        [handler] = handler_threads(before)  # serving this connection (the handshake is done)
        connection.settimeout(0.5)  # a byte every 0.5 s: no read on the server's side ever waits 1 s
        closed_after = None
        for byte in request[:20]:  # 10 s at most; the cut is due after 1
            try:
                connection.sendall(bytes([byte]))
                answer = connection.recv(1)
            except TimeoutError:
                continue  # the server is still waiting: one more byte
            except (ssl.SSLEOFError, ConnectionResetError, BrokenPipeError):
                answer = b""
            assert answer == b"", "the server answered a request it never fully got"
            closed_after = time.monotonic() - started
            break
    assert closed_after is not None, "a client sending a byte every 0.5 s was never cut off"
    assert closed_after < deadline + 3.0  # a byte every 0.5 s, and room for a loaded machine
    handler.join(timeout=2)
    assert not handler.is_alive()
    assert served.book.of((NS, "a")) == ()


def test_a_silent_connection_is_cut_off_at_the_deadline(serve: Callable[..., Served]) -> None:
    served = serve(Limits(request_seconds=0.5))
    with socket.create_connection(("127.0.0.1", served.server.port), timeout=5) as plain:
        started = time.monotonic()
        assert plain.recv(1) == b""  # no TLS handshake ever started: closed, not waited for
        assert time.monotonic() - started < 0.5 + 3.0  # not the client's 5 s


def test_the_endpoint_sends_no_session_tickets(served: Served) -> None:
    """One report per connection and clients that never resume: a ticket is CPU for nothing."""
    request = head(path("a"), served.kube.mint(pod="a-0"), f"Content-Length: {len(REPORT)}") + REPORT
    with served.connect() as connection:
        connection.sendall(request)
        assert answer_of(connection) == 200
        assert connection.version() == "TLSv1.3"
        session = connection.session
        assert session is not None
        assert not session.has_ticket


def test_connections_over_the_bound_are_closed_unanswered(
    serve: Callable[..., Served], kube: FakeKube
) -> None:
    served = serve(Limits(connections=2, request_seconds=20))
    token = kube.mint(pod="a-0")
    held = [served.connect(), served.connect()]  # handshakes done: both hold a slot
    try:
        started = time.monotonic()
        with pytest.raises((ssl.SSLError, ConnectionResetError)):  # not a timeout: closed at once
            served.connect(timeout=5).close()
        assert time.monotonic() - started < 4  # not the 5 s connect timeout
        # A held connection still gets its answer.
        held[0].sendall(head(path("a"), token, f"Content-Length: {len(REPORT)}") + REPORT)
        assert answer_of(held[0]) == 200
    finally:
        for connection in held:
            connection.close()
    # Slots come back as the connections end.
    wait_for("a slot freed", lambda: served.post(path("a"), token=token)[0] == 200, timeout=5,
             tolerate=(ssl.SSLError, ConnectionResetError, http.client.RemoteDisconnected))  # fmt: skip


def test_a_flood_is_logged_once_per_client_and_reason(
    serve: Callable[..., Served], kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    served = serve(Limits(burst=1, reports_per_second=0.001))
    caplog.set_level(logging.WARNING, logger=LOGGER)
    token = kube.mint(pod="a-0")
    statuses = [served.post(path("a"), token=token)[0] for _ in range(30)]
    assert statuses == [200] + [429] * 29
    other = kube.mint(pod="a-1")  # another pod of the same training, from the same address
    assert [served.post(path("a"), token=other)[0] for _ in range(5)] == [200] + [429] * 4
    for _ in range(5):
        served.post(path("nope", "other-ns") + "/x", token=token)  # another reason: 404
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2, lines
    assert "429" in lines[0]
    assert "404" in lines[1]
    assert served.count("rate_limited") == 33


def test_close_cuts_off_open_connections_and_leaves_no_thread(
    serve: Callable[..., Served], kube: FakeKube
) -> None:
    before = set(threading.enumerate())
    served = serve(Limits(request_seconds=30))
    assert served.post(path("a"), token=kube.mint(pod="a-0"))[0] == 200
    held = served.connect()  # mid-request when the server closes
    closer = threading.Thread(target=served.server.close, name="closer")
    try:
        held.sendall(b"POST /apis/gpuop.io/")
        closer.start()
        closer.join(timeout=3)
        assert not closer.is_alive(), "close() waited for a client (its deadline is 30 s)"
        held.settimeout(3)
        assert read_to_close(held) == b""
    finally:
        held.close()
        if closer.ident is not None:
            closer.join()
    left = [t for t in set(threading.enumerate()) - before if (t.join(timeout=2), t.is_alive())[1]]
    assert not left
    with pytest.raises(ConnectionRefusedError):  # the port is closed
        socket.create_connection(("127.0.0.1", served.server.port), timeout=2).close()
