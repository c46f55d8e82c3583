"""A fault-injecting HTTP proxy between a client and the real kube-apiserver.

The client (the operator) talks plain HTTP on loopback to the proxy, which forwards to the
API server over TLS, passing the client's bearer token through, so authentication and RBAC
stay the real server's. A share of requests (``rate``) meets a fault instead, the kinds a
client of a real cluster meets under load, during a control-plane upgrade or on a flaky
network:

- ``500``: an internal error, nothing forwarded;
- ``429``: too many requests with ``Retry-After: 1``, as API Priority and Fairness sends;
- ``409``: a conflict on a create or an update, nothing forwarded (where a real server sends
  one: a name taken, a stale resourceVersion; never to a read, and a merge patch without a
  resourceVersion is retried inside the server instead);
- ``timeout``: no reply within the client's patience; the connection then closes;
- ``lost-reply``: forwarded, the server acts on it, and the reply never reaches the client
  (the write happened; the client cannot know);
- ``cut``: a watch stream forwarded for a moment and then cut mid-stream (its chunked body
  left without its last chunk, as a dropped connection leaves it).

Watch requests have a rate of their own (``watch_rate``). Every fault is counted by kind;
the proxy serves until :meth:`close`.
"""

from __future__ import annotations

import http.client
import random
import ssl
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Final

WRITES: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_HOP_BY_HOP: Final = frozenset({"connection", "transfer-encoding", "keep-alive", "content-length"})


class FaultProxy:
    def __init__(
        self, upstream: str, ca: Path, rate: float, *, watch_rate: float | None = None, seed: int = 1,
        timeout_seconds: float = 3.0,
    ) -> None:  # fmt: skip
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream_host = parsed.hostname or "127.0.0.1"
        self.upstream_port = parsed.port or 443
        self.context = ssl.create_default_context(cafile=str(ca))
        self.rate = rate
        # A client holds only a few watches, each for minutes: they need their own, higher
        # rate for cuts to happen at all in a short test.
        self.watch_rate = rate if watch_rate is None else watch_rate
        self.random = random.Random(seed)
        self.timeout_seconds = timeout_seconds
        self.injected: Counter[str] = Counter()
        self.forwarded = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self.server.shutdown()
        self.server.server_close()

    def _fault(self, method: str, watch: bool) -> str | None:
        with self._lock:
            if self.random.random() >= (self.watch_rate if watch else self.rate):
                return None
            kinds = ["500", "429", "timeout"]
            if method in WRITES:
                kinds.append("lost-reply")
            if method in ("POST", "PUT"):
                kinds.append("409")
            if watch:  # errors on opening a watch are the reads' kinds, covered above
                kinds = ["cut"]
            kind = self.random.choice(kinds)
            self.injected[kind] += 1
            return kind

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                return

            def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True

            def _status(self, code: int, reason: str) -> bytes:
                return (
                    f'{{"kind":"Status","apiVersion":"v1","status":"Failure","message":"injected {code}",'
                    f'"reason":"{reason}","code":{code}}}'
                ).encode()

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                watch = query.get("watch", ["false"])[0] in ("true", "1")
                fault = proxy._fault(self.command, watch)
                if fault == "500":
                    return self._reply(500, self._status(500, "InternalError"))
                if fault == "429":
                    return self._reply(429, self._status(429, "TooManyRequests"), {"Retry-After": "1"})
                if fault == "409":
                    return self._reply(409, self._status(409, "Conflict"))
                if fault == "timeout":
                    proxy._closing.wait(proxy.timeout_seconds)
                    self.close_connection = True
                    return None
                upstream = http.client.HTTPSConnection(
                    proxy.upstream_host, proxy.upstream_port, context=proxy.context, timeout=400
                )
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                with proxy._lock:
                    proxy.forwarded += 1
                if fault == "lost-reply":
                    response.read()
                    upstream.close()
                    self.close_connection = True
                    return None
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)
                self.send_header("Connection", "close")
                if not watch:
                    data = response.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    # A stream, relayed chunked as the API server sends it: until the server ends
                    # it (the last chunk then says so), the client goes, or (a cut) a moment has
                    # passed, when the connection closes with no last chunk. The client then sees
                    # a body cut short, as behind a load balancer that drops the connection; a
                    # body that only the close delimits would end cleanly mid-event, and a client
                    # that reads lines would take the half line it got for a whole one.
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    deadline = time.monotonic() + proxy.random.uniform(0.5, 3.0) if fault == "cut" else None
                    ended = False
                    while not proxy._closing.is_set():
                        if deadline is not None:  # a quiet stream must be cut on time too
                            upstream.sock.settimeout(max(0.01, deadline - time.monotonic()))
                        try:
                            chunk = response.read1(65536)
                        except TimeoutError:
                            break
                        if not chunk:
                            ended = True
                            break
                        if deadline is not None and time.monotonic() > deadline:
                            break
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    if ended:
                        self.wfile.write(b"0\r\n\r\n")
                upstream.close()
                self.close_connection = True
                return None

            def _safe(self) -> None:
                try:
                    self._handle()
                except (TimeoutError, OSError, http.client.HTTPException):
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _safe  # noqa: N815

        return Handler
