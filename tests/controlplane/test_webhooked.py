"""A webhooked controller whose port was taken before it bound it starts again on new ports
(support.controllers.webhooked), as the control plane's components do: a port picked free may
go to another process's connection in between ("bind: address already in use"). A stand-in
controller plays the clash."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from support.controllers import webhooked
from support.controllers.webhooked import ControllerSpec, Ports, WebhookedController

# The stand-in: its first start says what a controller-runtime manager says on a taken port
# and exits; a later one serves /readyz on its health port.
PROGRAM = """
import http.server, pathlib, sys
tries = pathlib.Path(sys.argv[2])
tries.write_text(tries.read_text() + "x" if tries.exists() else "x")
if len(tries.read_text()) == 1:
    print('"error":"listen tcp :%s: bind: address already in use"' % sys.argv[1], flush=True)
    sys.exit(1)
class Ready(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""


class _Api:
    """The API server's part, answered in memory: the Service, endpoint and Secret are made."""

    def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        return {}


class _Plane:
    kubeconfig = Path("/nonexistent")


def _controller(tmp_path: Path, ports: list[Ports], program: str = PROGRAM) -> WebhookedController:
    def command(binary: Path, given: Ports, workdir: Path) -> list[str]:
        ports.append(given)
        return [str(binary), "-c", program, str(given.health), str(workdir / "tries")]

    spec = ControllerSpec(name="stand-in", binary=lambda: Path(sys.executable), namespace="stand-in",
                          service="stand-in-webhook", secret="stand-in-certs", webhooks=list,
                          command=command)  # fmt: skip
    return WebhookedController(spec, _Plane(), _Api(), "127.0.0.1", tmp_path)  # type: ignore[arg-type]


def test_a_port_taken_before_the_controller_bound_it_makes_it_start_again_on_new_ports(
    tmp_path: Path,
) -> None:
    ports: list[Ports] = []
    controller = _controller(tmp_path, ports)
    try:
        controller.start(timeout=30)
        assert len(ports) == 2, ports  # the clash, then a start on ports picked again
        assert ports[0] != ports[1]
        assert controller.process is not None
        assert controller.process.poll() is None
    finally:
        controller.stop()


def test_a_controller_that_fails_otherwise_is_not_started_again(tmp_path: Path) -> None:
    ports: list[Ports] = []
    controller = _controller(
        tmp_path, ports, "import sys; print('flag provided but not defined'); sys.exit(2)"
    )
    try:
        with pytest.raises(RuntimeError, match="exited with 2") as raised:
            controller.start(timeout=30)
        assert not isinstance(raised.value, webhooked.PortTakenError)
        assert len(ports) == 1
    finally:
        controller.stop()
