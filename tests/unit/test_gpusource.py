"""DcgmSource against stand-in dcgm-exporters (no GPU behind them) and a stand-in Prometheus
over them: the figures per namespace and pod, and what a hung, oversized, redirecting or
down exporter costs: one timeout at most, its own figures only, never an exception."""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gpuop.controller.gpusource import DcgmSource, read_bounded
from gpuop.observing import dcgm
from gpuop.observing.scrape import GpuFigures
from support.dcgm_standin import H100, H100_MIB, StandinNode, StandinServer, dcgm_exporter, node, prometheus

MIB = 1024 * 1024
# The per-read deadline of the hang tests: each costs about this once. Two waited in turn would
# cost twice this, which is what the bounds tell apart, with a second of room for a loaded machine.
TIMEOUT = 1.0


def nodes() -> tuple[StandinNode, StandinNode]:
    """Two nodes: GPU 0 of each held by a different pod of team-a (the same index on both),
    GPU 1 of node-b by team-b's pod, the rest idle and held by no pod."""
    a, b = node("node-a", 4), node("node-b", 2)
    gpu = a.gpus[0].hold("team-a", "mnist-master-0")
    gpu.utilization_percent, gpu.memory_used_mib = 87, 40000
    gpu = b.gpus[0].hold("team-a", "mnist-worker-0")
    gpu.utilization_percent, gpu.memory_used_mib, gpu.engine_active = 100, 30000, 0.625
    gpu = b.gpus[1].hold("team-b", "other-0")
    gpu.utilization_percent, gpu.engine_active = 12, 0.125
    return a, b


WANTED = {"team-a": {"mnist-master-0", "mnist-worker-0"}, "team-b": {"other-0"}}
EXPECTED = {
    "team-a": {
        "mnist-master-0": (GpuFigures("0", H100, 87.0, 40000 * MIB, H100_MIB * MIB),),
        # Profiling enabled on node-b: the engine's activity, not GPU_UTIL's 100.
        "mnist-worker-0": (GpuFigures("0", H100, 62.5, 30000 * MIB, H100_MIB * MIB),),
    },
    "team-b": {"other-0": (GpuFigures("1", H100, 12.5, 0, H100_MIB * MIB),)},
}


class Outcomes(list[str]):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __call__(self, outcome: str) -> None:
        with self._lock:
            self.append(outcome)


@pytest.fixture
def exporters() -> Iterator[tuple[StandinServer, StandinServer]]:
    a, b = nodes()
    with dcgm_exporter(a) as server_a, dcgm_exporter(b) as server_b:
        yield server_a, server_b


def source(*urls: str, timeout: float = 5.0, **options: object) -> DcgmSource:
    return DcgmSource(urls, timeout_seconds=timeout, reuse_seconds=0, **options)  # type: ignore[arg-type]


def test_reads_each_exporter_into_figures_per_namespace_and_pod(
    exporters: tuple[StandinServer, StandinServer],
) -> None:
    outcomes = Outcomes()
    reader = source(*(s.url for s in exporters), count=outcomes)
    try:
        assert reader.read(WANTED) == EXPECTED
        assert reader.read({"team-c": {"x"}}) == {"team-c": {}}  # read, and no GPU of theirs
    finally:
        reader.close()
    assert outcomes == ["ok"] * 4


def test_answers_serve_reads_within_reuse_seconds(exporters: tuple[StandinServer, StandinServer]) -> None:
    reader = DcgmSource([s.url for s in exporters], reuse_seconds=3600)
    try:
        for namespace, pods in WANTED.items():  # one read per namespace, as a reconcile would
            assert reader.read({namespace: pods}) == {namespace: EXPECTED[namespace]}
    finally:
        reader.close()
    assert [s.requests for s in exporters] == [1, 1]


@pytest.mark.parametrize("honor_labels", [True, False])
def test_reads_through_prometheus(honor_labels: bool) -> None:
    with prometheus(nodes(), honor_labels=honor_labels) as server:
        reader = DcgmSource(prometheus_url=server.url + "/", prometheus_headers={"Authorization": "Bearer t"})
        try:
            assert reader.read(WANTED) == EXPECTED
        finally:
            reader.close()
        assert server.requests == 4  # two queries per namespace


def test_a_prometheus_that_fails_leaves_its_namespaces_unread() -> None:
    with prometheus(nodes()) as server:
        server.body = b"<html>proxy error</html>"
        reader = DcgmSource(prometheus_url=server.url, timeout_seconds=5)
        try:
            assert reader.read(WANTED) == {}
        finally:
            reader.close()


def test_hung_exporters_cost_one_timeout_together(exporters: tuple[StandinServer, StandinServer]) -> None:
    healthy, hung = exporters
    outcomes = Outcomes()
    with dcgm_exporter(node("node-c", 1)) as also_hung:
        hung.hang()
        also_hung.hang()
        reader = source(healthy.url, hung.url, also_hung.url, timeout=TIMEOUT, count=outcomes)
        try:
            started = time.monotonic()
            read = reader.read(WANTED)
            elapsed = time.monotonic() - started
            assert hung.arrived.is_set()  # asked, and holding the request
            assert also_hung.arrived.is_set()
            assert read == {"team-a": {"mnist-master-0": EXPECTED["team-a"]["mnist-master-0"]}, "team-b": {}}
            # Waited on together: two hung in turn would cost two timeouts.
            assert TIMEOUT * 0.9 < elapsed < TIMEOUT * 2
        finally:
            hung.release()
            also_hung.release()
            reader.close()


def test_a_hung_prometheus_costs_one_timeout() -> None:
    with prometheus(nodes()) as server:
        server.hang()
        reader = DcgmSource(prometheus_url=server.url, timeout_seconds=TIMEOUT)
        try:
            started = time.monotonic()
            assert reader.read(WANTED) == {}
            assert time.monotonic() - started < TIMEOUT * 2
        finally:
            server.release()
            reader.close()


LINE = 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-x",Hostname="h",namespace="team-a",pod="mnist-worker-0"} 50\n'


@pytest.mark.parametrize(
    ("body", "declare_length"),
    [
        (LINE * (10 * MIB // len(LINE) + 1), True),
        (LINE * (10 * MIB // len(LINE) + 1), False),
        # Cut at the bound, 2-byte characters decode to half as many: still refused.
        (LINE + "# " + "\u00e9" * (5 * MIB), False),
    ],
    ids=["declared", "until-close", "multibyte-until-close"],
)
def test_an_exporter_serving_10_mib_is_dropped(
    exporters: tuple[StandinServer, StandinServer], body: str, declare_length: bool
) -> None:
    healthy, huge = exporters
    huge.body, huge.declare_length = body.encode(), declare_length
    outcomes = Outcomes()
    reader = source(healthy.url, huge.url, count=outcomes)
    try:
        assert reader.read(WANTED) == {
            "team-a": {"mnist-master-0": EXPECTED["team-a"]["mnist-master-0"]},
            "team-b": {},
        }
    finally:
        reader.close()
    assert sorted(outcomes) == ["error", "ok"]


def test_read_bounded_reads_one_byte_past_the_bound_at_most() -> None:
    reply = io.BytesIO(b"x" * (10 * MIB))
    body = read_bounded(reply, dcgm.MAX_SCRAPE_BYTES + 1, time.monotonic() + 60)
    assert len(body) == reply.tell() == dcgm.MAX_SCRAPE_BYTES + 1
    assert read_bounded(io.BytesIO(b"short"), 100, time.monotonic() + 60) == b"short"


def test_read_bounded_stops_at_the_deadline() -> None:
    with pytest.raises(TimeoutError):
        read_bounded(io.BytesIO(b"x"), 100, time.monotonic() - 1)


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_a_down_exporter_costs_its_own_figures_only(exporters: tuple[StandinServer, StandinServer]) -> None:
    healthy, _ = exporters
    outcomes = Outcomes()
    reader = source(healthy.url, closed_port_url(), count=outcomes)
    try:
        started = time.monotonic()
        assert set(reader.read(WANTED)["team-a"]) == {"mnist-master-0"}
        assert time.monotonic() - started < 1.0  # refused at once, no timeout waited
    finally:
        reader.close()
    assert sorted(outcomes) == ["error", "ok"]


def test_with_every_exporter_down_or_none_nothing_is_read() -> None:
    for urls in ([closed_port_url()], []):
        reader = source(*urls)
        try:
            assert reader.read(WANTED) == {}
        finally:
            reader.close()


def test_a_redirect_is_not_followed(exporters: tuple[StandinServer, StandinServer]) -> None:
    healthy, _ = exporters
    redirecting = StandinServer(lambda path: (302, "text/plain", b""))
    redirecting.headers = {"Location": f"{healthy.url}/metrics"}
    reader = source(redirecting.url)
    try:
        assert reader.read(WANTED) == {}
        assert redirecting.requests == 1
        assert healthy.requests == 0
    finally:
        reader.close()
        redirecting.close()
