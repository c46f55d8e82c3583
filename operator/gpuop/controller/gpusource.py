"""GPU figures for pods of any image, from NVIDIA's dcgm-exporter on each GPU node, either
read directly or through a Prometheus-compatible query API. Blocking calls, never raising.

What a caller passes (the lead wires it from settings and the cluster):

- ``exporters``: the exporters' base URLs (``http://10.0.3.7:9400``); in a cluster, the
  ready addresses of the exporter Service's Endpoints or EndpointSlices (the GPU Operator's
  is ``gpu-operator/nvidia-dcgm-exporter``), turned into URLs by
  :func:`gpuop.observing.dcgm.exporter_urls`. Refreshed with :meth:`DcgmSource.set_exporters`
  as nodes come and go. The operator needs network reach to the exporter pods on 9400;
  outside the cluster, pod IPs are unreachable, so use the Prometheus mode there.
- or ``prometheus_url``: the base of a Prometheus-compatible HTTP API
  (``http://prometheus-operated.monitoring:9090``; Thanos, Mimir and VictoriaMetrics answer
  the same ``/api/v1/query``) that scrapes the exporters, with ``prometheus_headers`` for
  one that wants a bearer token. Used instead of ``exporters`` when given.

:meth:`DcgmSource.read` takes ``{namespace: pod names}`` and returns, per namespace that
could be read, ``{pod: its GPUs' figures}``: a namespace absent means not read this time
(keep what was seen), a pod absent means no GPU of it was seen. Every answer is untrusted
input: read bounded (:data:`~gpuop.observing.dcgm.MAX_SCRAPE_BYTES`, at most one byte more),
each request with a deadline, all concurrently in a pool of their own, so one hung exporter
costs one timeout, not a tick; parsed by :mod:`gpuop.observing.dcgm`.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Final, Protocol

from gpuop.observing import dcgm
from gpuop.observing.scrape import GpuFigures

log = logging.getLogger(__name__)

PodGpus = dict[str, tuple[GpuFigures, ...]]
_CHUNK: Final = 64 * 1024
# What the caller waits past the deadline for answers already in hand to be handed over.
_HANDOVER_SECONDS: Final = 0.05


class Readable(Protocol):
    def read1(self, size: int, /) -> bytes: ...


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """An exporter's answer is untrusted: a redirect would send the operator's request to
    any address it names, so a 3xx is an error instead."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class DcgmSource:
    """GPU figures per pod from dcgm-exporters or a Prometheus over them. Thread-safe:
    concurrent reads in exporter mode wait for one fetch and share it."""

    def __init__(
        self,
        exporters: Iterable[str] = (),
        *,
        prometheus_url: str | None = None,
        prometheus_headers: Mapping[str, str] | None = None,
        timeout_seconds: float = 3.0,
        max_workers: int = 16,
        reuse_seconds: float = 5.0,
        count: Callable[[str], None] | None = None,
    ) -> None:
        """``reuse_seconds``: how long the exporters' answers serve further reads, so that
        reads of several namespaces in one tick fetch each exporter once (dcgm-exporter
        itself collects every 30 s by default, so nothing newer is lost). ``count`` is called
        with "ok" or "error" per request (a counter of the operator's own metrics)."""
        self.timeout_seconds = timeout_seconds
        self.reuse_seconds = reuse_seconds
        self.prometheus_url = prometheus_url.rstrip("/") if prometheus_url else None
        self._prometheus_headers = dict(prometheus_headers or {})
        self._exporters: tuple[str, ...] = ()
        self.set_exporters(exporters)
        self._count = count if count is not None else (lambda outcome: None)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="dcgm")
        # Exporters are pod IPs: never through an HTTP proxy from the environment, and never
        # redirected. A Prometheus may sit behind a proxy; it is configured, so it may.
        self._direct = urllib.request.build_opener(urllib.request.ProxyHandler({}), _RefuseRedirects())
        self._configured = urllib.request.build_opener(_RefuseRedirects())
        self._lock = threading.Lock()  # one fetch of the exporters at a time; others reuse it
        self._cached: tuple[float, tuple[dcgm.GpuSample, ...]] | None = None

    def set_exporters(self, urls: Iterable[str]) -> None:
        """The exporters to read from now on (at most MAX_EXPORTERS, duplicates dropped)."""
        self._exporters = tuple(sorted({u.rstrip("/") for u in urls}))[: dcgm.MAX_EXPORTERS]

    def read(self, wanted: Mapping[str, Collection[str]]) -> dict[str, PodGpus]:
        """For each namespace of ``wanted`` that could be read, its pods' GPUs. Never raises."""
        try:
            if self.prometheus_url is not None:
                return self._read_prometheus(self.prometheus_url, wanted)
            samples = self._exporter_samples()
            if samples is None:
                return {}
            return {ns: dcgm.figures_by_pod(samples, ns, pods) for ns, pods in wanted.items()}
        except Exception:  # a bug here must cost the GPU figures, never the reconcile
            log.exception("reading GPU figures from dcgm-exporter failed")
            return {}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _exporter_samples(self) -> tuple[dcgm.GpuSample, ...] | None:
        """Every exporter's GPUs, fetched concurrently or reused; None when none answered."""
        with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < self.reuse_seconds:
                return self._cached[1]
            urls = self._exporters
            if not urls:
                return None
            deadline = time.monotonic() + self.timeout_seconds
            answers = self._gather(
                [self._pool.submit(self._fetch_exposition, url, deadline) for url in urls], deadline
            )
            if not answers:
                return None
            samples = tuple(s for answer in answers for s in answer)
            self._cached = (time.monotonic(), samples)
            return samples

    def _read_prometheus(self, base: str, wanted: Mapping[str, Collection[str]]) -> dict[str, PodGpus]:
        deadline = time.monotonic() + self.timeout_seconds
        futures = {
            ns: [self._pool.submit(self._query, base, q, deadline) for q in dcgm.prometheus_queries(ns)]
            for ns in wanted
        }
        read: dict[str, PodGpus] = {}
        for ns, answers in futures.items():
            got = self._gather(answers, deadline)
            if len(got) == len(answers):  # half the series would read as GPUs gone
                read[ns] = dcgm.figures_by_pod((s for answer in got for s in answer), ns, wanted[ns])
        return read

    def _gather(
        self, futures: list[Future[tuple[dcgm.GpuSample, ...] | None]], deadline: float
    ) -> list[tuple[dcgm.GpuSample, ...]]:
        """The answers in by the deadline; the rest are given up on (their threads end at
        their own deadline, a socket timeout at most later)."""
        done, _ = wait(futures, timeout=max(0.0, deadline - time.monotonic()) + _HANDOVER_SECONDS)
        return [answer for f in done if (answer := f.result()) is not None]

    def _fetch_exposition(self, url: str, deadline: float) -> tuple[dcgm.GpuSample, ...] | None:
        request = urllib.request.Request(f"{url}/metrics", headers={"Accept": "text/plain"})
        return self._fetch(self._direct, request, deadline, dcgm.parse_exposition)

    def _query(self, base: str, query: str, deadline: float) -> tuple[dcgm.GpuSample, ...] | None:
        target = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
        request = urllib.request.Request(target, headers=self._prometheus_headers)
        return self._fetch(self._configured, request, deadline, dcgm.parse_query_result)

    def _fetch(
        self,
        opener: urllib.request.OpenerDirector,
        request: urllib.request.Request,
        deadline: float,
        parse: Callable[[str], tuple[dcgm.GpuSample, ...]],
    ) -> tuple[dcgm.GpuSample, ...] | None:
        """One answer, parsed; None on any failure (logged at debug, counted)."""
        try:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("deadline passed before the request started")
            with opener.open(request, timeout=remaining) as reply:
                declared = reply.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > dcgm.MAX_SCRAPE_BYTES:
                    raise ValueError(f"Content-Length {declared} over {dcgm.MAX_SCRAPE_BYTES}; not read")
                # One byte past the bound is enough to refuse it: no answer makes us read more.
                body = read_bounded(reply, dcgm.MAX_SCRAPE_BYTES + 1, deadline)
            # On the bytes: decoded, a cut body of multibyte characters would pass for whole.
            if len(body) > dcgm.MAX_SCRAPE_BYTES:
                raise ValueError(f"answer over {dcgm.MAX_SCRAPE_BYTES} bytes; not read")
            answer = parse(body.decode("utf-8", errors="replace"))
        except Exception as exc:
            # Down, hung, refusing, or serving anything at all: no figures from it this time.
            log.debug("GPU figures from %s: %s", request.full_url[:200], exc)
            self._count("error")
            return None
        self._count("ok")
        return answer


def read_bounded(reply: Readable, limit: int, deadline: float) -> bytes:
    """At most ``limit`` bytes of ``reply``, stopping at EOF; TimeoutError once ``deadline``
    (time.monotonic) passes between reads. A socket timeout bounds each read alone: without
    the deadline, an answer trickling a byte per timeout would hold a thread for hours."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        if time.monotonic() > deadline:
            raise TimeoutError(f"answer not complete by the deadline ({size} bytes read)")
        chunk = reply.read1(min(_CHUNK, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
