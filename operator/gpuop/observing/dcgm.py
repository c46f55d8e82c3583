"""GPU figures for any image, read from NVIDIA's dcgm-exporter: its Prometheus text (or a
Prometheus query's answer over the same series) into :class:`~gpuop.observing.scrape.GpuFigures`
per pod. Pure, no I/O: :mod:`gpuop.controller.gpusource` fetches.

dcgm-exporter runs on each GPU node and labels each GPU's series with the pod holding it
(``namespace``, ``pod``, ``container``; empty strings for a GPU no pod holds), so a user's own
image gets the figures our trainer reports from NVML. Relied on, as dcgm-exporter documents
them: the labels ``gpu``, ``UUID``, ``modelName``, ``Hostname`` (or ``hostname``), MIG's
``GPU_I_ID``/``GPU_I_PROFILE``, and the units noted at :data:`FIELDS`.

The rule: every body is untrusted input (any exporter, any Prometheus, any size). A body
over its bound raises ValueError and is not read; within it, a line or a result this module
cannot read is absent, a value outside its field's range is absent, and nothing else is ever
raised. A GPU is keyed by its UUID (else by host and index) and its holder, so two nodes'
GPU 0 never merge, and a GPU shared by two pods (time-slicing) counts for each.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from gpuop.observing.scrape import GpuFigures

GPU_UTIL: Final = "DCGM_FI_DEV_GPU_UTIL"  # percent, 0..100
GR_ENGINE_ACTIVE: Final = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"  # ratio, 0..1; profiling, opt-in
FB_USED: Final = "DCGM_FI_DEV_FB_USED"  # MiB
FB_FREE: Final = "DCGM_FI_DEV_FB_FREE"  # MiB
FB_TOTAL: Final = "DCGM_FI_DEV_FB_TOTAL"  # MiB; some setups only
FIELDS: Final = (GPU_UTIL, GR_ENGINE_ACTIVE, FB_USED, FB_FREE, FB_TOTAL)
EXPORTER_PORT: Final = 9400

# The most one scraped answer may hold: a dcgm-exporter's page or a Prometheus query's answer.
# A node with 8 GPUs and the default ~40 fields serves about 30 KiB; with the profiling
# fields, MIG (up to 7 instances a GPU) and pod labels, a few hundred KiB. 4 MiB leaves an
# order of magnitude over that and bounds what one answer can hold in memory.
MAX_SCRAPE_BYTES: Final = 4 * 1024 * 1024
# Parsing is what costs: ~0.5 us a character in the worst case (measured: lines full of
# escaped quotes, 2 s for 4 MiB). The lines of the five fields read here are ~10 KiB on a
# typical 8-GPU node, ~270 KiB at most (16 GPUs x 7 MIG instances x 5 fields x ~500 B), so
# bounding them to 1 MiB bounds one answer's parse to ~0.5 s (measured 0.55 s, worst case).
MAX_READ_BYTES: Final = 1024 * 1024
# A real line is ~250 B; pod labels exported as metric labels add a few KiB at most.
MAX_LINE_BYTES: Final = 16 * 1024
# The largest nodes hold 16 GPUs; as MIG instances, 7 each.
MAX_GPUS_PER_POD: Final = 128
# A Kubernetes cluster is supported up to 5,000 nodes, one exporter each.
MAX_EXPORTERS: Final = 5000
# A GPU's model name is under 100 characters; a MIG profile ("3g.40gb") adds a few.
_MAX_NAME: Final = 128
_MAX_INDEX: Final = 32
_MIB: Final = 1024 * 1024
# The largest GPUs hold under 200 GiB; 16 TiB leaves two orders of magnitude and still
# excludes DCGM's "blank" values (near 2**31 and 2**63) that unsupported fields report.
_MAX_MIB: Final = 16 * 1024 * 1024
_RANGES: Final[Mapping[str, tuple[float, float]]] = {
    GPU_UTIL: (0, 100),
    GR_ENGINE_ACTIVE: (0, 1),
    FB_USED: (0, _MAX_MIB),
    FB_FREE: (0, _MAX_MIB),
    FB_TOTAL: (0, _MAX_MIB),
}
# The start of a line of one of FIELDS: the name, then labels or the value.
_WANTED_LINE: Final = re.compile("(?:" + "|".join(FIELDS) + r")[{ \t]")


@dataclass(frozen=True)
class GpuSample:
    """One GPU (or MIG instance) held by one container, as one exporter reported it."""

    gpu: tuple[str, ...]  # the GPU's identity: ("uuid", UUID, instance) or ("host", host, index, instance)
    index: str  # the label `gpu`, with "/<instance>" for a MIG instance
    name: str | None  # the model, e.g. "NVIDIA H100 80GB HBM3", with the MIG profile if any
    namespace: str
    pod: str
    container: str
    values: Mapping[str, float] = field(default_factory=dict)  # in range only, per FIELDS
    order: tuple[str, int, int, str] = ("", 0, 0, "")  # host, index, instance, UUID: sort key


def parse_exposition(text: str) -> tuple[GpuSample, ...]:
    """The GPUs in a dcgm-exporter's Prometheus text exposition, with the values of FIELDS.

    ValueError for a body over MAX_SCRAPE_BYTES, or whose lines of FIELDS are over
    MAX_READ_BYTES; lines of other metrics, comments and unreadable lines are skipped.
    """
    if len(text) > MAX_SCRAPE_BYTES:
        raise ValueError(f"dcgm-exporter response over {MAX_SCRAPE_BYTES} bytes; not read")
    # Only the lines of FIELDS reach the parser (a regex match each, ~0.2 us a line): the
    # exporter's other fields are most of its body (~80% with its default counters).
    # Comments are dropped too: a TYPE line cannot turn a gauge into a counter ("_total").
    wanted = [
        line for line in text.split("\n") if len(line) <= MAX_LINE_BYTES and _WANTED_LINE.match(line.lstrip())
    ]
    if sum(len(line) for line in wanted) > MAX_READ_BYTES:
        raise ValueError(f"dcgm-exporter response has over {MAX_READ_BYTES} bytes of GPU lines; not read")
    collected = _Collector()
    for line in wanted:
        # One line at a time: one odd line (an exporter's bug, a label it escapes oddly) is
        # absent rather than the whole node's figures. Whatever this lax third-party parser
        # raises on a line means only that the line is unreadable.
        try:
            samples = [s for family in text_string_to_metric_families(line) for s in family.samples]
        except Exception:
            continue
        for sample in samples:
            collected.add(sample.name, sample.labels, sample.value)
    return collected.samples()


def parse_query_result(body: str) -> tuple[GpuSample, ...]:
    """The GPUs in a Prometheus ``/api/v1/query`` answer (an instant vector of FIELDS'
    series, as :func:`prometheus_queries` asks). ValueError for a body over MAX_SCRAPE_BYTES
    or one that is not a successful vector answer; an unreadable result is skipped."""
    if len(body) > MAX_SCRAPE_BYTES:
        raise ValueError(f"query response over {MAX_SCRAPE_BYTES} bytes; not read")
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested past the stack
        raise ValueError(f"query response is not JSON: {str(exc)[:200]}") from None
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, dict) or answer.get("status") != "success" or data.get("resultType") != "vector":
        raise ValueError("query response is not a successful instant vector")
    results = data.get("result")
    if not isinstance(results, list):
        raise ValueError("query response has no result list")
    collected = _Collector()
    for result in results:
        labels = result.get("metric") if isinstance(result, dict) else None
        value = result.get("value") if isinstance(result, dict) else None
        if not isinstance(labels, dict) or not isinstance(value, list) or len(value) != 2:
            continue
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            continue
        if not isinstance(value[1], str) or len(value[1]) > 64:  # Prometheus sends the value as a string
            continue
        try:
            number = float(value[1])
        except ValueError:
            continue
        collected.add(labels.get("__name__", ""), labels, number)
    return collected.samples()


def prometheus_queries(namespace: str) -> tuple[str, str]:
    """The PromQL instant queries for FIELDS' series of the GPUs a namespace's pods hold.

    Two, because Prometheus renames the exporter's own ``namespace``/``pod``/``container``
    labels to ``exported_*`` when its scrape config does not honor them (the target's labels
    win), and an ``or`` of both would merge series by their labels less the name.
    """
    escaped = namespace.replace("\\", "\\\\").replace('"', '\\"')
    names = "|".join(FIELDS)
    return (
        f'{{__name__=~"{names}",namespace="{escaped}"}}',
        f'{{__name__=~"{names}",exported_namespace="{escaped}"}}',
    )


def gpus_by_pod(text: str, namespace: str, pods: Collection[str]) -> dict[str, tuple[GpuFigures, ...]]:
    """For each of ``pods`` in ``namespace`` that holds a GPU, its GPUs' figures, from one
    exporter's text. ValueError as :func:`parse_exposition`."""
    return figures_by_pod(parse_exposition(text), namespace, pods)


def figures_by_pod(
    samples: Iterable[GpuSample], namespace: str, pods: Collection[str]
) -> dict[str, tuple[GpuFigures, ...]]:
    """For each of ``pods`` in ``namespace`` holding a GPU in ``samples`` (several exporters'
    together), its GPUs' figures in index order, at most MAX_GPUS_PER_POD each. A GPU listed
    twice for one pod (two of its containers share it) counts once."""
    held: dict[str, dict[tuple[str, ...], GpuSample]] = {}
    for sample in samples:
        if sample.namespace == namespace and sample.pod in pods:
            held.setdefault(sample.pod, {}).setdefault(sample.gpu, sample)
    return {
        pod: tuple(_figures(s) for s in sorted(gpus.values(), key=lambda s: s.order)[:MAX_GPUS_PER_POD])
        for pod, gpus in sorted(held.items())
    }


def exporter_urls(endpoints: Mapping[str, Any], port: int = EXPORTER_PORT) -> tuple[str, ...]:
    """The exporters' base URLs (``http://10.0.3.7:9400``) from the Service's ``Endpoints``,
    an ``EndpointSlice``, or a list of slices (``items``), as the API server returns them.

    Ready addresses only, IPs only (a hostname is not ours to resolve), at most
    MAX_EXPORTERS. The port is the one numbered ``port`` if listed, else the only one listed,
    else ``port``.
    """
    groups: list[tuple[list[str], Any]] = []  # (addresses, ports) per subset or slice
    items = endpoints.get("items")
    objects: list[Any] = items if isinstance(items, list) else [endpoints]
    for obj in objects:
        if not isinstance(obj, Mapping):
            continue
        for subset in _list(obj.get("subsets")):  # v1 Endpoints: not-ready ones are apart
            if isinstance(subset, Mapping):
                ips = [a.get("ip") for a in _list(subset.get("addresses")) if isinstance(a, Mapping)]
                groups.append(([ip for ip in ips if isinstance(ip, str)], subset.get("ports")))
        if "endpoints" in obj and obj.get("addressType") in ("IPv4", "IPv6"):  # discovery.k8s.io/v1
            addresses: list[str] = []
            for endpoint in _list(obj.get("endpoints")):
                if not isinstance(endpoint, Mapping):
                    continue
                conditions = endpoint.get("conditions")
                if isinstance(conditions, Mapping) and conditions.get("ready") is False:
                    continue  # absent or null means ready, as the API documents
                addresses += [a for a in _list(endpoint.get("addresses")) if isinstance(a, str)]
            groups.append((addresses, obj.get("ports")))
    urls: set[str] = set()
    for addresses, ports in groups:
        chosen = _port(ports, port)
        for address in addresses:
            try:
                ip = ipaddress.ip_address(address)
            except ValueError:
                continue
            urls.add(f"http://[{ip}]:{chosen}" if ip.version == 6 else f"http://{ip}:{chosen}")
    return tuple(sorted(urls))[:MAX_EXPORTERS]


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _port(ports: Any, wanted: int) -> int:
    numbers: list[int] = []
    for entry in _list(ports):
        number = entry.get("port") if isinstance(entry, Mapping) else None
        if isinstance(number, int) and 0 < number < 65536:
            numbers.append(number)
    return numbers[0] if len(numbers) == 1 and wanted not in numbers else wanted


class _Collector:
    """Samples of FIELDS, gathered per GPU and holder; values outside their range dropped."""

    def __init__(self) -> None:
        self._gpus: dict[tuple[str, ...], tuple[GpuSample, dict[str, float]]] = {}

    def add(self, name: str, labels: Mapping[str, str], value: float) -> None:
        limits = _RANGES.get(name)
        index = labels.get("gpu", "")
        if limits is None or not index or len(index) > _MAX_INDEX:
            return
        # Through Prometheus, a scrape config that does not honor the exporter's labels keeps
        # the target's (the exporter pod's own) and renames the exporter's to exported_*.
        # A GPU no pod holds then carries the exporter pod's own labels alone (Prometheus
        # keeps no empty label): it reads as held by the exporter pod, never one of ours.
        exported = "exported_pod" in labels or "exported_namespace" in labels
        namespace = labels.get("exported_namespace" if exported else "namespace", "")
        pod = labels.get("exported_pod" if exported else "pod", "")
        if not namespace or not pod:
            return  # a GPU no pod holds
        container = labels.get("exported_container" if exported else "container", "")
        uuid = labels.get("UUID", "")
        # Through Prometheus, `instance` (the exporter's address) tells nodes apart too.
        host = labels.get("Hostname") or labels.get("hostname") or labels.get("instance") or ""
        instance = labels.get("GPU_I_ID", "")[:_MAX_INDEX]  # a MIG instance of GPU `gpu`
        gpu = ("uuid", uuid, instance) if uuid else ("host", host, index, instance)
        key = (*gpu, namespace, pod, container)
        if key not in self._gpus:
            model = _printable(labels.get("modelName", ""))
            profile = _printable(labels.get("GPU_I_PROFILE", ""))
            sample = GpuSample(
                gpu=gpu,
                index=f"{index}/{instance}" if instance else index,
                name=(f"{model} MIG {profile}" if profile else model)[:_MAX_NAME] or None,
                namespace=namespace,
                pod=pod,
                container=container,
                order=(host, _number(index), _number(instance), uuid),
            )
            self._gpus[key] = (sample, {})
        low, high = limits
        # NaN fails both comparisons; a huge integer compares without becoming a float.
        if low <= value <= high:
            self._gpus[key][1][name] = float(value)

    def samples(self) -> tuple[GpuSample, ...]:
        return tuple(
            GpuSample(s.gpu, s.index, s.name, s.namespace, s.pod, s.container, values, s.order)
            for s, values in self._gpus.values()
        )


def _figures(sample: GpuSample) -> GpuFigures:
    values = sample.values
    # The profiling field is preferred where exported. GPU_UTIL is NVML's figure: the share
    # of a short sample period (1/6 s to 1 s, by product) in which any kernel ran, so a
    # scrape sees a snapshot, and DCGM reports none for a MIG instance. GR_ENGINE_ACTIVE, from
    # DCGM's profiling module, is the engine's active share averaged over DCGM's whole update
    # interval and is reported per MIG instance; NVIDIA names the profiling fields the better
    # measure of real use. (Both count the time any kernel ran, however small; how much of
    # the GPU it used is SM_ACTIVE's, not read here.) Profiling fields are exported only
    # where the cluster enabled them, hence the fallback.
    engine = values.get(GR_ENGINE_ACTIVE)
    utilization = engine * 100 if engine is not None else values.get(GPU_UTIL)
    used = values.get(FB_USED)
    free = values.get(FB_FREE)
    # FB_TOTAL, where exported, includes the memory the driver reserves; used + free does not.
    total = values.get(FB_TOTAL)
    if total is None and used is not None and free is not None:
        total = used + free
    if total is not None and used is not None and total < used:
        total = None  # an exporter contradicting itself: the total is the figure in doubt
    return GpuFigures(
        index=sample.index,
        name=sample.name,
        utilization_percent=utilization,
        memory_used_bytes=None if used is None else round(used * _MIB),
        memory_total_bytes=None if total is None else round(total * _MIB),
    )


def _number(text: str) -> int:
    """An index label as a number for sorting ("10" after "9"); after them all if not one."""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else 10**10


def _printable(text: str) -> str:
    """A label bound for the status: control characters dropped, at most _MAX_NAME long."""
    return "".join(c for c in text[: _MAX_NAME * 2] if c.isprintable())[:_MAX_NAME]
