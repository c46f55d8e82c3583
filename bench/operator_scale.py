"""What the operator costs at scale: N GpuTrainings created at once.

Against a real API server (``--kubeconfig``; `make controlplane` starts one here), for each N:

1. the limit: N PyTorchJobs, the very ones the operator would render, created by a plain
   client loop with the operator's concurrency, timed from the first request to the last
   reply: what this API server, etcd and machine can take;
2. the floor: the same loop making, per job, every write the operator's path makes (the
   user's GpuTraining, its PyTorchJob, the Created status, the Event), each as the operator
   makes it (:func:`operator_writes`: the operator's own code renders and derives them);
3. the reactive floor: the same loop creating the GpuTrainings only, and a plain controller
   in a process of its own, as the operator is (one watch, the same number of writer threads,
   jobs before statuses) making the other three writes as each training appears: the
   operator's arrival of work, with no framework and no state, measured by the same two
   watches as the operator. The floor's create->child is one request by construction (the
   thread that made the training makes its job), which no controller can match; this one's is
   the bound for the operator's;
4. the operator: ``gpuop operator`` started here, N GpuTrainings created by the same loop,
   timed from the first request until every one has its PyTorchJob and status Created, and
   until its counters show every write made (its Events are posted off the reconcile path).

It reports the operator's time against each, p50/p99 of create->child (first sight of each
object on a watch, one clock), the operator's writes per job and its writes in a quiet period
afterwards (its own request counters), its peak RSS, and the CPU seconds of the API server,
etcd, the operator and the bench in the operator's run and the floor's. All share the machine
with the API server: compare them side by side, in one run. Each run waits for its namespaces
to be deleted, so the next one does not measure that. ``--operator-source DIR`` runs the
operator from another checkout, to compare two versions run after run. ``--reactive-twice``
runs the reactive floor twice and nothing else: the spread of the p99 ratio between two
identical controllers on this host. ``--rounds K`` runs each count K times, the reactive floor
and the operator alternating which goes first, and judges issue 30's goals on the median of the
rounds (:mod:`operator_goals` says why one run cannot).

Without ``--kubeconfig`` the same operator runs against tests/support's API emulator (fast,
no server to build; the emulator stamps creation times itself), for quick comparisons of the
operator alone: not a claim about a real cluster.

    make controlplane
    .venv/bin/python bench/operator_scale.py --kubeconfig .controlplane/kubeconfig 100 500 1000
    .venv/bin/python bench/operator_scale.py --kubeconfig .controlplane/kubeconfig --rounds 6 \
        [--arrival-rate 80] 1000                                     # the goals' verdict
    .venv/bin/python bench/operator_scale.py 100 500 1000          # the emulator
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import yaml
from kubernetes import client, config, watch
from prometheus_client.parser import text_string_to_metric_families

from gpuop.api.spec import parse
from gpuop.api.spec import warnings as spec_warnings
from gpuop.api.status import status_patch
from gpuop.backends import registry
from gpuop.backends.pytorchjob import render_pytorchjob
from gpuop.controller.apiclient import WRITE_VERBS
from gpuop.controller.kube import event_body
from gpuop.observing.derive import derive_status, events
from gpuop.observing.records import Observation, Thresholds

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import operator_goals  # noqa: E402  (bench/, on the path as the script's own folder)

from support.emulator.cluster import GPUOP, JOBS, TRAININGS, cluster  # noqa: E402
from support.emulator.server import ApiServer  # noqa: E402
from support.specs import training  # noqa: E402

CRDS = [ROOT / "crds" / "gputraining.yaml", ROOT / "tests" / "reference" / "kubeflow.org_pytorchjobs.yaml"]


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _control_plane_pids() -> dict[str, int]:
    """This machine's kube-apiserver, etcd and kube-controller-manager (its garbage collector
    follows every ownerReference), when the control plane runs here (make controlplane)."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if name in ("kube-apiserver", "etcd", "kube-controller"):
                found.setdefault(name, int(entry.name))
    return found


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_emulated(count: int, quiet_seconds: float) -> dict[str, Any]:
    def instrument(server: ApiServer) -> None:
        # No admission: the Kubeflow checks (kubernetes-validate for five versions) cost the
        # emulator ~0.1 s per job on its one event loop, which would be measured instead of
        # the operator. The tests run them on every job the operator makes.
        return None

    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), instrument) as env:
        env.start_operator("--max-workers", "16")
        time.sleep(2.0)  # the operator is up and watching
        started = time.monotonic()
        names = [f"scale-{i:04d}" for i in range(count)]
        for name in names:  # "at once": straight into the store, as fast as it goes
            env.api.call(env.server.create, TRAININGS, training(name))
        created_all = time.monotonic() - started

        stamps = env.server.created_at

        def all_created() -> bool:
            statuses = env.api.call(
                lambda: [o.get("status", {}).get("phase") for o in env.server.objects(TRAININGS)]
            )
            return len(statuses) == count and all(p == "Created" for p in statuses)

        deadline = time.monotonic() + 600
        while not all_created() and time.monotonic() < deadline:
            time.sleep(0.05)
        converged = time.monotonic() - started
        assert env.operator is not None
        writes_at_created = env.writes()
        counts_before = dict(env.server.counts)
        time.sleep(quiet_seconds)
        quiet = {k: v - counts_before.get(k, 0) for k, v in env.server.counts.items()}
        quiet_patches = sum(v for (who, verb, key), v in quiet.items() if who == "gpuop" and verb == "patch")
        rss = _peak_rss_mb(env.operator.pid)
        requests: dict[str, int] = {}
        for (who, verb, key), n in env.server.counts.items():
            if who == "gpuop":
                requests[f"{verb} {key}"] = requests.get(f"{verb} {key}", 0) + n
        latencies = [stamps[JOBS, n] - stamps[TRAININGS, n] for n in names if (JOBS, n) in stamps]
        return {
            "count": count,
            "created_in_s": created_all,
            "converged_s": converged,
            **latency_figures(latencies),
            "writes_per_job": sum(writes_at_created.values()) / count,
            "writes": {k: round(v / count, 2) for k, v in writes_at_created.items()},
            "requests_per_job": {k: round(v / count, 2) for k, v in sorted(requests.items())},
            "quiet_status_patches": quiet_patches,
            "peak_rss_mb": rss,
        }


CONCURRENCY = 16  # the operator's default --max-workers: the same parallelism on both sides


def _training(name: str, namespace: str) -> dict[str, Any]:
    body = training(name, namespace)
    body["spec"]["dataset"] = {"name": "digits"}
    return body


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class FirstSeen(threading.Thread):
    """Watches one kind in one namespace and notes when each name is first seen (and, for
    GpuTrainings, when its status first says Created)."""

    def __init__(
        self,
        api: client.CustomObjectsApi,
        group: str,
        version: str,
        plural: str,
        namespace: str,
        on_first_sight: Any = None,
    ) -> None:
        super().__init__(daemon=True)
        self.api, self.args = api, (group, version, namespace, plural)
        self.on_first_sight = on_first_sight  # called with each new object, on the watch's thread
        self.seen: dict[str, float] = {}
        self.created: dict[str, float] = {}
        self.last_event = time.monotonic()  # when the watch last delivered anything
        self.ready = threading.Event()
        self.watch = watch.Watch()

    def run(self) -> None:
        version = self.api.list_namespaced_custom_object(*self.args)["metadata"]["resourceVersion"]
        self.ready.set()
        while True:
            try:
                for event in self.watch.stream(self.api.list_namespaced_custom_object, *self.args,
                                               resource_version=version, timeout_seconds=300):  # fmt: skip
                    obj = event["object"]
                    version = obj["metadata"]["resourceVersion"]
                    now = self.last_event = time.monotonic()
                    name = obj["metadata"]["name"]
                    if name not in self.seen and self.on_first_sight is not None:
                        self.on_first_sight(obj)
                    self.seen.setdefault(name, now)
                    if (obj.get("status") or {}).get("phase") == "Created":
                        self.created.setdefault(name, now)
            except Exception:  # a watch ends or breaks under load: resume where it was
                time.sleep(0.1)

    def stop(self) -> None:
        self.watch.stop()


def operator_writes(
    training: dict[str, Any], now: datetime | None = None
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The three writes the operator makes for a new GpuTraining (as stored, with its uid), made
    by the operator's own code, for the floors to make the same: its PyTorchJob (owned by the
    training), its first status patch (Created) and that transition's Event. Until 2026-11-25
    the floors wrote a job with no ownerReference and a status of one condition (~300 bytes,
    where the operator's is ~1.5 KB with three): cheaper writes than the operator's."""
    parsed = parse(training)
    api = registry.APIS["pytorchjob"]
    served = frozenset({api.backend})  # the CRDs this bench installs
    choice = registry.choose(parsed.spec.backend, served, registry.gaps(parsed.spec))
    now = now or datetime.now(UTC)
    observation = Observation(
        now=now, generation=1, workers_total=parsed.spec.workers, gpus=parsed.spec.total_gpus,
        job_api=api.facts, backend_choice=(choice.reason, choice.message), job_name=parsed.name,
        spec_warnings=tuple(str(w) for w in spec_warnings(parsed.spec)),
    )  # fmt: skip
    new = derive_status(
        None, observation, Thresholds(stall_timeout_seconds=parsed.spec.stall_timeout_seconds)
    )
    patch = status_patch(None, new)
    assert patch is not None
    (event,) = events(None, new)
    return (
        render_pytorchjob(parsed),
        patch,
        event_body(training, event.type, event.reason, event.message, now),
    )


def _watched(watchers: list[FirstSeen], work: Any) -> float:
    """Run ``work`` with the watchers on (the API server fans each write out to them)."""
    for watcher in watchers:
        watcher.start()
        watcher.ready.wait(30)
    try:
        seconds: float = work()
    finally:
        for watcher in watchers:
            watcher.stop()
    return seconds


def _create_all(create: Any, bodies: list[Any], rate: float | None = None) -> float:
    """Create every body with CONCURRENCY threads; seconds from the first request to the last reply.

    With ``rate`` (bodies per second) body i is sent no sooner than i/rate s after the start: an
    arrival that does not depend on how busy the server is, so two runs given the same rate
    meet the same queue (unpaced, a run whose controller loads the server less gets its work
    faster, and a faster arrival is a longer queue: a higher p99 for the same code). That holds
    while one create takes under CONCURRENCY/rate s; slower, the loop falls behind the rate, and
    the time it took to create them all (printed) says so."""
    started = time.monotonic()

    def send(indexed: tuple[int, Any]) -> None:
        index, body = indexed
        if rate is not None:
            time.sleep(max(0.0, started + index / rate - time.monotonic()))
        create(body)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(send, enumerate(bodies)))
    return time.monotonic() - started


# --arrival-rate: GpuTrainings per second for the reactive floor and the operator (None: at once).
ARRIVAL_RATE: float | None = None


def _create_trainings(api: client.CustomObjectsApi, namespace: str, names: list[str]) -> float:
    """The loop that creates the GpuTrainings for the reactive floor and the operator alike."""
    return _create_all(
        lambda name: api.create_namespaced_custom_object(
            "gpuop.io", "v1alpha1", namespace, "gputrainings", _training(name, namespace)
        ),
        names,
        ARRIVAL_RATE,
    )


def _watches(api: client.CustomObjectsApi, namespace: str) -> tuple[FirstSeen, FirstSeen]:
    """A namespace's GpuTrainings and PyTorchJobs, each watched (started, and listed once)."""
    trainings = FirstSeen(api, "gpuop.io", "v1alpha1", "gputrainings", namespace)
    children = FirstSeen(api, "kubeflow.org", "v1", "pytorchjobs", namespace)
    for watcher in (trainings, children):
        watcher.start()
        watcher.ready.wait(30)
    return trainings, children


def _latencies(trainings: FirstSeen, children: FirstSeen, names: list[str]) -> list[float]:
    """create->child of each name both watches saw: first sight of its job less its training's."""
    return [children.seen[n] - trainings.seen[n] for n in names if n in children.seen and n in trainings.seen]


def _cpu_seconds_of(pids: dict[str, int]) -> dict[str, float]:
    return {name: _cpu_seconds(pid) for name, pid in pids.items()}


def _cpu_seconds_since(before: dict[str, float], pids: dict[str, int]) -> dict[str, float]:
    return {name: round(_cpu_seconds(pid) - before[name], 1) for name, pid in pids.items()}


def _operator_metric(port: int, name: str) -> str:
    """One metric's series from the operator's /metrics (prometheus-client's ``name[]`` filter):
    the bench asks 10 times a second until every write is made, and the whole /metrics, with
    its series for each training, is 0.26 MB at 1,000 trainings of three series each, made by
    the operator's CPU (27 ms a request here) while it is being measured."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics?name[]={name}", timeout=5) as reply:
        return reply.read().decode()


def _operator_counters(port: int) -> dict[str, int]:
    return request_counts(_operator_metric(port, "gpuop_api_requests_total"))


def _counts(metrics: str, name: str, label: str) -> dict[str, int]:
    """One counter's values by one label, from /metrics text."""
    return {
        sample.labels[label]: int(sample.value)
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == name
    }


def _operator_reconciles(port: int) -> dict[str, int]:
    """The operator's reconciles by outcome: more than one a training in a burst is work that
    made no write (an echo of its own write it did not recognise, say)."""
    name = "gpuop_reconciles_total"
    return _counts(_operator_metric(port, name), name, "outcome")


def _operator_collections(port: int) -> dict[str, int]:
    """The operator's garbage collections by generation (prometheus-client's own GC series):
    a full collection walks every object the operator keeps, 1,000 trainings' included. Read
    from the whole /metrics (the ``name[]`` filter leaves out collectors that describe nothing,
    such as this one), so only before and after a measurement."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        return _counts(reply.read().decode(), "python_gc_collections_total", "generation")


def request_counts(metrics: str) -> dict[str, int]:
    """The operator's API requests from its /metrics text, by "<verb> <code>" (its
    ``gpuop_api_requests_total`` labels Kubernetes verbs: create, patch, list, ...)."""
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name == "gpuop_api_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = f"{sample.labels['verb']} {sample.labels['code']}"
                    out[key] = out.get(key, 0) + int(sample.value)
    return out


def writes(counters: dict[str, int]) -> int:
    """The requests among ``counters`` that change the cluster, by the operator's own verbs."""
    return sum(v for k, v in counters.items() if k.split()[0] in WRITE_VERBS)


def _created_by_list(api: client.CustomObjectsApi, namespace: str) -> set[str]:
    """The GpuTrainings whose status says Created (or later), by a list."""
    listed = api.list_namespaced_custom_object("gpuop.io", "v1alpha1", namespace, "gputrainings")
    return {o["metadata"]["name"] for o in listed["items"] if (o.get("status") or {}).get("phase")}


WATCHES_SILENT_S: Final = 10.0  # how long both watches say nothing before a list checks them


def _until_all_created(
    watches: tuple[FirstSeen, FirstSeen], count: int, deadline: float, listed: Callable[[], set[str]]
) -> set[str]:
    """Wait until the trainings' watch has seen ``count`` trainings Created, or ``deadline``;
    the names a list found Created that the watch had not seen, each counted from now (later
    than true). A watch that breaks or never delivers (seen with an older client) must not
    leave the bench waiting blind, so a list checks the count, but only once both watches
    (the trainings' and their jobs') have been silent for WATCHES_SILENT_S: a list on a timer
    loaded the API server during the operator's run alone (at N=1000, a list of up to 1,000
    trainings every 5 s, which no floor paid), and the same wait now ends every run."""
    trainings, children = watches
    found: set[str] = set()
    last_list = time.monotonic()
    while len(trainings.created.keys() | found) < count and time.monotonic() < deadline:
        time.sleep(0.05)
        now = time.monotonic()
        if now - max(trainings.last_event, children.last_event, last_list) >= WATCHES_SILENT_S:
            found, last_list = listed(), now
    now = time.monotonic()
    unseen = found - trainings.created.keys()
    for name in unseen:
        trainings.created[name] = now
    return unseen


def latency_figures(latencies: list[float]) -> dict[str, float | None]:
    """p50 and p99 in ms, or None for each when nothing was measured (said, not a crash)."""
    if not latencies:
        return {"p50_ms": None, "p99_ms": None}
    return {"p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * _percentile(latencies, 0.99)}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:6.0f} ms"


def reactive_controller(namespace: str, count: int) -> None:
    """The reactive floor's controller, in a process of its own (``--reactive-controller``), as
    the operator is: the least a controller can do with the operator's arrival of work. One
    watch, CONCURRENCY writer threads, and the operator's writes (:func:`operator_writes`) with
    nothing else: no framework, no state table; each training's job as soon as the watch shows
    it, and its status and Event once no job waits (the operator's order in a burst). Says
    ``ready`` once its watch has listed, and ``done`` once every write of ``count`` trainings
    is made.

    In the loop's own process it shared the interpreter with the loop creating the trainings,
    which then arrived 10-25% slower than the operator's (seen in every run: 10.4-11.8 s
    against 8.4-10.6 s for 1,000), and a slower arrival is a shorter queue: its create->child
    was measured against easier work than the operator's."""
    api, core = client.CustomObjectsApi(), client.CoreV1Api()
    work: queue.PriorityQueue[tuple[int, int, str]] = queue.PriorityQueue()
    done: list[str] = []  # trainings whose every write is made, the Event included
    done_lock = threading.Lock()
    all_done = threading.Event()
    order = iter(range(10**9))
    writes: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}

    def arrived(training: dict[str, Any]) -> None:
        # Rendered on the watch's thread, as the operator parses and renders what it sees.
        name = training["metadata"]["name"]
        try:
            writes[name] = operator_writes(training)
        except Exception as exc:  # said, and the run ends now rather than at its 900 s
            print(f"cannot render the writes of {name}: {exc!r}", file=sys.stderr, flush=True)
            all_done.set()
            return
        work.put((0, next(order), name))

    def writer() -> None:
        # Steps: 0 the job; 1 the status, then its Event at once; 2 the Event alone (retried
        # alone when only it failed). Jobs first: a lower step goes first.
        while True:
            step, _, name = work.get()
            job, status, event = writes[name]
            try:
                if step == 0:
                    try:
                        api.create_namespaced_custom_object(
                            "kubeflow.org", "v1", namespace, "pytorchjobs", job
                        )
                    except client.ApiException as exc:
                        if exc.status != 409:  # 409: made by the try whose reply was lost
                            raise
                    work.put((1, next(order), name))  # its status once no job waits
                    continue
                if step == 1:
                    api.patch_namespaced_custom_object_status(
                        "gpuop.io", "v1alpha1", namespace, "gputrainings", name, status
                    )
                    step = 2
                core.create_namespaced_event(namespace, event)
            except Exception:  # a refusal under load (429, 5xx), a reset connection: again, later
                time.sleep(0.2)
                work.put((step, next(order), name))
                continue
            with done_lock:
                done.append(name)
                if len(done) >= count:
                    all_done.set()

    trainings = FirstSeen(api, "gpuop.io", "v1alpha1", "gputrainings", namespace,
                          on_first_sight=arrived)  # fmt: skip
    trainings.start()
    trainings.ready.wait(30)
    for _ in range(CONCURRENCY):
        threading.Thread(target=writer, daemon=True).start()
    print("ready", flush=True)
    all_done.wait(900)
    print("done" if len(done) >= count else f"stopped with {len(done)} of {count} done", flush=True)
    threading.Event().wait()  # until killed: its CPU seconds are read after this


def reactive_floor(
    kubeconfig: str,
    api: client.CustomObjectsApi,
    namespace: str,
    names: list[str],
    servers: dict[str, int],
) -> tuple[float, float, list[float], dict[str, float]]:
    """The reactive floor, measured as the operator is: the controller in a process of its own
    (:func:`reactive_controller`), the same loop creating the GpuTrainings, the same two
    watches here. Returns (seconds until every training's Created status was seen and every
    write made, seconds the loop took to create the trainings, create->child latencies, the
    CPU seconds of each process meanwhile)."""
    trainings, children = _watches(api, namespace)
    controller = subprocess.Popen(
        [sys.executable, __file__, "--kubeconfig", kubeconfig, "--reactive-controller", namespace,
         str(len(names))],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert controller.stdout is not None
        if controller.stdout.readline().strip() != "ready":
            raise RuntimeError("the reactive floor's controller did not start")
        measured = servers | {"controller": controller.pid, "bench": os.getpid()}
        cpu_before = _cpu_seconds_of(measured)
        started = time.monotonic()
        submitted = _create_trainings(api, namespace, names)
        said = controller.stdout.readline().strip()  # "done", or "" when it died
        finished = time.monotonic()
        _until_all_created((trainings, children), len(names), finished + 60,
                           lambda: _created_by_list(api, namespace))  # fmt: skip
        last_created = max(trainings.created.values()) if trainings.created else finished
        converged = max(finished, last_created) - started
        cpu = _cpu_seconds_since(cpu_before, measured)
        if said != "done":
            print(f"         the reactive floor's controller: {said or 'died'}; its figures are not a floor",
                  flush=True)  # fmt: skip
    finally:
        controller.kill()
        controller.wait(30)
        for watcher in (trainings, children):
            watcher.stop()
    return converged, submitted, _latencies(trainings, children, names), cpu


OPERATOR_SOURCE: Path | None = None  # --operator-source: another checkout's operator, to compare


def _operator_source_env() -> dict[str, str]:
    """PYTHONPATH for an operator run from OPERATOR_SOURCE (its packages before this venv's)."""
    if OPERATOR_SOURCE is None:
        return {}
    return {"PYTHONPATH": f"{OPERATOR_SOURCE / 'operator'}:{OPERATOR_SOURCE / 'trainer'}"}


def _delete_namespaces(core: client.CoreV1Api, namespaces: list[str]) -> None:
    """Delete them and wait until they are gone: the namespace controller deletes their
    thousands of objects through the same API server, which the next run would measure too
    (a run begun while the last one's were going measured its loops 1.5x slower)."""
    for namespace in namespaces:
        core.delete_namespace(namespace)
    started, deadline = time.monotonic(), time.monotonic() + 600
    while time.monotonic() < deadline:
        left = {item.metadata.name for item in core.list_namespace().items} & set(namespaces)
        if not left:
            print(f"         (its namespaces took {time.monotonic() - started:.0f}s to go)", flush=True)
            return
        time.sleep(2.0)
    print(f"         (its namespaces were still going after 600 s: {sorted(left)})", flush=True)


def run_reactive_twice(kubeconfig: str, count: int) -> dict[str, Any]:
    """The reactive floor twice, one run after the other, as run_real runs the reactive floor and
    the operator (``--reactive-twice``): two identical controllers, so the ratio of their
    create->child p99s is what this host alone does to the p99 goal (the second's p99 within
    1.5x of the first's). No operator runs."""
    api, core = client.CustomObjectsApi(), client.CoreV1Api()
    stamp = f"{int(time.time()) % 100000}"
    namespaces = [f"react{i}-{count}-{stamp}" for i in (1, 2)]
    for namespace in namespaces:
        core.create_namespace({"metadata": {"name": namespace}})
    names = [f"scale-{i:04d}" for i in range(count)]
    servers = _control_plane_pids()
    runs = [reactive_floor(kubeconfig, api, namespace, names, servers) for namespace in namespaces]
    _delete_namespaces(core, namespaces)
    figures = [latency_figures(latencies) for _, _, latencies, _ in runs]
    return {
        "count": count,
        "arrival_rate": ARRIVAL_RATE,
        "reactive_twice": [
            {"seconds": seconds, "submitted_s": submitted, "unseen": count - len(latencies),
             "cpu_seconds": cpu, **figure}
            for (seconds, submitted, latencies, cpu), figure in zip(runs, figures, strict=True)
        ],
    }  # fmt: skip


def _print_reactive_twice(r: dict[str, Any]) -> None:
    first, second = r["reactive_twice"]
    ratio = (
        f"{second['p99_ms'] / first['p99_ms']:.2f}x"
        if first["p99_ms"] and second["p99_ms"] is not None
        else "n/a"
    )
    print(f"N={r['count']:5d}  the reactive floor twice: create->child p50 {_ms(first['p50_ms'])} / "
          f"{_ms(second['p50_ms'])}  p99 {_ms(first['p99_ms'])} / {_ms(second['p99_ms'])}  second/first p99 "
          f"{ratio}  ({first['unseen']} / {second['unseen']} unseen)", flush=True)  # fmt: skip


def run_real(
    kubeconfig: str, count: int, quiet_seconds: float, operator_first: bool = False
) -> dict[str, Any]:
    """One run at ``count``: the limit, the floor, then the reactive floor and the operator
    (``operator_first``: the operator before the reactive floor), each in namespaces of its own,
    deleted at the end."""
    api = client.CustomObjectsApi()
    core = client.CoreV1Api()
    stamp = f"{int(time.time()) % 100000}"
    limit_ns, floor_ns, reactive_ns, operator_ns = (
        f"{kind}-{count}-{stamp}" for kind in ("limit", "floor", "react", "scale")
    )
    for namespace in (limit_ns, floor_ns, reactive_ns, operator_ns):
        core.create_namespace({"metadata": {"name": namespace}})
    names = [f"scale-{i:04d}" for i in range(count)]

    def job_for(name: str, namespace: str) -> dict[str, Any]:
        job = render_pytorchjob(parse(_training(name, namespace)))
        job["metadata"].pop("ownerReferences", None)  # no GpuTraining owns these
        return job

    # 1. The limit: the same PyTorchJobs, by a plain loop (watched, as the operator's are).
    watchers = [FirstSeen(api, "kubeflow.org", "v1", "pytorchjobs", limit_ns)]
    jobs = [job_for(name, limit_ns) for name in names]

    def one_write(job: dict[str, Any]) -> None:
        api.create_namespaced_custom_object("kubeflow.org", "v1", limit_ns, "pytorchjobs", job)

    limit = _watched(watchers, lambda: _create_all(one_write, jobs))

    # 2. The floor: every write the operator's path makes, by the same plain loop: the user's
    #    GpuTraining, its PyTorchJob, the Created status, the Event. No operator can beat it.
    def four_writes(name: str) -> None:
        training = api.create_namespaced_custom_object(
            "gpuop.io", "v1alpha1", floor_ns, "gputrainings", _training(name, floor_ns)
        )
        job, status, event = operator_writes(training)
        api.create_namespaced_custom_object("kubeflow.org", "v1", floor_ns, "pytorchjobs", job)
        api.patch_namespaced_custom_object_status("gpuop.io", "v1alpha1", floor_ns, "gputrainings",
                                                  name, status)  # fmt: skip
        core.create_namespaced_event(floor_ns, event)

    watchers = [FirstSeen(api, "gpuop.io", "v1alpha1", "gputrainings", floor_ns),
                FirstSeen(api, "kubeflow.org", "v1", "pytorchjobs", floor_ns)]  # fmt: skip
    servers = _control_plane_pids()
    floor_measured = servers | {"bench": os.getpid()}  # the bench: the loop and its watches
    floor_cpu = _cpu_seconds_of(floor_measured)
    floor = _watched(watchers, lambda: _create_all(four_writes, names))
    floor_cpu = _cpu_seconds_since(floor_cpu, floor_measured)
    # The floor's own create->child: the goal for the operator's is within 1.5x of it.
    floor_latencies = _latencies(watchers[0], watchers[1], names)

    # 2b. The reactive floor and 3. the operator, in the order asked: the reactive floor's
    #     controller makes the same writes with the trainings arriving as they do for the
    #     operator (the serial floor's job is made by the thread that made its training, so its
    #     create->child is one request, which no controller can match). Whichever runs second
    #     meets an etcd holding the first one's trainings and jobs too; --rounds
    #     alternates the order so neither always pays that.
    def reactive() -> tuple[float, float, list[float], dict[str, float]]:
        return reactive_floor(kubeconfig, api, reactive_ns, names, servers)

    def operator() -> dict[str, Any]:
        return operator_run(kubeconfig, api, operator_ns, names, servers, quiet_seconds)

    if operator_first:
        ran = operator()
        reactive_s, reactive_submitted, reactive_latencies, reactive_cpu = reactive()
    else:
        reactive_s, reactive_submitted, reactive_latencies, reactive_cpu = reactive()
        ran = operator()
    _delete_namespaces(core, [limit_ns, floor_ns, reactive_ns, operator_ns])
    floor_figures = latency_figures(floor_latencies)
    reactive_figures = latency_figures(reactive_latencies)
    return {
        "count": count,
        "arrival_rate": ARRIVAL_RATE,
        "order": operator_goals.OPERATOR_FIRST if operator_first else operator_goals.REACTIVE_FIRST,
        "limit_s": limit,
        "floor_s": floor,
        **ran,
        "floor_p50_ms": floor_figures["p50_ms"],
        "floor_p99_ms": floor_figures["p99_ms"],
        "reactive_s": reactive_s,
        "reactive_submitted_s": reactive_submitted,
        "reactive_p50_ms": reactive_figures["p50_ms"],
        "reactive_p99_ms": reactive_figures["p99_ms"],
        "reactive_unseen": count - len(reactive_latencies),
        "floor_cpu_seconds": floor_cpu,
        "reactive_cpu_seconds": reactive_cpu,
    }


def operator_run(
    kubeconfig: str,
    api: client.CustomObjectsApi,
    namespace: str,
    names: list[str],
    servers: dict[str, int],
    quiet_seconds: float,
) -> dict[str, Any]:
    """``gpuop operator`` started here on ``namespace``, the same loop creating the GpuTrainings,
    the same two watches as the reactive floor: its figures, as run_real reports them."""
    count = len(names)
    trainings, children = _watches(api, namespace)
    metrics_port = _free_port()
    with tempfile.TemporaryFile() as log:
        operator = subprocess.Popen(
            [GPUOP, "operator", "--standalone", "--namespace", namespace,
             "--metrics-port", str(metrics_port), "--health-port", "0", "--max-workers", str(CONCURRENCY)],
            env={**os.environ, "KUBECONFIG": kubeconfig, **_operator_source_env()},
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # up: its metrics answer and its watches have listed
                try:
                    _operator_counters(metrics_port)
                    break
                except OSError:
                    time.sleep(0.2)
            time.sleep(2.0)
            measured = servers | {"operator": operator.pid, "bench": os.getpid()}
            cpu_before = _cpu_seconds_of(measured)
            collections_before = _operator_collections(metrics_port)
            started = time.monotonic()
            submitted = _create_trainings(api, namespace, names)
            deadline = time.monotonic() + 900
            _until_all_created((trainings, children), count, deadline,
                               lambda: _created_by_list(api, namespace))  # fmt: skip
            converged = max(trainings.created.values()) - started if trainings.created else float("nan")
            # Its Events are posted off the reconcile path, after the statuses: the work is done
            # when the operator's own counters have every write (3 a job), and not before.
            at_created = _operator_counters(metrics_port)
            while writes(at_created) < operator_goals.WRITES_PER_JOB * count and time.monotonic() < deadline:
                time.sleep(0.1)
                at_created = _operator_counters(metrics_port)
            written = time.monotonic() - started
            # CPU seconds each used from the first create until all were Created: on a machine
            # whose cores the API server and the operator share, the operator's are the API
            # server's loss.
            cpu = _cpu_seconds_since(cpu_before, measured)
            burst_reconciles = _operator_reconciles(metrics_port)
            collections = {
                generation: done - collections_before.get(generation, 0)
                for generation, done in sorted(_operator_collections(metrics_port).items())
            }
            time.sleep(quiet_seconds)
            after_quiet = _operator_counters(metrics_port)
            reconciles = _operator_reconciles(metrics_port)
            rss = _peak_rss_mb(operator.pid)
        finally:
            operator.terminate()
            operator.wait(30)
            for watcher in (trainings, children):
                watcher.stop()
            if operator.returncode not in (0, -15):
                log.seek(0)
                print(log.read().decode(errors="replace")[-3000:], file=sys.stderr)
    latencies = _latencies(trainings, children, names)
    return {
        "operator_s": converged,
        "operator_written_s": written,
        "created": len(trainings.created),
        "unseen": count - len(latencies),  # names whose child or training no watch saw
        **latency_figures(latencies),
        "submitted_s": submitted,
        "writes_total": writes(at_created),
        "writes_per_job": writes(at_created) / count,
        "writes": {k: round(v / count, 2) for k, v in sorted(at_created.items())},
        "idle_writes": writes(after_quiet) - writes(at_created),
        "burst_reconciles": {k: round(v / count, 2) for k, v in sorted(burst_reconciles.items())},
        "reconciles": {k: round(v / count, 2) for k, v in sorted(reconciles.items())},
        "peak_rss_mb": rss,
        "gc_collections": collections,
        "cpu_seconds": cpu,
    }


def _print_emulated(r: dict[str, Any]) -> None:
    print(
        f"N={r['count']:5d}  all Created in {r['converged_s']:6.2f}s "
        f"(submitted in {r['created_in_s']:.2f}s)  "
        f"create->child p50 {_ms(r['p50_ms'])} p99 {_ms(r['p99_ms'])}  "
        f"writes/job {r['writes_per_job']:.2f}  "
        f"quiet status patches {r['quiet_status_patches']}  "
        f"peak RSS {r['peak_rss_mb']:.0f} MB",
        flush=True,
    )
    print(f"         writes/job to Created: {r['writes']}", flush=True)
    print(f"         all requests/job: {r['requests_per_job']}", flush=True)


def _print_real(r: dict[str, Any]) -> None:
    arrival = "" if r["arrival_rate"] is None else f", paced at {r['arrival_rate']:g}/s"
    if r["arrival_rate"] is not None:
        print("         paced: the operator's time includes the arrival, so its ratios to the limit and "
              "the floor (unpaced loops) are not a cost; compare create->child with the reactive floor's",
              flush=True)  # fmt: skip
    print(
        f"N={r['count']:5d}  operator: all {r['created']} Created in {r['operator_s']:6.2f}s, "
        f"every write made (Events too) in {r['operator_written_s']:6.2f}s  "
        f"limit (plain loop, same jobs): {r['limit_s']:6.2f}s  "
        f"ratio {r['operator_written_s'] / r['limit_s']:.2f}x  "
        f"floor (plain loop, same 4 writes/job): {r['floor_s']:6.2f}s  "
        f"ratio {r['operator_written_s'] / r['floor_s']:.2f}x  "
        f"create->child p50 {_ms(r['p50_ms'])} p99 {_ms(r['p99_ms'])} "
        f"(floor's p99 {_ms(r['floor_p99_ms'])}; {r['unseen']} unseen)  "
        f"writes/job {r['writes_per_job']:.2f}  idle writes {r['idle_writes']}  "
        f"peak RSS {r['peak_rss_mb']:.0f} MB",
        flush=True,
    )
    print(
        f"         reactive floor (plain controller, same arrival{arrival}): all Created, every write made, "
        f"in {r['reactive_s']:6.2f}s "
        f"(trainings created in {r['reactive_submitted_s']:.2f}s)  operator/reactive "
        f"{r['operator_written_s'] / r['reactive_s']:.2f}x  create->child p50 {_ms(r['reactive_p50_ms'])} "
        f"p99 {_ms(r['reactive_p99_ms'])} ({r['reactive_unseen']} unseen)  (the operator's trainings created "
        f"in {r['submitted_s']:.2f}s)",
        flush=True,
    )
    if r["created"] < r["count"]:
        print(f"         only {r['created']} of {r['count']} reached Created within the deadline", flush=True)
    print(
        f"         requests/job by verb and code: {r['writes']}; reconciles/job by outcome until every "
        f"write was made: {r['burst_reconciles']}, the quiet included: {r['reconciles']}; the operator's "
        f"garbage collections by generation until every write was made: {r['gc_collections']}",
        flush=True,
    )
    print(
        f"         CPU seconds until every write was made: {r['cpu_seconds']}; in the floor's run: "
        f"{r['floor_cpu_seconds']}; in the reactive floor's: {r['reactive_cpu_seconds']}",
        flush=True,
    )


def _install_crds() -> None:
    extensions = client.ApiextensionsV1Api()
    for path in CRDS:
        try:
            extensions.create_custom_resource_definition(yaml.safe_load(path.read_text()))
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    time.sleep(2.0)  # Established


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("counts", nargs="*", type=int, default=[100, 500, 1000])
    parser.add_argument(
        "--kubeconfig", help="a real cluster (its CRDs are created first); default: the emulator"
    )
    parser.add_argument("--quiet-seconds", type=float, default=25.0, help="idle period checked for writes")
    parser.add_argument(
        "--operator-source",
        type=Path,
        help="run the operator from this checkout (git worktree add DIR REV): two versions side by side",
    )
    parser.add_argument(
        "--arrival-rate",
        type=_positive,
        help="GpuTrainings per second for the reactive floor and the operator alike (default: all at "
        "once): the same arrival for both, so their create->child p99 compare like for like",
    )
    parser.add_argument(
        "--reactive-twice",
        action="store_true",
        help="run the reactive floor twice and no operator: how far this host alone moves the p99 "
        "ratio between two identical controllers",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="real API server: runs per count, the reactive floor and the operator alternating which "
        "goes first (an even K puts each first equally often); issue 30's goals are judged on the "
        "median of the rounds (bench/operator_goals.py)",
    )
    parser.add_argument("--reactive-controller", metavar="NAMESPACE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arrival_rate is not None and not args.kubeconfig:
        parser.error("--arrival-rate: paces the real API server's runs; give --kubeconfig too")
    if args.reactive_twice and not args.kubeconfig:
        parser.error("--reactive-twice: runs against a real API server; give --kubeconfig too")
    if args.rounds < 1 or (args.rounds > 1 and (not args.kubeconfig or args.reactive_twice)):
        parser.error("--rounds: at least 1, and more only for the operator's runs on a real API server")
    if args.reactive_controller:  # the reactive floor's controller, started by run_real
        config.load_kube_config(config_file=args.kubeconfig)
        reactive_controller(args.reactive_controller, args.counts[0])
        return 0
    global OPERATOR_SOURCE, ARRIVAL_RATE
    OPERATOR_SOURCE = args.operator_source
    ARRIVAL_RATE = args.arrival_rate
    if args.kubeconfig:
        config.load_kube_config(config_file=args.kubeconfig)
        _install_crds()
    for count in args.counts:
        if args.reactive_twice:
            result = run_reactive_twice(args.kubeconfig, count)
            _print_reactive_twice(result)
        elif args.kubeconfig:
            rounds = []
            for index in range(args.rounds):
                operator_first = index % 2 == 1
                if args.rounds > 1:
                    first = "the operator" if operator_first else "the reactive floor"
                    print(f"         round {index + 1} of {args.rounds}, {first} first", flush=True)
                result = run_real(args.kubeconfig, count, args.quiet_seconds, operator_first=operator_first)
                _print_real(result)
                print(json.dumps(result), file=sys.stderr, flush=True)
                rounds.append(result)
            lines, verdict = operator_goals.judge(rounds)
            print(operator_goals.headline(count, len(rounds), verdict), flush=True)
            for line in lines:
                print(f"         {line}", flush=True)
            continue
        else:
            result = run_emulated(count, args.quiet_seconds)
            _print_emulated(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
