"""A STAND-IN for NVIDIA's dcgm-exporter, for tests: there is no GPU and no DCGM behind it.
It serves, on 127.0.0.1 at an ephemeral port, the text a dcgm-exporter in Kubernetes mode
serves at ``/metrics`` (its default counters' HELP and TYPE lines, one line per GPU with the
labels ``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName``, ``Hostname``,
``container``, ``namespace``, ``pod``), with the figures and pod assignments a test sets.
:func:`prometheus` serves the same series the way a Prometheus scraping such exporters
answers ``/api/v1/query`` (for the selectors :func:`gpuop.observing.dcgm.prometheus_queries`
writes, nothing more of PromQL).

A test can make a server hang (:meth:`StandinServer.hang`; it answers once released, by the
test or on exit) or serve a body of its own (:attr:`StandinServer.body`), to stand for an
exporter that is hung or hostile. Not a product feature, never shipped.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# What DCGM reports for a field the GPU does not support (DCGM_INT64_NOT_SUPPORTED).
NOT_SUPPORTED = 9223372036854775794
H100 = "NVIDIA H100 80GB HBM3"
H100_MIB = 81559

# (field, Prometheus type, help) of the exporter's default counters, in its order.
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    (
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total number of NVLink bandwidth counters for all lanes",
    ),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
    ),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
)
_ENGINE_ACTIVE = ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.")
# The figures a test does not set: plausible constants for a busy H100.
_STEADY = {
    "DCGM_FI_DEV_SM_CLOCK": 1980,
    "DCGM_FI_DEV_MEM_CLOCK": 2619,
    "DCGM_FI_DEV_MEMORY_TEMP": 43,
    "DCGM_FI_DEV_GPU_TEMP": 38,
    "DCGM_FI_DEV_POWER_USAGE": 412.5,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 9876543210,
}


@dataclass
class StandinGpu:
    """One GPU as the stand-in reports it; empty holder labels: no pod holds it."""

    index: int
    uuid: str
    model: str = H100
    utilization_percent: float = 0.0
    engine_active: float | None = None  # DCGM_FI_PROF_GR_ENGINE_ACTIVE, exported when set
    memory_used_mib: int = 0
    memory_total_mib: int = H100_MIB
    namespace: str = ""
    pod: str = ""
    container: str = ""
    unsupported: frozenset[str] = frozenset()  # fields reported as NOT_SUPPORTED

    def hold(self, namespace: str, pod: str, container: str = "trainer") -> StandinGpu:
        self.namespace, self.pod, self.container = namespace, pod, container
        return self

    def value(self, name: str) -> float:
        if name in self.unsupported:
            return NOT_SUPPORTED
        figures = {
            "DCGM_FI_DEV_GPU_UTIL": self.utilization_percent,
            "DCGM_FI_DEV_FB_USED": self.memory_used_mib,
            "DCGM_FI_DEV_FB_FREE": self.memory_total_mib - self.memory_used_mib,
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": self.engine_active or 0.0,
        }
        return figures.get(name, _STEADY.get(name, 0))


@dataclass
class StandinNode:
    """A GPU node's exporter data: its host name and its GPUs."""

    hostname: str
    gpus: list[StandinGpu] = field(default_factory=list)

    def labels(self, gpu: StandinGpu) -> dict[str, str]:
        return {
            "gpu": str(gpu.index),
            "UUID": gpu.uuid,
            "pci_bus_id": f"00000000:{0x18 + gpu.index:02X}:00.0",
            "device": f"nvidia{gpu.index}",
            "modelName": gpu.model,
            "Hostname": self.hostname,
            "container": gpu.container,
            "namespace": gpu.namespace,
            "pod": gpu.pod,
        }

    def counters(self) -> tuple[tuple[str, str, str], ...]:
        profiling = any(g.engine_active is not None for g in self.gpus)
        return _COUNTERS + ((_ENGINE_ACTIVE,) if profiling else ())

    def exposition(self) -> str:
        """The text dcgm-exporter serves: per field its HELP and TYPE, then one line a GPU."""
        lines: list[str] = []
        for name, kind, help_text in self.counters():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for gpu in self.gpus:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in self.labels(gpu).items())
                lines.append(f"{name}{{{labels}}} {_number(gpu.value(name))}")
        return "\n".join(lines) + "\n"


def node(hostname: str, count: int = 8, *, model: str = H100) -> StandinNode:
    """A node of ``count`` idle GPUs no pod holds, UUIDs unique per host name."""
    serial = sum(hostname.encode()) % 0xFFFF
    return StandinNode(
        hostname,
        [
            StandinGpu(i, f"GPU-{serial:04x}{i:04x}-5a1e-4c0d-9e3b-000000{serial:06x}", model)
            for i in range(count)
        ],
    )


class StandinServer:
    """An HTTP server on ``host`` (127.0.0.1, or an address pods reach); ``url`` is its base.
    Serves until :meth:`close`."""

    def __init__(self, route: Callable[[str], tuple[int, str, bytes]], host: str = "127.0.0.1") -> None:
        self.body: bytes | None = None  # served instead of the route's answer when set
        self.declare_length = True  # False: no Content-Length, the body ends when the connection does
        self.headers: dict[str, str] = {}  # sent with every answer (a Location, say)
        self.requests = 0
        self.arrived = threading.Event()  # a request came in (and, when hanging, is held)
        self._route = route
        self._hanging = False
        self._release = threading.Event()
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, 0), self._handler())
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        # A short poll: close() waits up to one for the serving loop to notice.
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def hang(self) -> None:
        """Hold every request unanswered until :meth:`release` (or close)."""
        self._release.clear()
        self._hanging = True

    def release(self) -> None:
        self._hanging = False
        self._release.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with standin._lock:
                    standin.requests += 1
                standin.arrived.set()
                if standin._hanging:
                    standin._release.wait(timeout=60)
                status, kind, body = standin._route(self.path)
                if standin.body is not None:
                    status, kind, body = 200, "text/plain; version=0.0.4", standin.body
                with contextlib.suppress(OSError):  # the client gave up on us: expected
                    self.send_response(status)
                    self.send_header("Content-Type", kind)
                    for name, value in standin.headers.items():
                        self.send_header(name, value)
                    if standin.declare_length:
                        self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    for start in range(0, len(body), 1 << 20):
                        self.wfile.write(body[start : start + (1 << 20)])

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


@contextlib.contextmanager
def dcgm_exporter(standin_node: StandinNode, host: str = "127.0.0.1") -> Iterator[StandinServer]:
    """A stand-in dcgm-exporter for ``standin_node`` at ``<url>/metrics``, listening on ``host``."""

    def route(path: str) -> tuple[int, str, bytes]:
        if urllib.parse.urlsplit(path).path != "/metrics":
            return 404, "text/plain", b"404 page not found\n"
        return 200, "text/plain; version=0.0.4; charset=utf-8", standin_node.exposition().encode()

    server = StandinServer(route, host)
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def prometheus(nodes: Sequence[StandinNode], *, honor_labels: bool = True) -> Iterator[StandinServer]:
    """A stand-in Prometheus that scraped a stand-in exporter on each of ``nodes`` (in the
    namespace ``gpu-operator``), answering ``/api/v1/query`` for selectors of the form
    ``{__name__=~"A|B",label="value"}``. With ``honor_labels`` False, as a scrape config
    that does not honor the exporter's labels, the exporter's ``namespace``, ``pod`` and
    ``container`` become ``exported_*`` and the target's own take their place."""

    def series() -> Iterator[dict[str, str]]:
        for standin_node in nodes:
            for name, _, _ in standin_node.counters():
                for gpu in standin_node.gpus:
                    labels = standin_node.labels(gpu)
                    if not honor_labels:
                        for key in ("namespace", "pod", "container"):
                            labels[f"exported_{key}"] = labels.pop(key)
                        labels.update(
                            namespace="gpu-operator",
                            pod=f"nvidia-dcgm-exporter-{standin_node.hostname}",
                            container="nvidia-dcgm-exporter",
                        )
                    labels.update(__name__=name, instance=f"{standin_node.hostname}:9400", job="dcgm")
                    # Prometheus keeps no label with an empty value.
                    yield {k: v for k, v in labels.items() if v} | {"value": _number(gpu.value(name))}

    def route(path: str) -> tuple[int, str, bytes]:
        parts = urllib.parse.urlsplit(path)
        query = urllib.parse.parse_qs(parts.query).get("query", [""])[0]
        matched = _SELECTOR.fullmatch(query)
        if parts.path != "/api/v1/query" or matched is None:
            error = {"status": "error", "errorType": "bad_data", "error": f"stand-in cannot read {query!r}"}
            return 400, "application/json", json.dumps(error).encode()
        names = set(matched["names"].split("|"))
        label, wanted = matched["label"], matched["value"]
        result = [
            {"metric": {k: v for k, v in s.items() if k != "value"}, "value": [1700000000.0, s["value"]]}
            for s in series()
            if s["__name__"] in names and s.get(label) == wanted
        ]
        answer = {"status": "success", "data": {"resultType": "vector", "result": result}}
        return 200, "application/json", json.dumps(answer).encode()

    server = StandinServer(route)
    try:
        yield server
    finally:
        server.close()


_SELECTOR = re.compile(r'\{__name__=~"(?P<names>[A-Z_|]+)",(?P<label>\w+)="(?P<value>[^"\\]*)"\}')


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**63 else repr(value)
