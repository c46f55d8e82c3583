"""gpureport, the stdlib-only progress-report client (trainer/report), against a local HTTPS
server that records what it is sent: the body and headers Kubeflow Trainer's ``trainerStatus``
protocol asks for, percent and ETA, the throttle, rank 0 only, a hung endpoint that never
slows the caller, values out of bounds, token rotation, CA verification; its Lightning
callback; the built-in trainer's reports; and the distribution installing with nothing else.

No test sleeps to wait for the sender: ``Reporter.flush`` and ``finish`` wait for it, and the
throttle and the ETA run on a clock the test moves.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import ssl
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import gpureport
import pytest
from gpureport import CA_ENV, TOKEN_ENV, URL_ENV, Reporter

from support.paths import ROOT
from support.waiting import ManualClock

REPORT_PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team/trainjobs/mnist/status"


# -- a CA, and a server certificate for 127.0.0.1, from the openssl CLI ------------------------


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def _issue(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA named ``name`` and a server certificate for 127.0.0.1 it signed: (ca, cert, key)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(directory, "req", "-x509", *ec, "-keyout", f"{name}-ca.key", "-out", f"{name}-ca.crt",
             "-days", "1", "-subj", f"/CN={name} test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    _openssl(directory, "req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", "/CN=127.0.0.1")  # fmt: skip
    (directory / f"{name}.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{name}-ca.crt",
             "-CAkey", f"{name}-ca.key", "-set_serial", "1", "-days", "1",
             "-extfile", f"{name}.ext", "-out", f"{name}.crt")  # fmt: skip
    return directory / f"{name}-ca.crt", directory / f"{name}.crt", directory / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    directory = tmp_path_factory.mktemp("pki")
    return {"ours": _issue(directory, "ours"), "other": _issue(directory, "other")}


# -- the status server ----------------------------------------------------------------------


class Recorded:
    """One POST the server took."""

    def __init__(self, path: str, headers: dict[str, str], body: bytes) -> None:
        self.path = path
        self.headers = headers
        self.raw = body
        # NaN and Infinity are not JSON; a client that sent them would fail here.
        self.body = json.loads(body, parse_constant=lambda name: pytest.fail(f"{name} in the body"))

    @property
    def status(self) -> dict[str, Any]:
        return self.body["trainerStatus"]  # type: ignore[no-any-return]

    @property
    def metrics(self) -> dict[str, str]:
        return {m["name"]: m["value"] for m in self.status["metrics"]}


class StatusServer(ThreadingHTTPServer):
    """Records each POST; answers ``answer`` (200 by default) once ``gate`` is open."""

    def __init__(self, tls: tuple[Path, Path] | None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.arrived: queue.Queue[Recorded] = queue.Queue()  # as each request is read
        self.answered: list[Recorded] = []
        self.answer = 200
        self.gate = threading.Event()
        self.gate.set()
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*map(str, tls))
            self.socket = context.wrap_socket(self.socket, server_side=True)
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server_address[1]}{REPORT_PATH}"
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or refused our certificate: the test looks at what arrived

    def stop(self) -> None:
        self.gate.set()
        self.shutdown()
        self.server_close()  # joins the handler threads
        self._thread.join()

    def received(self) -> list[Recorded]:
        out = []
        while not self.arrived.empty():
            out.append(self.arrived.get_nowait())
        return out


class _Handler(BaseHTTPRequestHandler):
    server: StatusServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        recorded = Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        self.server.arrived.put(recorded)
        self.server.gate.wait()
        self.server.answered.append(recorded)
        self.send_response(self.server.answer)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server(pki: dict[str, tuple[Path, Path, Path]]) -> Iterator[StatusServer]:
    _, cert, key = pki["ours"]
    running = StatusServer((cert, key))
    yield running
    running.stop()


@pytest.fixture
def token(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("token-1\n")
    return path


@pytest.fixture
def environ(server: StatusServer, pki: dict[str, tuple[Path, Path, Path]], token: Path) -> dict[str, str]:
    """What the operator gives the pod."""
    return {URL_ENV: server.url, CA_ENV: str(pki["ours"][0]), TOKEN_ENV: str(token), "RANK": "0"}


@pytest.fixture
def make_reporter() -> Iterator[Any]:
    """Reporter(...), each closed (its sender thread gone) when the test ends."""
    made: list[Reporter] = []

    def make(*args: Any, kind: type[Reporter] = Reporter, **kwargs: Any) -> Reporter:
        made.append(kind(*args, **kwargs))
        return made[-1]

    yield make
    for reporter in made:
        reporter.close(timeout=5)


class FlushingReporter(Reporter):
    """Waits until each report was tried: none replaces another still waiting."""

    def _enqueue(self, body: bytes) -> int:
        sequence = super()._enqueue(body)
        self._outbox.wait_for(sequence, timeout=5)
        return sequence


def _sent(reporter: Reporter, server: StatusServer) -> list[Recorded]:
    """What the server took, once the reports queued so far were tried."""
    reporter.flush(timeout=5)
    return server.received()


def _each_sent(
    reporter: Reporter, server: StatusServer, clock: ManualClock, calls: list[dict[str, Any]]
) -> list[Recorded]:
    """Each call's report, 10 s apart (past the throttle), each tried before the next (which
    would otherwise replace it while it waits: latest wins)."""
    sent = []
    for call in calls:
        assert reporter.report(**call)
        sent += _sent(reporter, server)
        clock.now += 10
    return sent


# -- the protocol ---------------------------------------------------------------------------


def test_a_report_is_the_protocols_post(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    reporter = make_reporter(environ, clock=ManualClock())
    assert reporter.report(10, 100, 0.5, epoch=1, total_epochs=3, samples_per_second=1234.5, accuracy=0.75)
    [sent] = _sent(reporter, server)
    assert sent.path == REPORT_PATH
    assert sent.headers["authorization"] == "Bearer token-1"
    assert sent.headers["content-type"] == "application/json"
    status = sent.body.pop("trainerStatus")
    assert sent.body == {}
    sent_at = status.pop("lastUpdatedTime")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", sent_at), sent_at
    age = datetime.now(UTC) - datetime.strptime(sent_at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert abs(age.total_seconds()) < 60
    assert status == {
        "progressPercentage": 10,  # no ETA yet: one report gives no pace
        "metrics": [
            {"name": "current_step", "value": "10"},
            {"name": "total_steps", "value": "100"},
            {"name": "current_epoch", "value": "1"},
            {"name": "total_epochs", "value": "3"},
            {"name": "loss", "value": "0.5"},
            {"name": "samples_per_second", "value": "1234.5"},
            {"name": "accuracy", "value": "0.75"},
        ],
    }


def test_percent_and_eta_follow_the_steps_and_their_pace(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    clock = ManualClock()
    reporter = make_reporter(environ, clock=clock)
    sent = _each_sent(reporter, server, clock, [
        {"step": 10, "total_steps": 100},  # no pace yet: no ETA
        {"step": 20, "total_steps": 100},  # 10 steps in 10 s, 80 to go: 80 s
        {"step": 30, "total_steps": 100, "eta_seconds": 12.4},  # the caller's ETA wins
        {"step": 30, "total_steps": 100, "percent": 42.7},  # and its percent, floored
    ])  # fmt: skip
    assert [(s.status["progressPercentage"], s.status.get("estimatedRemainingSeconds")) for s in sent] == [
        (10, None),
        (20, 80),
        (30, 12),
        (42, 53),  # 32.7 points in 30 s, 57.3 to go: 52.6 s
    ]


def test_percent_stops_at_99_until_the_final_report_says_100_and_eta_0(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    clock = ManualClock()
    reporter = make_reporter(environ, clock=clock)
    sent = _each_sent(reporter, server, clock, [
        {"step": 100, "total_steps": 100},
        {"percent": 100, "eta_seconds": 30},
        {"step": 250, "total_steps": 100},
    ])  # fmt: skip
    assert [s.status["progressPercentage"] for s in sent] == [99, 99, 99]
    assert reporter.finish(step=100, total_steps=100, loss=0.1)  # answered: it waited
    [final] = server.answered[-1:]
    assert (final.status["progressPercentage"], final.status["estimatedRemainingSeconds"]) == (100, 0)
    assert final.metrics == {"current_step": "100", "total_steps": "100", "loss": "0.1"}


def test_one_report_per_5_seconds_besides_the_first_and_the_final(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    clock = ManualClock()
    reporter = make_reporter(environ, clock=clock)
    assert reporter.due()
    assert reporter.report(step=1, total_steps=10)  # the first: at once
    reporter.flush()  # (or the final would replace it, still waiting)
    clock.now += 4.9
    assert not reporter.due()
    assert not reporter.report(step=2, total_steps=10)
    assert reporter.due(final=True)
    assert reporter.report(step=3, total_steps=10, final=True)
    clock.now += 4.9  # the final restarts the 5 s
    assert not reporter.report(step=4, total_steps=10)
    clock.now += 0.1
    assert reporter.report(step=5, total_steps=10)
    assert [s.metrics["current_step"] for s in _sent(reporter, server)] == ["1", "3", "5"]


def test_a_pause_is_said_at_once_and_its_end_too_and_reports_inside_it_carry_it(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    """Issue 28: a long evaluation or save is no stall when the code says it is one. Its start
    and end pass the 5 s throttle (the stall clock must see both); a report inside carries the
    pause, as one without it would end it; a nested pause adds nothing; pauses back to back are
    said until their reports would outrun the server's rate per pod (one a second)."""
    clock = ManualClock()
    reporter = make_reporter(environ, clock=clock, kind=FlushingReporter)
    assert reporter.report(step=1, total_steps=10)
    clock.now += 1
    with reporter.pause("evaluating"):
        reporter.flush()
        with reporter.pause("saving"):  # nested: the outer one stands
            reporter.flush()
        clock.now += 10
        assert reporter.report(step=1, total_steps=10)
    reporter.flush()
    clock.now += 1
    with reporter.pause("saving"):  # 11 s after the last start: said
        reporter.flush()
    reporter.flush()
    clock.now += 1
    with reporter.pause("evaluating"):  # 1 s after it: said (a save, then an evaluation)
        reporter.flush()
    reporter.flush()
    with reporter.pause("loading"):  # at once after that: the bucket is empty, not said
        reporter.flush()
    sent = _sent(reporter, server)
    assert [(s.metrics.get("current_step"), s.metrics.get("activity")) for s in sent] == [
        ("1", None),
        (None, "evaluating"),
        ("1", "evaluating"),
        (None, "training"),
        (None, "saving"),
        (None, "training"),
        (None, "evaluating"),
        (None, "training"),
    ]


def test_a_pause_never_raises_into_the_block_and_is_a_no_op_without_a_server(make_reporter: Any) -> None:
    reporter = make_reporter({}, clock=ManualClock())
    with reporter.pause("evaluating"):
        pass
    with gpureport.pause("saving"):
        pass
    assert reporter.delivered == reporter.failures == 0


def test_a_checkpoint_is_said_at_once_then_in_every_report_and_the_operator_reads_it_whole(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    """Issue 27: checkpointed() is sent past the throttle, and every later report repeats it (a
    report that replaces it in the queue still says it). A URI past a value's 64 characters goes
    in pieces, each sent as it is (a space at a cut stays), read back whole up to 1,024
    characters; a longer one is not sent, as a cut one would name another object. Inside a
    pause, the pause's end says it; a step that is no count says nothing."""
    from gpuop.observing.reports import parse_report

    clock = ManualClock()
    reporter = make_reporter(environ, clock=clock, kind=FlushingReporter)
    assert reporter.report(step=1, total_steps=10)
    uri = "s3://team-checkpoints/my runs/" + "r" * 33 + " x" + "r" * 80 + "/step-00000002-0a1b2c3d.pt"
    assert uri[63:65] == " x"  # the first cut falls on the space
    moment = datetime(2026, 11, 25, 18, 30, 5, tzinfo=UTC)
    assert reporter.checkpointed(2, uri, time=moment)  # 0 s after a report: said all the same
    clock.now += 10
    assert reporter.report(step=3, total_steps=10)
    with reporter.pause("saving"):
        assert reporter.checkpointed(4, Path("/checkpoints/step-00000004-ab.pt"))
        reporter.flush()
    assert not reporter.checkpointed(float("nan"), "x")
    assert not reporter.checkpointed(-1)
    sent = _sent(reporter, server)
    said = [parse_report(s.raw).checkpoint for s in sent]
    assert [s.metrics.get("activity") for s in sent] == [None, "training", None, "saving", "training"]
    assert said[0] is None
    assert said[1] is not None
    assert said[2] == said[1]
    assert said[3] == said[1]
    assert (said[1].step, said[1].time, said[1].uri) == (2, "2026-11-25T18:30:05Z", uri)
    assert said[4] is not None
    assert (said[4].step, said[4].uri) == (4, "/checkpoints/step-00000004-ab.pt")
    assert all(len(m["value"]) <= 64 for s in sent for m in s.status["metrics"])
    assert gpureport.checkpointed(1) is False  # no server in this process's environment: a no-op
    # At the bound, whole; past it, the step and time without a URI.
    clock.now += 10
    longest = "s3://b/" + "k" * (1024 - len("s3://b/"))
    assert reporter.checkpointed(6, longest)
    assert reporter.checkpointed(7, longest + "k")
    read = [parse_report(s.raw).checkpoint for s in _sent(reporter, server)]
    assert [(c.step, c.uri) for c in read if c is not None] == [(6, longest), (7, None)]


def test_a_report_the_server_refuses_for_now_is_sent_again_unless_a_newer_one_came(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    """A 429 (the server's rate per pod: a pause right after a checkpoint and a step report can
    pass it) or a 5xx is tried again, 1 s, 2 s, ... later: a checkpoint said once is not lost.
    A 400 is not (it would be refused again)."""
    reporter = make_reporter(environ, min_interval=0, retry_delay=0.05)
    server.answer = 429
    assert reporter.checkpointed(7, "/checkpoints/step-7.pt")
    first = server.arrived.get(timeout=5)
    server.answer = 200
    assert reporter.flush()
    again = server.received()
    assert [r.metrics["checkpoint_step"] for r in [first, *again]] == ["7", "7"]
    assert (reporter.failures, reporter.delivered) == (1, 1)
    server.answer = 400
    assert reporter.report(step=1, total_steps=2)
    assert not reporter.flush()
    assert len(server.received()) == 1


def test_a_checkpoint_the_bucket_had_no_room_for_is_said_once_it_has_even_if_nothing_else_comes(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    """A loop that saves right after pausing twice (a save, an evaluation) and then reports no
    more (held, hung, throttled): its checkpoint is said by the sender once the bucket refills,
    not left for a report that never comes (seen on the chain: status kept the first epoch's)."""
    clock = ManualClock()
    reporter = make_reporter(environ, clock=clock, retry_delay=0.05, kind=FlushingReporter)
    for activity in ("saving", "evaluating"):
        with reporter.pause(activity):
            pass
    assert not reporter.checkpointed(46, "/checkpoints/step-46.pt")  # no room now
    assert [r.metrics["activity"] for r in server.received()] == [
        "saving",
        "training",
        "evaluating",
        "training",
    ]
    clock.now += 1  # a second: room for one
    said = server.arrived.get(timeout=5)
    assert (said.metrics["checkpoint_step"], said.metrics["activity"]) == ("46", "training")


def test_the_latest_report_replaces_one_still_waiting(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    server.gate.clear()
    reporter = make_reporter(environ, min_interval=0, request_timeout=10)
    reporter.report(step=1, total_steps=10)
    assert server.arrived.get(timeout=5).metrics["current_step"] == "1"  # in flight, held
    for step in (2, 3, 4):
        assert reporter.report(step=step, total_steps=10)
    server.gate.set()
    assert [s.metrics["current_step"] for s in _sent(reporter, server)] == ["4"]


# -- who reports ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change",
    [{"RANK": "1"}, {URL_ENV: ""}, {URL_ENV: "ftp://127.0.0.1/status"}, {URL_ENV: "https://[::1"}],
    ids=["rank 1", "no URL", "not http", "bad URL"],
)
def test_only_rank_0_with_a_url_reports(
    server: StatusServer, environ: dict[str, str], make_reporter: Any, change: dict[str, str]
) -> None:
    reporter = make_reporter(environ | change)
    assert not reporter.enabled
    assert not reporter.due()
    assert not reporter.report(step=1, total_steps=2, loss=0.3)
    assert not reporter.finish(step=2, total_steps=2)
    assert reporter._outbox.thread is None  # not even a thread
    assert server.received() == []


def test_the_module_functions_use_one_reporter_made_from_the_environment(
    server: StatusServer, environ: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(gpureport, "_default", None)
    try:
        assert gpureport.report(3, 4, 0.2, accuracy=0.5)
        gpureport.default_reporter().flush()
        assert gpureport.finish(4, 4, 0.1)
        assert gpureport.default_reporter() is gpureport.default_reporter()
    finally:
        gpureport.default_reporter().close()
    assert [s.status["progressPercentage"] for s in server.received()] == [75, 100]

    monkeypatch.setattr(gpureport, "_default", None)
    monkeypatch.delenv(URL_ENV)
    assert not gpureport.report(1, 4)
    assert not gpureport.finish(4, 4)


# -- never in the training loop's way -------------------------------------------------------


def test_a_server_that_never_answers_does_not_slow_the_caller(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    server.gate.clear()  # takes each request and keeps it unanswered
    # A request timeout far above any pause a loaded machine gives a thread (two lanes on two
    # cores have cost one call 0.43 s), so a call that waited on the network cannot pass for one.
    reporter = make_reporter(environ, min_interval=0, request_timeout=20, final_timeout=1.0)
    calls = []
    for step in range(200):
        started = time.perf_counter()
        reporter.report(step=step, total_steps=200, loss=0.5)
        calls.append(time.perf_counter() - started)
    # Each is about 0.05 ms. A call that waited on the network would wait the request timeout
    # (20 s), and so would every call after it; on a loaded machine a call may lose the CPU for
    # a while (the first also waits for its sender thread to be scheduled), which is not waiting.
    assert sorted(calls)[len(calls) // 2] < 0.005, sorted(calls)[-5:]
    assert max(calls) < 5, sorted(calls)[-5:]
    started = time.perf_counter()
    assert not reporter.finish(step=200, total_steps=200)  # never answered
    # final_timeout and a margin for that load; neither the request timeout nor the retries'
    # backoff (1, 2, 4, 5 s) does it wait
    assert time.perf_counter() - started < 1.0 + 3.0
    assert server.arrived.get(timeout=5)  # the requests did go out
    server.gate.set()  # the held request answered: the reporter closes without waiting it out


def test_values_out_of_bounds_never_raise_and_the_body_keeps_the_bounds(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    torch = pytest.importorskip("torch")
    clock = ManualClock()
    reporter = make_reporter(environ, clock=clock)
    many = {f"metric_{i}": i * 0.5 for i in range(300)}
    odd = {
        "x" * 65: 1,  # a name over 64 characters: dropped, not cut
        "text": "y" * 1000,  # cut to 64
        "blank": "   ",
        "none": None,
        "huge_int": 10**5000,
        "vector": torch.ones(3),
        "scalar": torch.tensor(2.5),
        "thing": object(),
        "flag": True,
    }
    assert reporter.report(step=float("nan"), total_steps=float("1e400"), loss=float("nan"),
                           epoch="one", percent="half", eta_seconds=-3,
                           samples_per_second=float("-inf"), **odd, **many)  # fmt: skip
    sent = _sent(reporter, server)
    clock.now += 10
    assert reporter.report(
        step=float("1e400"), total_steps=10, percent=float("inf"), eta_seconds=float("inf")
    )
    sent += _sent(reporter, server)
    clock.now += 10
    assert reporter.report_metrics({1: 2, "": 3, "ok": [1]}, step=-5, total_steps=10, percent=-20)
    clock.now += 10
    assert not reporter.report_metrics(None)
    sent += _sent(reporter, server)
    assert len(sent) == 3
    for one in sent:
        metrics = one.status["metrics"]
        assert len(metrics) <= 256
        for m in metrics:
            assert isinstance(m["name"], str)
            assert 1 <= len(m["name"]) <= 64
            assert isinstance(m["value"], str)
            assert 1 <= len(m["value"]) <= 64
        assert 0 <= one.status.get("progressPercentage", 0) <= 100
        assert 0 <= one.status.get("estimatedRemainingSeconds", 0) <= 2**31 - 1
    first = sent[0].metrics
    assert len(sent[0].status["metrics"]) == 256
    assert "progressPercentage" not in sent[0].status  # neither percent nor steps were numbers
    assert (first["loss"], first["samples_per_second"], first["current_epoch"]) == ("nan", "-inf", "one")
    assert (first["text"], first["scalar"], first["flag"]) == ("y" * 64, "2.5", "true")
    assert not {"x" * 65, "blank", "none", "huge_int", "vector", "thing"} & first.keys()
    assert sent[1].status.keys() == {"metrics", "lastUpdatedTime"}  # no percent, no ETA: none was a number
    assert sent[2].status["progressPercentage"] == 0
    assert sent[2].metrics == {"current_step": "-5", "total_steps": "10"}


# -- credentials ------------------------------------------------------------------------------


def test_the_token_is_read_again_as_it_rotates(
    server: StatusServer, environ: dict[str, str], token: Path, make_reporter: Any
) -> None:
    clock = ManualClock()
    reporter = make_reporter(environ, clock=clock)
    seen = []
    for at, written, answer in [
        (0, "token-1", 200),
        (10, "token-2", 200),  # within 60 s: the cached one
        (70, "token-2", 401),  # read again; the server refuses it
        (80, "token-3", 200),  # after a 401: read again at once
    ]:
        token.write_text(written + "\n")
        clock.now = 1000.0 + at
        server.answer = answer
        reporter.report(step=at, total_steps=100)
        [sent] = _sent(reporter, server)
        seen.append(sent.headers["authorization"])
    assert seen == ["Bearer token-1", "Bearer token-1", "Bearer token-2", "Bearer token-3"]


def test_a_server_whose_certificate_another_ca_signed_gets_nothing(
    pki: dict[str, tuple[Path, Path, Path]], environ: dict[str, str], make_reporter: Any
) -> None:
    _, cert, key = pki["other"]
    impostor = StatusServer((cert, key))
    try:
        reporter = make_reporter(environ | {URL_ENV: impostor.url}, final_timeout=5)
        assert reporter.report(step=1, total_steps=2)  # queued
        assert not reporter.flush()
        assert not reporter.finish(step=2, total_steps=2)  # refused at the handshake
        assert reporter.failures == 2
        assert impostor.received() == []
    finally:
        impostor.stop()


def test_no_token_goes_over_plain_http_but_to_this_machine(token: Path, make_reporter: Any) -> None:
    plain = StatusServer(None)
    try:
        local = make_reporter({URL_ENV: plain.url, TOKEN_ENV: str(token)})
        assert local.finish(step=1, total_steps=1)
        [sent] = plain.received()
        assert sent.headers["authorization"] == "Bearer token-1"
        remote = make_reporter({URL_ENV: "http://trainer-status.example:8443/status", TOKEN_ENV: str(token)})
        assert remote._endpoint._token() is None
    finally:
        plain.stop()


# -- Lightning ------------------------------------------------------------------------------


# Lightning 2.6 on torch 2.13 warns of torch's pytree API it uses, not of anything here.
@pytest.mark.filterwarnings("ignore:.*treespec, LeafSpec.*")
def test_the_lightning_callback_reports_steps_loss_and_the_end(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    torch = pytest.importorskip("torch")
    lightning = pytest.importorskip("lightning.pytorch")
    from gpureport.lightning import GpuopProgress

    class Tiny(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss)
            self.log("val/acc", 0.5)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    reporter = make_reporter(environ, min_interval=0, kind=FlushingReporter)
    trainer = lightning.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, callbacks=[GpuopProgress(reporter)],
        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=16))
    sent = server.received()
    assert [int(s.metrics["current_step"]) for s in sent] == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        8,
    ]  # each batch, the end
    assert all(s.metrics["total_steps"] == "8" and float(s.metrics["loss"]) >= 0 for s in sent)
    assert all(s.metrics["val/acc"] == "0.5" and s.metrics["total_epochs"] == "2" for s in sent)
    final = sent[-1]
    assert (final.status["progressPercentage"], final.status["estimatedRemainingSeconds"]) == (100, 0)
    assert (final.metrics["current_step"], final.metrics["current_epoch"]) == ("8", "2")
    assert all(s.status["progressPercentage"] < 100 for s in sent[:-1])


@pytest.mark.filterwarnings("ignore:.*treespec, LeafSpec.*")
def test_the_lightning_callback_says_each_checkpoint_model_checkpoint_wrote(
    server: StatusServer, environ: dict[str, str], make_reporter: Any, tmp_path: Path
) -> None:
    """Lightning's default ModelCheckpoint writes one at each epoch's end: each is said, with
    its step and file, once written; the final report carries the last (issue 27)."""
    torch = pytest.importorskip("torch")
    lightning = pytest.importorskip("lightning.pytorch")
    from gpureport.lightning import GpuopProgress

    from gpuop.observing.reports import parse_report

    class Tiny(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    reporter = make_reporter(environ, min_interval=0, kind=FlushingReporter)
    trainer = lightning.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, callbacks=[GpuopProgress(reporter)],
        enable_progress_bar=False, logger=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=16))
    said = [c for s in server.received() if (c := parse_report(s.raw).checkpoint) is not None]
    steps = sorted({c.step for c in said})
    assert steps == [4, 8], said
    last = said[-1]
    assert last.step == 8
    assert last.uri is not None
    assert last.uri.endswith("epoch=1-step=8.ckpt")
    assert Path(last.uri).is_file()


def test_the_lightning_callback_says_a_validation_within_the_fit_is_a_pause(
    server: StatusServer, environ: dict[str, str], make_reporter: Any
) -> None:
    torch = pytest.importorskip("torch")
    lightning = pytest.importorskip("lightning.pytorch")
    from gpureport.lightning import GpuopProgress

    class Validated(lightning.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1)),
                                       batch_size=16)  # fmt: skip
    reporter = make_reporter(environ, min_interval=0, kind=FlushingReporter)
    trainer = lightning.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, callbacks=[GpuopProgress(reporter)], num_sanity_val_steps=0,
        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Validated(), data, data)
    said = [s.metrics["activity"] for s in server.received() if "activity" in s.metrics]
    assert said == ["evaluating", "training"] * 2  # one validation an epoch, each ended


def test_the_hugging_face_callback_says_each_checkpoint_the_trainer_wrote(
    server: StatusServer,
    environ: dict[str, str],
    make_reporter: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real transformers.Trainer (a tiny GPT-2 from a config) saving every 2 of 4 steps: each
    save is said once its folder is whole, with the step and the folder resume takes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import tqdm

    # A save's progress bar starts tqdm's monitor thread, which outlives the test; none needed.
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    from gpureport.hf import GpuopCheckpoints

    from gpuop.observing.reports import parse_report

    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    tokens = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=2, report_to="none", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    reporter = make_reporter(environ, kind=FlushingReporter)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=arguments,
                                   train_dataset=data, callbacks=[GpuopCheckpoints(reporter)])  # fmt: skip
    trainer.train()
    said = [c for s in server.received() if (c := parse_report(s.raw).checkpoint) is not None]
    assert [(c.step, c.uri) for c in said] == [
        (2, str(tmp_path / "checkpoint-2")),
        (4, str(tmp_path / "checkpoint-4")),
    ]
    assert (tmp_path / "checkpoint-4" / "trainer_state.json").is_file()


# -- the built-in trainer -------------------------------------------------------------------


def test_the_built_in_trainer_reports_its_intervals_and_its_end(tmp_path: Path, token: Path) -> None:
    """gputrain alone (one process, digits, one epoch) sends its figures, then the final ones."""
    from support.training import digits_run

    plain = StatusServer(None)
    try:
        settings = {k: v for k, v in digits_run(tmp_path, workers=1, epochs=1).environment().items()
                    if k.startswith("GPUTRAIN_")}  # fmt: skip
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("GPUTRAIN_", "RANK", "WORLD_SIZE"))}
        # One thread, as torchrun gives each worker: with a core busy elsewhere, torch's default
        # of one per core made this run 41 s instead of 4.5 s (spinning threads wait on each other).
        clean["OMP_NUM_THREADS"] = "1"
        done = subprocess.run(
            [sys.executable, "-m", "gputrain", f"--termination-log={tmp_path / 'term'}"],
            env=clean | settings | {URL_ENV: plain.url, TOKEN_ENV: str(token)},
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        sent = plain.received()
    finally:
        plain.stop()
    result = json.loads((tmp_path / "term").read_text())
    # Its evaluation and its checkpoint saves are pauses, each one said then ended (issue 28). One
    # over before the sender took its start is not said at all (latest wins): the digits
    # model's evaluation is, here; its saves, which write files, are not.
    # Its end is always said, so on a loaded machine an end may come alone (its start replaced
    # in the queue); a start said is always followed by its end.
    paused = [s.metrics["activity"] for s in sent if "current_step" not in s.metrics]
    assert "saving" in paused, paused
    assert set(paused) <= {"evaluating", "saving", "training"}, paused
    starts = [i for i, activity in enumerate(paused) if activity != "training"]
    assert all(i + 1 < len(paused) and paused[i + 1] == "training" for i in starts), paused
    sent = [s for s in sent if "current_step" in s.metrics]
    assert len(sent) >= 2
    first, final = sent[0], sent[-1]
    assert first.headers["authorization"] == "Bearer token-1"
    assert 0 < first.status["progressPercentage"] < 100
    assert {"current_step", "total_steps", "current_epoch", "total_epochs", "loss", "samples_per_second",
            "learning_rate"} <= first.metrics.keys()  # fmt: skip
    assert (final.status["progressPercentage"], final.status["estimatedRemainingSeconds"]) == (100, 0)
    assert final.metrics["current_step"] == final.metrics["total_steps"] == str(result["totalSteps"])
    assert (final.metrics["current_epoch"], final.metrics["total_epochs"]) == ("1", "1")
    assert float(final.metrics["accuracy"]) == pytest.approx(result["accuracy"])
    assert float(final.metrics["loss"]) == pytest.approx(result["loss"])
    # Its last checkpoint, the end of the run's one epoch, is in its final report (issue 27).
    assert final.metrics["checkpoint_step"] == str(result["totalSteps"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", final.metrics["checkpoint_time"])
    assert final.metrics["checkpoint_uri"].startswith(str(tmp_path)), final.metrics
    assert re.search(rf"step-0*{result['totalSteps']}-[0-9a-f]{{8}}\.pt$", final.metrics["checkpoint_uri"]
                     + final.metrics.get("checkpoint_uri_2", ""))  # fmt: skip


# -- the distribution -----------------------------------------------------------------------


def test_the_distribution_installs_and_runs_on_the_standard_library_alone(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(
        ROOT / "trainer" / "report", source, ignore=shutil.ignore_patterns("__pycache__", "build")
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", str(source), "-w", str(tmp_path)],
                   check=True, capture_output=True)  # fmt: skip
    [wheel] = tmp_path.glob("gpuop_report-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read("gpuop_report-0.1.0.dist-info/METADATA").decode()
    assert "gpureport/py.typed" in names
    assert "Requires-Dist" not in metadata
    assert "Name: gpuop-report" in metadata
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)  # fmt: skip

    plain = StatusServer(None)
    try:
        # -I -S: no site-packages, no PYTHON* variables; the target directory is all there is.
        program = (
            "import sys\n"
            f"sys.path.insert(0, {str(site)!r})\n"
            "import gpureport\n"
            f"ok = gpureport.Reporter({{'{URL_ENV}': {plain.url!r}}}).finish(step=1, total_steps=1)\n"
            "outside = sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names\n"
            "                 and m.split('.')[0] not in ('gpureport', '__main__'))\n"
            "print(ok, gpureport.__file__, outside)\n"
        )
        done = subprocess.run([sys.executable, "-I", "-S", "-c", program],
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["True", str(site / "gpureport" / "__init__.py"), "[]"]
        assert [s.status["progressPercentage"] for s in plain.received()] == [100]
    finally:
        plain.stop()
