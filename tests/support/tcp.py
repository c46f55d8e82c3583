"""A TCP server for the tests' stand-ins: ``handle(connection)`` on a thread of its own per
connection (the standard library's threading server), serving until :meth:`TcpServer.close`."""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # as socket.create_server: an address is free again at once
    daemon_threads = True  # each handler ends by itself once its owner closes


class TcpServer:
    def __init__(self, address: tuple[str, int], handle: Callable[[socket.socket], None], name: str) -> None:
        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                handle(self.request)

        self._server = _Server(address, Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.1,), daemon=True, name=name
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
