"""The operator's watch of its jobs (PyTorchJobs, TrainJobs): a list, then a watch from its version.

Kopf watched them before, at about 2 ms of the operator's CPU per job event: two thirds of what
the operator spent beyond a plain controller in a burst of 1,000 new trainings. What the
operator needs of a job event is small: decode it, update what it knows of the job, and
reconcile the training when the job brings news. With this watch instead, the operator used 9%
less CPU and 17% less peak memory in that burst (bench/operator_scale.py, docs/benchmarks.md).
Each job API (and each watched namespace) has a thread of its own here that:

- lists the labelled jobs, then watches from the list's resourceVersion, resuming from the last
  version seen when the stream ends, breaks or the server is busy (with backoff);
- lists again when the API server has forgotten that version (410 Gone), and tells the jobs that
  went meanwhile as DELETED;
- looks again every :data:`NOT_SERVED_RETRY_SECONDS` while the API is not served (a Kubeflow
  installed later is found without a restart) or may not be read (RBAC being rolled out).

Events are handed, in the order they came, to :class:`Serial`: one job's events run one at a
time and in order, on a pool, as Kopf ran them. Handling one only keeps the job and queues its
training (the reconciler's work queue), but may ask the API server first (which namespaces this
replica leads; after a DELETED, whether the training is still there), and that wait must hold
neither the stream nor another training.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import urllib3

from gpuop.api.identity import TRAINING_LABEL
from gpuop.controller.apiclient import RETRIED_STATUSES, ApiError
from gpuop.controller.kube import Kube

log = logging.getLogger(__name__)

# Seconds between looks at an API that is not served here, or that this operator may not read.
NOT_SERVED_RETRY_SECONDS: Final = 30.0
# Seconds before a broken stream is opened again: the API server restarting, say.
RECONNECT_SECONDS: Final = 1.0
# Seconds close() waits for the streams, all of them together.
CLOSE_SECONDS: Final = 3.0
# The API server ends each watch after this, and the stream is opened again from its version.
WATCH_SECONDS: Final = 300

Deliver = Callable[[str | None, dict[str, Any]], None]


class Serial:
    """Calls run on a pool, those of one key one at a time and in the order given. Thread-safe.

    A key's calls queue behind the one running; other keys' calls go on beside it, so a
    training whose reconcile is slow (its API calls retried) delays only its own events."""

    def __init__(self, workers: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._queued: dict[Hashable, collections.deque[Callable[[], None]]] = {}

    def submit(self, key: Hashable, call: Callable[[], None]) -> None:
        with self._lock:
            queue = self._queued.get(key)
            if queue is not None:  # its calls are running: this one comes after them
                queue.append(call)
                return
            self._queued[key] = collections.deque((call,))
        try:
            self._pool.submit(self._drain, key)
        except RuntimeError:  # shut down: the operator is stopping
            with self._lock:
                self._queued.pop(key, None)

    def _drain(self, key: Hashable) -> None:
        while True:
            with self._lock:
                queue = self._queued[key]
                if not queue:
                    del self._queued[key]
                    return
                call = queue.popleft()
            try:
                call()
            except Exception:  # a defect in one call must not stop its key's later calls
                log.exception("handling a job event for %s", key)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _tombstone(obj: dict[str, Any]) -> dict[str, Any]:
    """What a DELETED told after a relist carries of a job: who it was and whose it was."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "labels") if k in meta},
    }


class _Stream:
    """One job API in one namespace (or all): list, watch, relist, deliver in order."""

    def __init__(
        self, kube: Kube, api_version: str, plural: str, namespace: str | None, deliver: Deliver,
        stopping: threading.Event,
    ) -> None:  # fmt: skip
        self.kube, self.api_version, self.plural, self.namespace = kube, api_version, plural, namespace
        self.deliver = deliver
        self.stopping = stopping
        self.where = f"{plural} in {namespace}" if namespace else f"{plural} in all namespaces"
        self.response: urllib3.BaseHTTPResponse | None = None  # the open watch, to cut on stop
        self._known: dict[tuple[str, str], dict[str, Any]] = {}  # tombstones of the jobs seen
        # The last resourceVersion seen, to resume a stream from; None: list (again) first. Kept
        # here, not in the loop, so that a stream that breaks mid-way resumes after its last event.
        self._version: str | None = None
        self._logged: str | None = None  # the last trouble logged, so a lasting one is said once
        self.thread = threading.Thread(
            target=self._run, name=f"watch-{plural}-{namespace or 'all'}", daemon=True
        )

    def _run(self) -> None:
        failures = 0  # transient failures in a row, for the backoff
        while not self.stopping.is_set():
            began = time.monotonic()
            try:
                if self._version is None:
                    self._version = self._list()
                self._watch(self._version)
                failures = 0
                self._not_again_at_once(began)
            except ApiError as exc:
                if self.stopping.is_set():
                    return
                if exc.status == 410:  # the version is too old: what happened since is in a list
                    self._version = None
                    self._not_again_at_once(began)
                elif exc.status == 0 or exc.status in RETRIED_STATUSES:
                    # Broken, or the server busy or restarting: go on from the last version seen.
                    failures += 1
                    self._log_trouble(f"watching {self.where}: {exc}; opening it again", logging.INFO)
                    self.stopping.wait(min(RECONNECT_SECONDS * 2 ** (failures - 1), NOT_SERVED_RETRY_SECONDS))
                else:
                    self._version = None
                    self._log_trouble(
                        self._trouble(exc), logging.INFO if exc.status == 404 else logging.WARNING
                    )
                    self.stopping.wait(NOT_SERVED_RETRY_SECONDS)
            except Exception:  # a defect: said, and the watch starts over rather than ending
                log.exception("watching %s", self.where)
                self._version = None
                self.stopping.wait(NOT_SERVED_RETRY_SECONDS)

    def _not_again_at_once(self, began: float) -> None:
        """A stream the server ended at once (a proxy cutting it, a 410 after each list) is not
        opened again at once: no loop at full speed against the API server."""
        if time.monotonic() - began < RECONNECT_SECONDS:
            self.stopping.wait(RECONNECT_SECONDS)

    def _trouble(self, exc: ApiError) -> str:
        if exc.status == 404:
            return (f"{self.where}: not served here (its CRD is not installed); "
                    f"looking again every {NOT_SERVED_RETRY_SECONDS:g}s")  # fmt: skip
        if exc.status == 403:
            return (f"{self.where}: this operator may not list and watch them ({exc.message}); grant "
                    "it (the chart's RBAC does); asking again every "
                    f"{NOT_SERVED_RETRY_SECONDS:g}s")  # fmt: skip
        return f"watching {self.where}: {exc}; trying again in {NOT_SERVED_RETRY_SECONDS:g}s"

    def _log_trouble(self, trouble: str | None, level: int = logging.WARNING) -> None:
        """Log a trouble once while it lasts, and its end (None) once the watch is open again."""
        if trouble is not None and trouble != self._logged:
            log.log(level, "%s", trouble)
        elif trouble is None and self._logged is not None:
            log.info("watching %s", self.where)
        self._logged = trouble

    def _list(self) -> str:
        items, version = self.kube.list_objects(self.api_version, self.plural, self.namespace, TRAINING_LABEL)
        listed = {_key(item): item for item in items}
        for key in self._known.keys() - listed.keys():  # gone while no watch was open
            self.deliver("DELETED", self._known.pop(key))
        for key, item in listed.items():
            self._known[key] = _tombstone(item)
            self.deliver(None, item)  # as Kopf tells a listed object: no event type
        return version

    def _watch(self, version: str) -> None:
        """Deliver the stream's events, keeping the last version seen to resume from."""
        events = self.kube.watch_objects(
            self.api_version, self.plural, self.namespace, TRAINING_LABEL, version,
            timeout_seconds=WATCH_SECONDS, opened=self._opened,
        )  # fmt: skip
        # Closed here, not when the generator is collected: a stream left on an ERROR would hold
        # its connection through the wait that follows.
        with contextlib.closing(events):
            try:
                for event in events:
                    kind, obj = event.get("type"), event.get("object")
                    if not isinstance(obj, dict):
                        raise ApiError(0, "BadEvent", f"a watch event with no object: {str(event)[:200]}")
                    if kind == "ERROR":
                        code = obj.get("code")
                        raise ApiError(code if isinstance(code, int) else 500, str(obj.get("reason") or ""),
                                       str(obj.get("message") or ""))  # fmt: skip
                    self._version = str((obj.get("metadata") or {}).get("resourceVersion") or self._version)
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        self._known.pop(_key(obj), None)
                    else:
                        self._known[_key(obj)] = _tombstone(obj)
                    self.deliver(str(kind), obj)
            finally:
                self.response = None

    def _opened(self, response: urllib3.BaseHTTPResponse) -> None:
        self.response = response
        self._log_trouble(None)
        if self.stopping.is_set():
            self.cut()

    def cut(self) -> None:
        response = self.response
        shutdown = getattr(response, "shutdown", None)  # urllib3 2.3+: ends a read in another thread
        if shutdown is not None:
            # A stream that ended meanwhile has given its socket back, and urllib3 then says
            # ValueError ("_sock_shutdown is not set"): nothing is left to cut. Raised here, it
            # made the operator exit 1 on SIGTERM (seen once in a clean-clone make test).
            with contextlib.suppress(ValueError, OSError):
                shutdown()


class JobWatch:
    """Every job API's stream, in each watched namespace (or across all); each event goes to
    ``handle`` (event type, job) on a pool, in order per job."""

    def __init__(
        self,
        kube: Kube,
        apis: Iterable[tuple[str, str]],
        namespaces: Iterable[str],
        handle: Deliver,
        workers: int,
    ) -> None:
        self._serial = Serial(workers, "job-events")
        self._stopping = threading.Event()
        self._handle = handle
        scopes: list[str | None] = list(namespaces) or [None]
        self._streams = [
            _Stream(kube, api_version, plural, namespace, self._deliver, self._stopping)
            for api_version, plural in apis
            for namespace in scopes
        ]

    def _deliver(self, event_type: str | None, obj: dict[str, Any]) -> None:
        self._serial.submit(_key(obj), lambda: self._handle(event_type, obj))

    def start(self) -> None:
        for stream in self._streams:
            stream.thread.start()

    def close(self) -> None:
        """Stop every stream, drop the events not yet handled, and wait for those being handled;
        again is harmless. One deadline for all the streams: one in the middle of a list cannot
        be cut."""
        self._stopping.set()
        for stream in self._streams:
            stream.cut()
        deadline = time.monotonic() + CLOSE_SECONDS
        for stream in self._streams:
            stream.thread.join(max(0.0, deadline - time.monotonic()))
        self._serial.close()
