"""The progress-report endpoint in a process of its own.

Why a process: in the operator's process the endpoint's threads share one interpreter lock
with the reconciler. At 1,000 trainings reporting every 5 s the reconciler keeps that lock busy
(a tick of 1,000 status patches), and a report waited seconds for its TLS handshake (p99 5.7 s
in bench/report_scale.py), where the same endpoint alone answered at p99 14 ms. Its own process
costs 74 MB of memory (measured at 1,000 trainings) and a second of start-up.

The parent (:class:`ReportProcess`) starts the child as ``python -m gpuop.controller.reportproc``
(a fresh interpreter, not a fork: the parent has an event loop and threads whose locks a fork
would copy mid-use) with a pipe. The child serves
:class:`gpuop.observing.endpoint.ReportServer` with the cluster's gate (its own API client)
and sends back each accepted report, each request's outcome and each call it made to the API
server (for the operator's metrics); a thread of the parent puts
the reports into the :class:`~gpuop.observing.endpoint.ReportBook` the reconciler reads at its
tick. A child that exits is started again on the same port; clients send again on their next
report. A child whose parent is gone stops.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from gpuop.api.identity import TrainingKey
from gpuop.observing.endpoint import Limits, ReportBook, ReportServer
from gpuop.observing.records import ReceivedReport

log = logging.getLogger(__name__)

START_SECONDS: Final = 60.0  # a spawn imports the operator's modules: seconds on a loaded node
_RESTART_BACKOFF: Final = (1.0, 2.0, 5.0, 10.0, 30.0)


# What kept the endpoint from starting: its port (taken, or not ours to bind), its serving
# certificate, or its process (it did not start, or could not log in).
StartFailure = Literal["port", "tls", "process"]


class ReportStartError(Exception):
    """The endpoint could not start; ``what`` says which part failed, the message why."""

    def __init__(self, what: StartFailure, message: str) -> None:
        super().__init__(message)
        self.what: StartFailure = what


# What the child sends the parent over their pipe (pickled): one class per kind of message.


@dataclass(frozen=True)
class Ready:
    """The child listens on ``port``: its first message, or else :class:`StartFailed`."""

    port: int


@dataclass(frozen=True)
class StartFailed:
    """The child could not start and exits: the parent raises it as a ReportStartError."""

    what: StartFailure
    message: str


@dataclass(frozen=True)
class Reported:
    """A report the child accepted, for the parent's book."""

    key: TrainingKey
    received: ReceivedReport


@dataclass(frozen=True)
class RequestCounted:
    """One request the endpoint answered: its outcome and how long it took, for the metrics."""

    outcome: str
    seconds: float


@dataclass(frozen=True)
class ApiCalled:
    """One call the child made to the API server (a TokenReview, a pod read), for the metrics."""

    verb: str
    resource: str
    status: int
    seconds: float


ChildMessage = Ready | StartFailed | Reported | RequestCounted | ApiCalled


@dataclass(frozen=True)
class ReportConfig:
    """What the child needs to serve, given to it as JSON."""

    port: int
    tls_dir: Path | None
    limits: Limits
    log_json: bool = False
    verbose: bool = False

    def to_json(self, fd: int, parent: int) -> str:
        """The child's one argument: this, the pipe's writing end and the parent's pid."""
        fields = dataclasses.asdict(self)
        fields["tls_dir"] = str(self.tls_dir) if self.tls_dir is not None else None
        return json.dumps({"config": fields, "fd": fd, "parent": parent})

    @classmethod
    def from_json(cls, text: str) -> tuple[ReportConfig, int, int]:
        given = json.loads(text)
        fields = given["config"]
        tls_dir = Path(fields["tls_dir"]) if fields["tls_dir"] is not None else None
        config = cls(
            fields["port"], tls_dir, Limits(**fields["limits"]), fields["log_json"], fields["verbose"]
        )
        return config, given["fd"], given["parent"]


class ReportProcess:
    """The endpoint's process, supervised: :meth:`start`, then :meth:`close`."""

    def __init__(
        self,
        config: ReportConfig,
        book: ReportBook,
        counted: Callable[[str, float], None],
        api_request: Callable[[str, str, int, float], None] = lambda *_: None,
    ) -> None:
        self.config = config
        self.book = book
        self.counted = counted
        self.api_request = api_request  # the child's TokenReviews and pod reads, for the metrics
        self.port = config.port
        self._closing = threading.Event()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: multiprocessing.connection.Connection | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Start the child and wait until it listens; ReportStartError if it cannot."""
        self._spawn()
        self._reader = threading.Thread(target=self._read_forever, name="reports-reader", daemon=True)
        self._reader.start()

    def _spawn(self) -> None:
        # A fresh interpreter on a pipe (``python -m`` this module), not a fork of this one.
        read_end, write_end = os.pipe()
        config = dataclasses.replace(self.config, port=self.port)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, config.to_json(write_end, os.getpid())],
                pass_fds=(write_end,), stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            os.close(write_end)  # the child holds the writing end: its exit is our EOFError
        ours = multiprocessing.connection.Connection(read_end, writable=False)
        if not ours.poll(START_SECONDS):
            process.kill()
            process.wait()
            ours.close()
            raise ReportStartError("process", f"its process did not start within {START_SECONDS:g}s")
        try:
            said: ChildMessage = ours.recv()
        except EOFError:
            ours.close()
            code = process.wait()
            raise ReportStartError("process", f"its process exited at start (code {code})") from None
        if not isinstance(said, Ready):
            ours.close()
            process.wait()
            if isinstance(said, StartFailed):
                raise ReportStartError(said.what, said.message)
            raise ReportStartError("process", f"its process said {said!r} before it was ready")
        self.port = said.port
        self._process, self._conn = process, ours

    def _read_forever(self) -> None:
        failures = 0
        while not self._closing.is_set():
            conn = self._conn
            assert conn is not None
            try:
                message: ChildMessage = conn.recv()
            except (EOFError, OSError):
                if self._closing.is_set():
                    return
                failures = self._restart(failures)
                continue
            failures = 0
            match message:
                case Reported(key, received):
                    self.book.put(key, received)
                case RequestCounted(outcome, seconds):
                    self.counted(outcome, seconds)
                case ApiCalled(verb, resource, status, seconds):
                    self.api_request(verb, resource, status, seconds)
                case Ready() | StartFailed():
                    pass  # said once, at start, and read there

    def _restart(self, failures: int) -> int:
        assert self._process is not None
        assert self._conn is not None
        self._conn.close()
        code = self._process.wait()
        delay = _RESTART_BACKOFF[min(failures, len(_RESTART_BACKOFF) - 1)]
        log.error("the report endpoint's process exited (code %s); starting it again in %gs", code, delay)
        if self._closing.wait(delay):
            return failures
        try:
            self._spawn()
        except ReportStartError as exc:
            log.error("the report endpoint could not start again: %s", exc)
            return failures + 1
        log.info("progress reports: listening again on :%d", self.port)
        return 0

    def close(self) -> None:
        self._closing.set()
        if self._process is not None:
            self._process.terminate()  # the child cuts its connections off and exits
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._conn is not None:
            self._conn.close()
        if self._reader is not None:
            self._reader.join(5)


class _Forwarded:
    """The child's book: each report goes to the parent, whose book the reconciler reads."""

    def __init__(self, send: Callable[[ChildMessage], None]) -> None:
        self._send = send

    def put(self, key: TrainingKey, received: ReceivedReport) -> None:
        self._send(Reported(key, received))


def _child(config: ReportConfig, fd: int, parent: int) -> None:
    """The child's whole life: serve until SIGTERM or until the parent is gone."""
    conn = multiprocessing.connection.Connection(fd, readable=False)
    import errno
    import ssl

    import kopf

    from gpuop.controller.apiclient import LoginError
    from gpuop.controller.kube import Kube
    from gpuop.controller.receiver import ClusterGate

    kopf.configure(
        verbose=config.verbose, log_format=kopf.LogFormat.JSON if config.log_json else kopf.LogFormat.FULL
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    lock = threading.Lock()

    def send(message: ChildMessage) -> None:
        with lock:  # a Connection is not safe for concurrent senders
            try:
                conn.send(message)
            except OSError:
                stop.set()  # the parent is gone

    try:
        kube = Kube.login()
    except LoginError as exc:  # the parent logged in the same way a moment ago: rare
        send(StartFailed("process", str(exc)))
        return
    kube.requests.listeners.append(
        lambda verb, resource, status, seconds: send(ApiCalled(verb, resource, status, seconds))
    )
    try:
        server = ReportServer(
            ClusterGate(kube, config.limits), _Forwarded(send),
            lambda outcome, seconds: send(RequestCounted(outcome, seconds)),
            port=config.port, tls_dir=config.tls_dir,
        )  # fmt: skip
    except (OSError, ssl.SSLError) as exc:
        port_taken = isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EACCES)
        send(StartFailed("port" if port_taken else "tls", str(exc)))
        return
    server.start()
    send(Ready(server.port))
    while not stop.wait(1.0):
        if os.getppid() != parent:  # reparented: the operator died without closing us
            break
    server.close()


if __name__ == "__main__":  # started by ReportProcess._spawn
    # The child runs the module imported by its name, not this __main__ copy of it: a message
    # is pickled by its class's module and name, which the parent knows only under that name.
    from gpuop.controller import reportproc

    reportproc._child(*reportproc.ReportConfig.from_json(sys.argv[1]))
