"""The progress-report endpoint: training code POSTs Kubeflow's ``trainerStatus`` here. Blocking
calls, each connection on a thread of its own; who may report is a :class:`Gate`'s to decide
(the operator's checks tokens with the API server, ``gpuop run``'s a secret of its own).

Every request is untrusted (any container of any training may send anything), so the order of
checks is cheapest first and nothing a client sends can cost more than its bounds:

1. the path names one GpuTraining (404), a bearer token is given (401), and the token has not
   sent more than its rate (429) -- before any work on the API server's side;
2. Content-Length is given and within :data:`gpuop.observing.reports.MAX_REPORT_BYTES` (411, 413),
   and the whole request arrives within a deadline (a client that sends a byte a second is cut
   off, not waited for);
3. the gate says which pod of that training the token speaks for (401, 403; 503 when it cannot
   say now);
4. the body is a report within Kubeflow's bounds (400).

An accepted report is kept in memory (:class:`ReportBook`) and nothing more: the reconcile's
tick reads the book, so a training's status is written at most once per tick however often its
code reports, and not at all when nothing changed. A refusal is logged once per client and
reason, not once per request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.server
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol, cast

from gpuop._kits import deadlines
from gpuop.api.identity import TrainingKey, report_path_training
from gpuop.observing.records import ReceivedReport
from gpuop.observing.reports import MAX_REPORT_BYTES, ReportError, parse_report

log = logging.getLogger(__name__)

# The files of the serving certificate (a kubernetes.io/tls Secret mounted as a directory,
# with the CA that signed it, as cert-manager and the chart write them).
TLS_CERT: Final = "tls.crt"
TLS_KEY: Final = "tls.key"
TLS_CA: Final = "ca.crt"
# What a refused request's unread body may cost to read and drop before its socket is closed.
_DRAINED_BYTES: Final = 16 * MAX_REPORT_BYTES


@dataclass(frozen=True)
class Limits:
    """What one client may cost. A client that keeps to Kubeflow's clients' pace (one report per
    5 s) never meets them."""

    reports_per_second: float = 1.0  # per token, refilled; a burst of ``burst`` is allowed
    burst: int = 5
    request_seconds: float = 10.0  # the whole request, headers and body, must arrive in this
    connections: int = 64  # at once; more are closed unanswered
    review_seconds: float = 5.0  # the TokenReview's timeout
    remembered_tokens: int = 10_000  # reviews and rate buckets kept (LRU)
    # A token is reviewed again after 1 to 1.5 times this (by its hash), in the background.
    review_ttl_seconds: float = 60.0


class ReportBook:
    """The latest report of each pod of each training, as received. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[TrainingKey, dict[str, ReceivedReport]] = {}

    def put(self, key: TrainingKey, received: ReceivedReport) -> None:
        """Keep a pod's report, over what its earlier ones said (:meth:`TrainerReport.over`)."""
        with self._lock:
            pods = self._reports.setdefault(key, {})
            earlier = pods.get(received.pod)
            if earlier is not None:
                received = dataclasses.replace(received, report=received.report.over(earlier.report))
            pods[received.pod] = received

    def of(self, key: TrainingKey) -> tuple[ReceivedReport, ...]:
        with self._lock:
            return tuple(self._reports.get(key, {}).values())

    def forget(self, key: TrainingKey) -> None:
        with self._lock:
            self._reports.pop(key, None)


class RefusalError(Exception):
    """A request refused: the HTTP status, a word for the metrics, a line for the client and log."""

    def __init__(self, status: int, outcome: str, message: str) -> None:
        super().__init__(message)
        self.status, self.outcome = status, outcome


class Book(Protocol):
    """Where accepted reports go: a :class:`ReportBook`, or a pipe to the process that has one."""

    def put(self, key: TrainingKey, received: ReceivedReport) -> None: ...


class Gate(Protocol):
    """Who may report: :meth:`authenticate` returns the pod a token speaks for, or raises
    :class:`RefusalError`; :meth:`close` ends what it runs beside the requests (the server's
    :meth:`ReportServer.close` calls it)."""

    limits: Limits

    def authenticate(self, key: TrainingKey, token: str) -> str: ...

    def close(self) -> None: ...


class RateLimiter:
    """Reports per token, as a bucket refilled at ``limits.reports_per_second``. Thread-safe."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # token hash -> (tokens, at)

    @staticmethod
    def target(path: str) -> TrainingKey:
        key = report_path_training(path.split("?", 1)[0])
        if key is None:
            raise RefusalError(404, "not_found", "no such report path")
        return key

    @staticmethod
    def token(authorization: str | None) -> str:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip() or len(token) > 16384:
            raise RefusalError(401, "no_token", "no bearer token")
        return token.strip()

    def admit(self, token: str) -> None:
        """Spend one of the token's reports (429 when it has none left)."""
        digest = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.pop(digest, (float(self.limits.burst), now))
            tokens = min(float(self.limits.burst), tokens + (now - at) * self.limits.reports_per_second)
            if tokens < 1:
                self._buckets[digest] = (tokens, now)
                raise RefusalError(429, "rate_limited", "more reports than the rate allows; slow down")
            self._buckets[digest] = (tokens - 1, now)
            while len(self._buckets) > self.limits.remembered_tokens:
                self._buckets.popitem(last=False)


class ReportServer:
    """The HTTPS endpoint on its own threads: start(), then close()."""

    def __init__(
        self,
        gate: Gate,
        book: Book,
        counted: Callable[[str, float], None] = lambda _outcome, _seconds: None,
        *,
        port: int,
        tls_dir: Path | None,
        host: str = "",
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.gate = gate
        self.rate = RateLimiter(gate.limits)
        self.book = book
        self.counted = counted  # (outcome, seconds) of each request, for the operator's metrics
        self.clock = clock
        self._tls = _Certificates(tls_dir) if tls_dir is not None else None
        self._slots = threading.BoundedSemaphore(gate.limits.connections)
        self._said: set[tuple[str, str]] = set()
        self._said_lock = threading.Lock()
        # The connections being served, with their threads: close() cuts them off and waits
        # for them (the handler threads are daemons, which server_close() does not join).
        self._open: dict[Any, threading.Thread] = {}
        self._open_lock = threading.Lock()
        self._closing = False
        self._httpd = _Server((host, port), ReportRequest)
        self._httpd.reports = self
        # After the bind, so that a taken port leaks no thread.
        self.deadlines = deadlines.Deadlines("report-deadlines")
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="reports", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, cut off the connections still open (a slow client is not waited
        for until its deadline) and wait for their threads."""
        self._httpd.shutdown()
        with self._open_lock:
            self._closing = True
            still_open = list(self._open.items())
        for handler, _ in still_open:
            handler.cut_off()
        self._httpd.server_close()
        for _, thread in still_open:
            thread.join(timeout=5)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.deadlines.stop()
        self.gate.close()

    def opened(self, handler: Any) -> bool:
        """A connection's handler starts; False once close() has begun."""
        with self._open_lock:
            if self._closing:
                return False
            self._open[handler] = threading.current_thread()
            return True

    def closed(self, handler: Any) -> None:
        with self._open_lock:
            self._open.pop(handler, None)

    def say_once(self, who: str, outcome: str, message: str) -> None:
        """A refusal, logged the first time this client meets it (a flood is one line)."""
        with self._said_lock:
            if (who, outcome) in self._said:
                return
            if len(self._said) > 10_000:
                self._said.clear()
            self._said.add((who, outcome))
        log.warning("progress report from %s refused: %s", who, message)

    def wrap(self, connection: socket.socket) -> socket.socket:
        """TLS for one accepted connection; the handshake runs on its own thread, under the
        connection's deadline, not on the accepting one."""
        if self._tls is None:
            return connection
        return self._tls.context().wrap_socket(connection, server_side=True, do_handshake_on_connect=False)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    reports: ReportServer  # whose requests it serves (ReportRequest reads it)


class ReportRequest(http.server.BaseHTTPRequestHandler):
    """One connection to the endpoint: at most one report, under one deadline."""

    protocol_version = "HTTP/1.1"
    server_version = "gpuop-reports"
    sys_version = ""

    def setup(self) -> None:
        self.reports: ReportServer = cast(_Server, self.server).reports
        self._slot = self.reports._slots.acquire(blocking=False)
        self._release = self._slot
        self.connection_before_wrap = self.request
        limits = self.reports.gate.limits
        # One deadline for the whole request: a per-read timeout alone lets a client that
        # sends a byte a second hold a thread forever.
        self._deadline = self.reports.deadlines.after(limits.request_seconds, self.cut_off)
        if not self.reports.opened(self):
            self.cut_off()  # closing: answer nobody
        self._wrapped = False
        try:
            self.request = self.reports.wrap(self.request)
            self._wrapped = self.request is not self.connection_before_wrap
        except (OSError, ssl.SSLError) as exc:  # the certificate went missing: answer nobody
            log.error("report endpoint: no TLS for a connection: %s", exc)
            self._slot, self._release = False, self._slot
        self.request.settimeout(limits.request_seconds)
        super().setup()

    def cut_off(self) -> None:
        # The TCP socket's shutdown, not SSLSocket.shutdown(), which also drops the TLS
        # object under the handler thread (a handshake not yet begun would then raise
        # AttributeError rather than read the end of the connection).
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.request, socket.SHUT_RDWR)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.reports.deadlines.cancel(self._deadline)
            self.reports.closed(self)
            if self._wrapped:  # the server closes the plain socket it accepted, not this one
                self.request.close()
            if self._release:
                self.reports._slots.release()

    def handle(self) -> None:
        if not self._slot:
            return  # over the connection bound (or no certificate): closed unanswered
        try:
            if self._wrapped:
                self.request.do_handshake()
        except ssl.SSLError as exc:  # a client without our CA, or not speaking TLS at all
            self.reports.say_once(self.client_address[0], "tls", f"TLS handshake failed: {exc.reason or exc}")
            self.reports.counted("tls", 0.0)
            return
        except OSError:
            return  # cut off or reset before the handshake ended: nothing to answer
        with contextlib.suppress(OSError):  # cut off or reset: nothing to answer
            super().handle()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("report endpoint: " + format, *args)

    def do_POST(self) -> None:
        started = time.monotonic()
        self.close_connection = True  # one report per connection: clients send every 5 s
        who = self.client_address[0]
        outcome, status, document = "accepted", 200, {}
        self._body_read = False
        try:
            key = RateLimiter.target(self.path)
            token = RateLimiter.token(self.headers.get("Authorization"))
            who = f"{self.client_address[0]} ({key[0]}/{key[1]})"
            self.reports.rate.admit(token)
            body = self._body()
            pod = self.reports.gate.authenticate(key, token)
            who = f"pod {key[0]}/{pod}"
            try:
                report = parse_report(body)
            except ReportError as exc:
                raise RefusalError(exc.status, "invalid", str(exc)) from None
            self.reports.book.put(
                key, ReceivedReport(pod=pod, report=report, received_at=self.reports.clock())
            )
        except RefusalError as refusal:
            outcome, status, document = refusal.outcome, refusal.status, {"error": str(refusal)}
            self.reports.say_once(who, refusal.outcome, f"{refusal.status} {refusal}")
        finally:
            # Counted before the answer goes out: once a client has its answer, the
            # operator's metrics show it. Counted after, a client could read its answer
            # and the metrics before this thread counted it (a test did, once in ~1,700).
            self.reports.counted(outcome, time.monotonic() - started)
        self._answer(status, document)
        self._drain()

    def _drain(self) -> None:
        """Read and drop the body a refusal did not need (at most _DRAINED_BYTES, within
        the deadline) before the socket is closed: closed with unread data, it is reset,
        and the reset can reach the client before it has read the answer."""
        if self._body_read:
            return
        length = (self.headers.get("Content-Length") or "").strip()
        if length.isascii() and length.isdigit() and int(length) <= _DRAINED_BYTES:
            with contextlib.suppress(OSError, ValueError):
                self.rfile.read(int(length))

    def do_GET(self) -> None:
        self.close_connection = True
        self._answer(405, {"error": "POST a trainerStatus report"})

    def _body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raise RefusalError(411, "no_length", "Content-Length is required")
        length = (self.headers.get("Content-Length") or "").strip()
        # ASCII digits only: "²" is a digit to isdigit() and no number to int().
        if not (length.isascii() and length.isdigit()):
            raise RefusalError(411, "no_length", "Content-Length is required")
        if int(length) > MAX_REPORT_BYTES:
            raise RefusalError(413, "too_large", f"body over {MAX_REPORT_BYTES} bytes")
        body = self.rfile.read(int(length))
        self._body_read = True
        if len(body) != int(length):
            raise RefusalError(400, "truncated", "the body ended early")
        return body

    def _answer(self, status: int, document: dict[str, Any]) -> None:
        data = json.dumps(document).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client left


class _Certificates:
    """The serving certificate, re-read when its files change (cert-manager or the chart renews
    them in place), checked per connection by one stat."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._stamp: tuple[float, float] | None = None
        self._context: ssl.SSLContext | None = None
        self.context()  # a missing or broken certificate fails the start, not the first report

    def context(self) -> ssl.SSLContext:
        cert, key = self.directory / TLS_CERT, self.directory / TLS_KEY
        stamp = (os.stat(cert).st_mtime, os.stat(key).st_mtime)
        with self._lock:
            if self._context is None or stamp != self._stamp:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.load_cert_chain(cert, key)
                # No TLS 1.3 session tickets: each connection carries one report, and clients
                # (urllib, requests, Go's default) do not resume sessions, so the two tickets
                # OpenSSL sends after every handshake were a fifth of the endpoint's CPU.
                context.num_tickets = 0
                self._context, self._stamp = context, stamp
            return self._context


def ca_bundle(tls_dir: Path) -> str:
    """The CA the trainers verify the endpoint with (put in each training's namespace)."""
    return (tls_dir / TLS_CA).read_text()
