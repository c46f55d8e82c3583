"""A real S3-compatible object store for the tests: SeaweedFS, built from its Go module
(``tests/objectstore/go.mod``) as the control plane is, started as ``weed mini`` on this machine's
address (the chain's pods reach it there, the tests too) with one identity (an access key and its secret) and the buckets a test names; and a fault proxy in
front of it that answers 503 or answers slowly for a while, as a store under load does.

Why SeaweedFS and not MinIO: MinIO's server is under the AGPL-3.0, which this project's package
rules keep out (machine-facts.md names MinIO's module; the served-modules list marks AGPL modules
not to use). SeaweedFS is Apache-2.0, its S3 gateway is used in production, and it checks AWS
Signature V4 as S3 does, so wrong credentials are refused here as in a cloud.

    PYTHONPATH=tests python3 -m support.objectstore      # build (or find) the server
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

from support.paths import ROOT
from support.plane import gobuild

MODULE: Final = ROOT / "tests" / "objectstore"
SEAWEEDFS: Final = "github.com/seaweedfs/seaweedfs"
ACCESS_KEY: Final = "gpuop-test"
SECRET_KEY: Final = "gpuop-test-secret-key"
REGION: Final = "us-east-1"


def recipe() -> gobuild.Recipe:
    version = gobuild.required_version(MODULE, SEAWEEDFS)
    return gobuild.Recipe(
        name="objectstore",
        module=MODULE,
        packages={"weed": f"{SEAWEEDFS}/weed"},
        label=f"seaweedfs-{version.rsplit('-', 1)[-1]}",
        cold_cost="measured 3.7 min downloading its modules and a build on 2 cores (see README)",
    )


def ensure_server() -> Path:
    """The cached ``weed`` binary, built first when missing. Safe from several processes."""
    return gobuild.ensure(recipe()) / "weed"


@dataclass(frozen=True)
class S3Server:
    """A running store: where it answers and the credentials it takes."""

    endpoint: str  # http://ADDRESS:PORT: this machine's address, which pods reach too
    directory: Path

    def env(self, *, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
        """The standard variables a client reads (obstore, boto3, the AWS CLI alike)."""
        return {
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def secret(self, name: str) -> dict[str, Any]:
        """A Secret holding :meth:`env`, for ``spec.checkpoint.secretName``."""
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": self.env()}

    def put(self, bucket: str, files: dict[str, bytes]) -> None:
        """Upload ``files`` (their names the keys) to ``bucket``, as a user's ``aws s3 cp`` would."""
        import obstore

        store = self._store(bucket)
        for name, data in files.items():
            obstore.put(store, name, data)

    def _store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                       region=REGION, client_options={"allow_http": True})  # fmt: skip

    def names(self, bucket: str, prefix: str) -> list[str]:
        """The object names under ``prefix`` in ``bucket``, relative to it (as a user's
        ``aws s3 ls`` shows them)."""
        import obstore

        store = self._store(bucket)
        root = prefix.strip("/") + "/"
        return sorted(
            o["path"].removeprefix(root) for batch in obstore.list(store, prefix=root) for o in batch
        )


def _free_port(host: str) -> int:
    # SeaweedFS listens on each port and on port + 10000 (its gRPC): both must be free.
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = int(probe.getsockname()[1])
        if port + 10000 > 65535:
            continue
        with socket.socket() as grpc:
            try:
                grpc.bind((host, port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free pair of ports (port, port + 10000) found on {host}")


def _free_ports(host: str, names: tuple[str, ...]) -> dict[str, int]:
    """A free pair for each name, none of them another's: weed mini refuses a port that is
    another service's port + 10000 ("reserved for gRPC calculation"; seen once at random)."""
    taken: set[int] = set()
    ports: dict[str, int] = {}
    for _ in range(200):
        port = _free_port(host)
        if {port, port + 10000} & taken:
            continue
        ports[names[len(ports)]] = port
        taken |= {port, port + 10000}
        if len(ports) == len(names):
            return ports
    raise RuntimeError(f"no {len(names)} distinct free pairs of ports found on {host}")


@contextlib.contextmanager
def running_server(directory: Path, buckets: tuple[str, ...], host: str = "127.0.0.1") -> Iterator[S3Server]:
    """``weed mini`` in ``directory`` with ``buckets`` made, listening on ``host`` (give this
    machine's own address for pods to reach it: they cannot reach its loopback), until the
    block ends."""
    weed = ensure_server()
    directory.mkdir(parents=True, exist_ok=True)
    identities = {"identities": [{
        "name": "gpuop-test",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        # What a checkpoint writer needs and no more (no Admin: it may not make buckets).
        "actions": ["Read", "Write", "List"],
    }]}  # fmt: skip
    config = directory / "s3.json"
    config.write_text(json.dumps(identities))
    ports = _free_ports(host, ("master", "volume", "filer", "s3"))
    command = [
        str(weed), "mini", f"-dir={directory / 'data'}", f"-ip={host}", f"-ip.bind={host}",
        f"-s3.config={config}", f"-bucket={','.join(buckets)}",
        *(f"-{name}.port={port}" for name, port in ports.items()),
        # Only what S3 needs: no WebDAV, admin UI, Iceberg or Lance listeners, no telemetry.
        "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false",
        # As S3 does: a write to a bucket that does not exist is refused, not the bucket made.
        "-s3.autoCreateBucket=false",
    ]  # fmt: skip
    (directory / "data").mkdir(exist_ok=True)
    log = (directory / "weed.log").open("ab")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = S3Server(f"http://{host}:{ports['s3']}", directory)
    try:
        _wait_ready(server, buckets, process)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait_ready(server: S3Server, buckets: tuple[str, ...], process: subprocess.Popen[bytes]) -> None:
    """Until the gateway answers and every bucket takes a write (the volume server joins the
    master a few seconds after the gateway listens)."""
    import obstore
    from obstore.store import S3Store

    deadline = time.monotonic() + 120
    problem = "not started"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            for bucket in buckets:
                store = S3Store(bucket, endpoint=server.endpoint, access_key_id=ACCESS_KEY,
                                secret_access_key=SECRET_KEY, region=REGION,
                                client_options={"allow_http": True})  # fmt: skip
                obstore.put(store, ".ready", b"ok")
                obstore.delete(store, ".ready")
            return
        except Exception as exc:  # not listening yet, or no volume to write to yet
            problem = " ".join(str(exc).split())[:300]
            time.sleep(0.5)
    tail = (server.directory / "weed.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"SeaweedFS at {server.endpoint} not ready ({problem}); its log ends:\n{tail}")


class FaultyStore:
    """An HTTP proxy in front of the store that can answer 503 (SlowDown), refuse, or answer late.

    Requests pass through with their Host header, so the server checks the client's Signature V4
    as signed. ``fail_next(n)`` answers 503 to the next ``n`` requests; ``refuse_puts(n, after)``
    answers 403 (AccessDenied, which no client retries) to ``n`` writes once ``after`` more have
    passed; ``slow_next(n, delay)`` holds each of the next ``n`` it passes on ``delay`` seconds
    first. Counted, not timed: what a test sees does not depend on how fast this machine is.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.answered_503 = 0
        self.refused = 0
        self.passed = 0
        self._to_fail = 0
        self._to_refuse = 0
        self._puts_first = 0
        self._to_slow = 0
        self._delay = 0.0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        # Each request on a connection of its own (Connection: close), so that close() can wait
        # for every handler: none is left waiting on a client's idle keep-alive connection.
        self.server.daemon_threads = False
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def fail_next(self, requests: int) -> None:
        with self._lock:
            self._to_fail = requests

    def refuse_puts(self, writes: int, after: int = 0) -> None:
        with self._lock:
            self._to_refuse, self._puts_first = writes, after

    def slow_next(self, requests: int, delay: float) -> None:
        with self._lock:
            self._to_slow, self._delay = requests, delay

    def _next_fault(self, method: str) -> str | None:
        """What the next request gets, counted off: "fail" (503), "refuse" (403, writes only),
        "slow", or None (passed on as it is)."""
        with self._lock:
            if self._to_fail > 0:
                self._to_fail -= 1
                self.answered_503 += 1
                return "fail"
            if method == "PUT" and self._to_refuse > 0:
                if self._puts_first == 0:
                    self._to_refuse -= 1
                    self.refused += 1
                    return "refuse"
                self._puts_first -= 1
            if self._to_slow > 0:
                self._to_slow -= 1
                return "slow"
            return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()  # joins the handlers
        self._thread.join(timeout=5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return None

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._next_fault(self.command)
                if fault == "refuse":
                    self._error(403, "AccessDenied", "Access Denied")
                    return
                if fault == "fail":
                    self._error(503, "SlowDown", "Please reduce your request rate.")
                    return
                if fault == "slow":
                    time.sleep(proxy._delay)
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                upstream.request(self.command, self.path, body=body, headers=headers)
                reply = upstream.getresponse()
                data = reply.read()
                with proxy._lock:
                    proxy.passed += 1
                self.close_connection = True
                self.send_response(reply.status)
                self.send_header("Connection", "close")
                for key, value in reply.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(key, value)
                # A HEAD's reply has no body but the length of the object's.
                length = reply.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            def _error(self, status: int, code: str, message: str) -> None:
                """An S3 error reply, its XML as S3 writes it."""
                text = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
                self.close_connection = True
                self.send_response(status)
                self.send_header("Connection", "close")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def do_GET(self) -> None:
                self._any()

            def do_PUT(self) -> None:
                self._any()

            def do_POST(self) -> None:
                self._any()

            def do_DELETE(self) -> None:
                self._any()

            def do_HEAD(self) -> None:
                self._any()

        return Handler


if __name__ == "__main__":
    sys.exit(gobuild.print_built(ensure_server))
