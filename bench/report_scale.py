"""What the progress-report endpoint costs at scale: N trainings reporting every 5 s.

Against a real API server (``--kubeconfig``; `make controlplane` starts one here), for each N:
the real ``gpuop operator`` with its report endpoint on (HTTPS with a CA and certificate from
tests/support/tls.py, the chart's scrape interval of 10 s), N GpuTrainings, each with its
PyTorchJob said Running (the bench writes the job's status, as the training-operator would)
and one Pod object labelled as the training's (nothing runs it: the pod exists so that the
TokenRequest API binds a token to it, as the kubelet does for a projected volume). A load
generator, a process of its own, stands in for the trainers: with each training's pod-bound
token it POSTs a trainerStatus report every 5 s, staggered, with a rising step and a falling
loss, one report per connection (as Kubeflow's clients send them).

After a warm-up (every token reviewed once, the first status writes done), over a measured
window it reports:

- status writes per training per minute (the operator's ``gpuop_status_patches_total``) and,
  from the API server's audit log, the fewest seconds between two writes of one training;
- the endpoint's latency as the client sees it (connect to answer, TLS handshake included),
  p50/p99, and the operator's own view (``gpuop_report_duration_seconds``, by bucket);
- refusals of any kind (an HTTP status other than 200, a connection closed unanswered, a
  timeout): at one report per 5 s per token there must be none;
- the operator's CPU (seconds per minute, /proc/PID/stat) and peak RSS, and the API server's
  and etcd's CPU beside it;
- whether the status of a sample of trainings says what its last report said, once the
  reports stop (at most a tick later).

Goals: at most one status write per training per 10 s (<= 6 a minute), endpoint p99 < 50 ms.

    make controlplane
    .venv/bin/python bench/report_scale.py --kubeconfig .controlplane/kubeconfig 100 1000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import resource
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, cast

from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

from gpuop.api.identity import GROUP, PLURAL, TRAINING_LABEL, VERSION, report_audience, report_path
from gpuop.controller.kube import Kube
from gpuop.controller.receiver import ClusterGate
from gpuop.observing.endpoint import Limits, ReportBook, ReportServer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import operator_scale as scale  # noqa: E402  (beside this file: its operator start and helpers)

from support.tls import serving_directory  # noqa: E402

TOTAL_STEPS: Final = 1_000_000
STEPS_PER_REPORT: Final = 25
CLIENT_TIMEOUT: Final = 15.0  # seconds a report may take before the client gives up
GPUOP: Final = str(Path(sys.executable).with_name("gpuop"))
WRITE_GAP: Final = 10.0  # the goal: one status write per training per scrape interval at most


# -- the load generator (a process of its own: its CPU is not the operator's) ----------------


def _report(step: int) -> bytes:
    """What a trainer sends at ``step``: Kubeflow's trainerStatus with HF-style metrics."""
    loss = 2.5 * 0.999**step + 0.05
    percent = 100 * step // TOTAL_STEPS
    return json.dumps({
        "trainerStatus": {
            "progressPercentage": percent,
            "estimatedRemainingSeconds": (TOTAL_STEPS - step) // 10,
            "lastUpdatedTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "metrics": [{"name": "loss", "value": f"{loss:.6f}"},
                        {"name": "current_step", "value": str(step)},
                        {"name": "total_steps", "value": str(TOTAL_STEPS)},
                        {"name": "current_epoch", "value": f"{step / 10_000:.2f}"},
                        {"name": "learning_rate", "value": "0.0001"}],
        }
    }).encode()  # fmt: skip


async def _post(port: int, context: ssl.SSLContext, request: bytes) -> tuple[str, float]:
    """One report on a fresh connection: the HTTP status, or why there was none, and the
    seconds the connection and its TLS handshake took."""
    writer: asyncio.StreamWriter | None = None
    began = connected = time.perf_counter()
    try:
        async with asyncio.timeout(CLIENT_TIMEOUT):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
            )
            connected = time.perf_counter()
            writer.write(request)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            await reader.readexactly(length)
    except TimeoutError:
        return "timeout", connected - began
    except asyncio.IncompleteReadError as exc:  # closed unanswered: over the connection bound
        return "closed" if not exc.partial else "truncated", connected - began
    except (OSError, ssl.SSLError) as exc:
        return f"error:{type(exc).__name__}", connected - began
    finally:
        if writer is not None:
            writer.close()
    parts = head.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 else "garbled", connected - began


async def _generate(spec: dict[str, Any]) -> list[list[list[Any]]]:
    """Every training's reports, each on its own 5 s schedule, staggered across the interval;
    a record per report: training, its number, when due (s from start), how late it left,
    connect-to-answer seconds, outcome, step, seconds of it to connect (TLS included); and
    how late the generator's own loop woke up, every 50 ms."""
    context = ssl.create_default_context(cafile=spec["ca"])
    port, interval, seconds = spec["port"], spec["interval"], spec["seconds"]
    loop = asyncio.get_running_loop()
    start = loop.time() + (spec["start_at"] - time.time())
    trainings = spec["trainings"]
    records: list[list[Any]] = []

    async def trainer(index: int, path: str, token: str) -> None:
        number, due = 0, start + interval * index / len(trainings)
        while due < start + seconds:
            await asyncio.sleep(max(0.0, due - loop.time()))
            late = loop.time() - due
            step = (number + 1) * STEPS_PER_REPORT
            body = _report(step)
            request = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body
            began = time.perf_counter()
            outcome, connecting = await _post(port, context, request)
            took = time.perf_counter() - began
            records.append([index, number, round(due - start, 3), round(late, 4), round(took, 5), outcome,
                            step, round(connecting, 5)])  # fmt: skip
            number += 1
            due += interval
            if due < loop.time():  # it took past its next slot: a synchronous client (HF's
                due = loop.time() + interval  # callback) sends again an interval after this one

    async def watch_the_loop() -> None:  # the instrument's health: how late its own wake-ups are
        while loop.time() < start + seconds:
            due = loop.time() + 0.05
            await asyncio.sleep(0.05)
            lags.append([round(due - start, 3), round(loop.time() - due, 4)])

    lags: list[list[float]] = []
    await asyncio.gather(
        watch_the_loop(), *(trainer(i, t["path"], t["token"]) for i, t in enumerate(trainings))
    )
    return [records, lags]


def generate(spec_file: Path) -> int:
    spec = json.loads(spec_file.read_text())
    records, lags = asyncio.run(_generate(spec))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    Path(spec["out"]).write_text(
        json.dumps({"records": records, "lags": lags, "cpu_s": usage.ru_utime + usage.ru_stime})
    )
    return 0


# -- measuring the operator and the control plane --------------------------------------------


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _endpoint_pids(operator: int) -> dict[str, int]:
    """The report endpoint's process, when the operator serves it from a child of its own
    (gpuop.controller.reportproc): its CPU and memory are the operator's too."""
    for task in Path(f"/proc/{operator}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"gpuop.controller.reportproc" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return {"endpoint": int(pid)}
    return {}


def _plane_pids(state: Path) -> dict[str, int]:
    """etcd's and kube-apiserver's pids: the processes whose command line names ``state``."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(state).encode() in arg for arg in argv[1:]):
            name = Path(argv[0].decode(errors="replace")).name
            if name in ("etcd", "kube-apiserver"):
                found[name] = int(entry.name)
    return found


class Snapshot:
    """The operator's counters and the processes' CPU at one moment."""

    def __init__(self, metrics_port: int, pids: dict[str, int]) -> None:
        self.at = time.monotonic()
        self.wall = datetime.now(UTC)
        self.cpu = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        self.machine = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        self.load = os.getloadavg()[0]
        self.status_patches = 0.0
        self.reports: dict[str, float] = {}
        self.buckets: dict[float, float] = {}  # le -> cumulative count, report handling time
        self.requests: dict[str, float] = {}  # "verb resource" -> count
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "gpuop_status_patches_total":
                    self.status_patches = sample.value
                elif sample.name == "gpuop_reports_total":
                    self.reports[sample.labels["outcome"]] = sample.value
                elif sample.name == "gpuop_report_duration_seconds_bucket":
                    self.buckets[float(sample.labels["le"])] = sample.value
                elif sample.name == "gpuop_api_requests_total":
                    key = f"{sample.labels['verb']} {sample.labels['resource']}"
                    self.requests[key] = self.requests.get(key, 0) + sample.value


def _busy(before: list[int], after: list[int]) -> float:
    """The share of the machine's CPU time that was not idle between two reads of /proc/stat."""
    spent = [b - a for a, b in zip(before, after, strict=True)]
    idle = spent[3] + spent[4]  # idle, iowait
    return 1 - idle / sum(spent[:8]) if sum(spent[:8]) else float("nan")


def _bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the histogram bucket holding the q-quantile of what was added."""
    added = sorted((le, after.get(le, 0) - before.get(le, 0)) for le in after)
    total = added[-1][1] if added else 0
    for le, count in added:
        if total and count >= q * total:
            return le
    return float("nan")


def _status_writes(audit_log: Path, offset: int, namespace: str, since: datetime) -> dict[str, list[float]]:
    """Per training, the times (s since ``since``) of its status patches the API server completed."""
    writes: dict[str, list[float]] = {}
    with audit_log.open("rb") as log:
        log.seek(offset)
        for line in log:
            if not line.endswith(b"\n") or b'"gputrainings"' not in line:
                continue
            event = json.loads(line)
            ref = event.get("objectRef") or {}
            if (event.get("verb") != "patch" or ref.get("subresource") != "status"
                    or ref.get("resource") != "gputrainings" or ref.get("namespace") != namespace
                    or event.get("stage") != "ResponseComplete"):  # fmt: skip
                continue
            at = datetime.fromisoformat(event["requestReceivedTimestamp"])
            if since <= at:
                writes.setdefault(ref["name"], []).append((at - since).total_seconds())
    return writes


# -- one run ----------------------------------------------------------------------------------


def _running(name: str) -> dict[str, Any]:
    """A PyTorchJob's status as the training-operator writes it once its pods run."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"status": {
        "conditions": [
            {"type": "Created", "status": "True", "reason": "PyTorchJobCreated",
             "message": f"PyTorchJob {name} is created.", "lastUpdateTime": now, "lastTransitionTime": now},
            {"type": "Running", "status": "True", "reason": "PyTorchJobRunning",
             "message": f"PyTorchJob {name} is running.", "lastUpdateTime": now, "lastTransitionTime": now},
        ],
        "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 1}},
        "startTime": now,
    }}  # fmt: skip


def _all_in(api: client.CustomObjectsApi, namespace: str, phase: str, count: int) -> bool:
    listed = cast(dict[str, Any], api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL))
    return sum(bool((o.get("status") or {}).get("phase") == phase) for o in listed["items"]) == count


def _wait(what: str, done: Any, seconds: float) -> float:
    started = time.monotonic()
    while not done():
        if time.monotonic() - started > seconds:
            raise TimeoutError(f"{what}: not within {seconds:.0f}s")
        time.sleep(1.0)
    return time.monotonic() - started


def run(kubeconfig: Path, count: int, args: argparse.Namespace) -> dict[str, Any]:
    api, core = client.CustomObjectsApi(), client.CoreV1Api()
    namespace = f"reports-{count}-{int(time.time()) % 100000}"
    core.create_namespace({"metadata": {"name": namespace}})
    names = [f"rep-{i:04d}" for i in range(count)]
    pool = ThreadPoolExecutor(scale.CONCURRENCY)
    setup: dict[str, float] = {}

    def pod(name: str) -> str:
        created = core.create_namespaced_pod(namespace, {
            "metadata": {"name": f"{name}-master-0", "labels": {TRAINING_LABEL: name}},
            "spec": {"automountServiceAccountToken": False,
                     "containers": [{"name": "trainer", "image": "trainer:never-run"}]},
        })  # fmt: skip
        assert created.metadata is not None
        return str(created.metadata.uid)

    def token(name: str, uid: str) -> str:
        request = {"spec": {"audiences": [report_audience(namespace, name)], "expirationSeconds": 3600,
                            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": f"{name}-master-0",
                                               "uid": uid}}}  # fmt: skip
        made = core.create_namespaced_service_account_token("default", namespace, request)
        assert made.status is not None
        return str(made.status.token)

    def training(name: str) -> None:
        body = scale._training(name, namespace)
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def job_running(name: str) -> None:  # as the training-operator says once the pods run
        api.patch_namespaced_custom_object_status(
            "kubeflow.org", "v1", namespace, "pytorchjobs", name, _running(name)
        )

    def has_account() -> bool:
        try:
            core.read_namespaced_service_account("default", namespace)
            return True
        except client.ApiException:
            return False

    _wait("the namespace's default ServiceAccount", has_account, 60)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as log:
        tls_dir = serving_directory(Path(tmp) / "tls")
        metrics_port, report_port = scale._free_port(), scale._free_port()
        operator = subprocess.Popen(
            [GPUOP, "operator", "--standalone", "--namespace", namespace,
             "--metrics-port", str(metrics_port), "--health-port", "0",
             "--max-workers", str(scale.CONCURRENCY), "--scrape-interval", str(args.scrape_interval),
             "--report-url", f"https://127.0.0.1:{report_port}", "--report-port", str(report_port),
             "--report-tls-dir", str(tls_dir)],
            env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_pinned(args.operator_cpus),
        )  # fmt: skip
        generator: subprocess.Popen[bytes] | None = None
        try:
            _wait("the operator's /metrics", lambda: _answers(metrics_port), 60)
            time.sleep(2.0)  # its watches have listed
            started = time.monotonic()
            uids = dict(zip(names, pool.map(pod, names), strict=True))
            setup["pods_s"] = time.monotonic() - started
            started = time.monotonic()
            list(pool.map(training, names))
            _wait("every GpuTraining Created", lambda: _all_in(api, namespace, "Created", count), 900)
            setup["created_s"] = time.monotonic() - started
            started = time.monotonic()
            list(pool.map(job_running, names))
            _wait("every GpuTraining Running", lambda: _all_in(api, namespace, "Running", count), 900)
            setup["running_s"] = time.monotonic() - started
            started = time.monotonic()
            tokens = list(pool.map(lambda name: token(name, uids[name]), names))
            setup["tokens_s"] = time.monotonic() - started

            # The trainers, from their own process.
            pids = {
                "operator": operator.pid,
                **_endpoint_pids(operator.pid),
                **_plane_pids(kubeconfig.parent),
            }
            trainings = [
                {"path": report_path(namespace, name), "token": tok}
                for name, tok in zip(names, tokens, strict=True)
            ]
            audit_log = args.audit_log or kubeconfig.parent / "audit.log"
            generator, start_at, result_file = _start_generator(
                Path(tmp) / "operator", report_port, tls_dir, trainings, args, args.warmup + args.window
            )
            time.sleep(max(0.0, start_at + args.warmup - time.time()))
            audit_offset = audit_log.stat().st_size if audit_log.is_file() else 0
            before = Snapshot(metrics_port, pids)
            time.sleep(max(0.0, start_at + args.warmup + args.window - time.time()))
            after = Snapshot(metrics_port, pids)
            sample = random.Random(count).sample(names, min(args.sample, count))
            rss = {
                name: scale._peak_rss_mb(pid)
                for name, pid in pids.items()
                if name in ("operator", "endpoint")
            }
            if generator.wait(120) != 0:
                raise RuntimeError(f"the load generator failed ({generator.returncode})")
            generated = json.loads(result_file.read_text())

            # Once the reports stop, status must say what each training's last report said.
            answered: dict[str, list[tuple[int, float]]] = {}  # name -> [(step, answered at)]
            for index, _, due, late, latency, outcome, step, _ in generated["records"]:
                if outcome == "200":
                    answered.setdefault(names[index], []).append((step, due + late + latency))
            last = {name: max(answered.get(name, [(0, 0.0)]))[0] for name in sample}
            caught_up = _caught_up(api, namespace, last, seconds=3 * args.scrape_interval + 30)
            time.sleep(2.0)  # the audit log is written in batches, a second apart
            writes = (  # from the window's start on, the last ticks' after the reports stopped too
                _status_writes(audit_log, audit_offset, namespace, before.wall)
                if audit_log.is_file() else None
            )  # fmt: skip
        finally:
            if generator is not None and generator.poll() is None:
                generator.kill()
                generator.wait()
            operator.terminate()
            operator.wait(30)
            pool.shutdown()
            if operator.returncode not in (0, -15):
                log.seek(0)
                print(log.read().decode(errors="replace")[-3000:], file=sys.stderr)
        result = _summary(count, args, setup, before, after, rss, generated, caught_up, writes)
        if writes is not None:
            result["report_to_status_s"] = _delays(writes, answered, start_at - before.wall.timestamp(), args)
        if args.floors:  # the same reports to the endpoint alone, in a process of its own
            env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
            for gate in ("accept", "review"):
                result[f"floor_{gate}"] = _floor(Path(tmp) / gate, gate, tls_dir, trainings, args, env)
    core.delete_namespace(namespace)
    _wait(f"namespace {namespace} removed", lambda: not _exists(core, namespace), 600)  # not beside the next
    return result


def _exists(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.read_namespace(namespace)
        return True
    except client.ApiException as exc:
        if exc.status == 404:
            return False
        raise


def _cpus(text: str | None) -> set[int] | None:
    return {int(cpu) for cpu in text.split(",")} if text else None


# Every CPU this process may use, read before --bench-cpus narrows it: what a process started
# with no --operator-cpus gets, rather than the bench's own CPUs (children inherit them).
_ALL_CPUS: Final = frozenset(os.sched_getaffinity(0))


def _pinned(cpus: set[int] | None) -> Any:
    """A ``preexec_fn`` that keeps a process (and what it starts: the operator's endpoint child)
    on ``cpus``, or on every CPU when None."""
    return lambda: os.sched_setaffinity(0, cpus if cpus is not None else _ALL_CPUS)


def _start_generator(
    workdir: Path,
    port: int,
    tls_dir: Path,
    trainings: list[dict[str, str]],
    args: argparse.Namespace,
    seconds: float,
) -> tuple[subprocess.Popen[bytes], float, Path]:
    """The trainers' process, started; its reports begin at the returned wall time."""
    workdir.mkdir(parents=True, exist_ok=True)
    start_at = time.time() + 10.0  # the generator's imports
    result_file, spec_file = workdir / "generated.json", workdir / "generator.json"
    spec_file.write_text(json.dumps({
        "port": port, "ca": str(tls_dir / "ca.crt"), "interval": args.interval, "seconds": seconds,
        "start_at": start_at, "out": str(result_file), "trainings": trainings,
    }))  # fmt: skip
    generator = subprocess.Popen(
        [sys.executable, __file__, "--generate", str(spec_file)], preexec_fn=_pinned(args.bench_cpus)
    )
    if args.generator_nice:  # the instrument: its own waits for a CPU are not the endpoint's
        os.setpriority(os.PRIO_PROCESS, generator.pid, args.generator_nice)
    return generator, start_at, result_file


def _delays(
    writes: dict[str, list[float]],
    answered: dict[str, list[tuple[int, float]]],
    offset: float,
    args: argparse.Namespace,
) -> dict[str, float]:
    """How long a report waits to reach status: from its answer to the next status write of its
    training (which shows it, or a newer one), over the reports answered in the window. Times
    in ``writes`` are from the window's start, in ``answered`` from the reports' start, which
    is ``offset`` seconds earlier."""
    delays = []
    for name, reports in answered.items():
        times = writes.get(name, [])
        for _, at in reports:
            since_window = at - offset
            if 0 <= since_window < args.window:
                later = [t for t in times if t >= since_window]
                delays.append(min(later) - since_window if later else float("inf"))
    if not delays:
        return {}
    return {
        "median": round(statistics.median(delays), 1),
        "p99": round(scale._percentile(delays, 0.99), 1),
        "max": round(max(delays), 1),
    }


class _AcceptAll:
    """A gate that asks nobody: what the endpoint costs without its reviews."""

    limits = Limits()

    def authenticate(self, key: tuple[str, str], token: str) -> str:
        return "pod"

    def close(self) -> None:
        pass


def serve(spec_file: Path) -> int:
    """The endpoint alone (the operator's ReportServer, no reconciler) until stdin closes; the
    time each report took to handle, written at the end."""
    spec = json.loads(spec_file.read_text())
    handled: list[tuple[float, float]] = []
    gate = ClusterGate(Kube.login(), Limits()) if spec["gate"] == "review" else _AcceptAll()
    server = ReportServer(
        gate, ReportBook(), lambda _outcome, seconds: handled.append((time.time(), seconds)),
        port=spec["port"], tls_dir=Path(spec["tls_dir"]), host="127.0.0.1",
    )  # fmt: skip
    server.start()
    print("ready", flush=True)
    sys.stdin.read()
    server.close()
    Path(spec["out"]).write_text(json.dumps(handled))
    return 0


def _floor(
    workdir: Path,
    gate: str,
    tls_dir: Path,
    trainings: list[dict[str, str]],
    args: argparse.Namespace,
    env: dict[str, str],
) -> dict[str, Any]:
    """The same trainers' reports to the endpoint alone: what the machine and the endpoint's own
    code cost, without the operator's other work beside it."""
    workdir.mkdir(parents=True, exist_ok=True)
    port, handled_file, spec_file = scale._free_port(), workdir / "handled.json", workdir / "serve.json"
    spec_file.write_text(json.dumps({"port": port, "tls_dir": str(tls_dir), "gate": gate,
                                     "out": str(handled_file)}))  # fmt: skip
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(spec_file)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env=env, preexec_fn=_pinned(args.operator_cpus),
    )  # fmt: skip
    try:
        assert server.stdout is not None
        assert server.stdin is not None
        if server.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the {gate} endpoint did not start")
        generator, start_at, result_file = _start_generator(
            workdir, port, tls_dir, trainings, args, args.floor_warmup + args.floor_window
        )
        time.sleep(max(0.0, start_at + args.floor_warmup - time.time()))
        cpu_before, at_before = _cpu_seconds(server.pid), time.monotonic()
        time.sleep(max(0.0, start_at + args.floor_warmup + args.floor_window - time.time()))
        cpu = (_cpu_seconds(server.pid) - cpu_before) / ((time.monotonic() - at_before) / 60)
        if generator.wait(120) != 0:
            raise RuntimeError(f"the load generator failed ({generator.returncode})")
        server.stdin.close()
        server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    window = (args.floor_warmup, args.floor_warmup + args.floor_window)
    out = _latencies(json.loads(result_file.read_text()), *window)
    handled = [s * 1000 for at, s in json.loads(handled_file.read_text())
               if window[0] <= at - start_at < window[1]]  # fmt: skip
    out.update({
        "handled_p50_ms": statistics.median(handled) if handled else float("nan"),
        "handled_p99_ms": scale._percentile(handled, 0.99) if handled else float("nan"),
        "cpu_s_per_min": round(cpu, 1),
    })  # fmt: skip
    return out


def _latencies(generated: dict[str, Any], since: float, until: float) -> dict[str, Any]:
    """The client's view of the reports due in [since, until)."""
    window = [r for r in generated["records"] if since <= r[2] < until]
    lags = [lag * 1000 for at, lag in generated["lags"] if since <= at < until]
    answered = [r for r in window if r[5] == "200"]
    latencies = [r[4] * 1000 for r in answered]
    connecting = [r[7] * 1000 for r in answered]
    refused: dict[str, int] = {}
    for r in window:
        if r[5] != "200":
            refused[r[5]] = refused.get(r[5], 0) + 1
    nan = float("nan")
    return {
        "reports": len(window),
        "p50_ms": statistics.median(latencies) if latencies else nan,
        "p99_ms": scale._percentile(latencies, 0.99) if latencies else nan,
        "max_ms": max(latencies, default=nan),
        "connect_p50_ms": statistics.median(connecting) if connecting else nan,
        "connect_p99_ms": scale._percentile(connecting, 0.99) if connecting else nan,
        "late_p99_ms": 1000 * scale._percentile([r[3] for r in window], 0.99) if window else nan,
        "loop_lag_p99_ms": scale._percentile(lags, 0.99) if lags else nan,
        "loop_lag_max_ms": max(lags, default=nan),
        "refused": refused,
    }


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2):
            return True
    except OSError:
        return False


def _caught_up(api: client.CustomObjectsApi, namespace: str, wanted: dict[str, int], seconds: float
               ) -> dict[str, float | None]:  # fmt: skip
    """Per sampled training, seconds until its status.progress.step said the last step it
    reported (None: not within ``seconds``)."""
    started = time.monotonic()
    found: dict[str, float | None] = dict.fromkeys(wanted)
    while time.monotonic() - started < seconds and any(v is None for v in found.values()):
        for name, step in wanted.items():
            if found[name] is None:
                got = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
                body = cast(dict[str, Any], got)
                progress = (body.get("status") or {}).get("progress") or {}
                if progress.get("step") == step and progress.get("totalSteps") == TOTAL_STEPS:
                    found[name] = time.monotonic() - started
        time.sleep(0.5)
    return found


def _summary(
    count: int,
    args: argparse.Namespace,
    setup: dict[str, float],
    before: Snapshot,
    after: Snapshot,
    rss: dict[str, float],
    generated: dict[str, Any],
    caught_up: dict[str, float | None],
    writes: dict[str, list[float]] | None,
) -> dict[str, Any]:
    minutes = (after.at - before.at) / 60
    patches = after.status_patches - before.status_patches
    client_view = _latencies(generated, args.warmup, args.warmup + args.window)
    out: dict[str, Any] = {
        "count": count,
        "window_s": round(after.at - before.at, 1),
        "setup_s": {k: round(v, 1) for k, v in setup.items()},
        **client_view,
        "reports_per_s": round(client_view["reports"] / (minutes * 60), 1),
        "server_p50_le_ms": 1000 * _bucket_quantile(before.buckets, after.buckets, 0.5),
        "server_p99_le_ms": 1000 * _bucket_quantile(before.buckets, after.buckets, 0.99),
        "operator_outcomes": _added(before.reports, after.reports, 1.0),
        "status_writes": patches,
        "writes_per_training_min": patches / count / minutes,
        "operator_requests_per_s": _added(before.requests, after.requests, minutes * 60),
        "cpu_s_per_min": {k: round((after.cpu[k] - before.cpu[k]) / minutes, 1) for k in after.cpu},
        "machine_busy": round(_busy(before.machine, after.machine), 2),
        "load_1m": round(after.load, 1),
        "generator_cpu_s": round(generated["cpu_s"], 1),
        "peak_rss_mb": {name: round(mb) for name, mb in rss.items()},
        "caught_up": f"{sum(v is not None for v in caught_up.values())}/{len(caught_up)}",
        "caught_up_max_s": max((v for v in caught_up.values() if v is not None), default=float("nan")),
    }
    if writes is not None:
        writes = {name: [t for t in times if t < after.at - before.at] for name, times in writes.items()}
        gaps = [b - a for times in writes.values() for a, b in itertools.pairwise(times)]
        per_training = [len(times) / minutes for times in writes.values()]
        out.update({
            "audited_writes": sum(len(t) for t in writes.values()),
            "max_writes_per_training_min": max(per_training, default=0.0),
            "min_gap_s": min(gaps, default=float("nan")),
            "median_gap_s": statistics.median(gaps) if gaps else float("nan"),
            "gaps_under_10s": sum(g < WRITE_GAP for g in gaps),
            "gaps": len(gaps),
        })  # fmt: skip
    return out


def _added(before: dict[str, float], after: dict[str, float], per: float) -> dict[str, float]:
    """What each counter gained, divided by ``per``; counters that did not move left out."""
    gained = {k: v - before.get(k, 0) for k, v in sorted(after.items())}
    return {k: round(v / per, 2) for k, v in gained.items() if v}


def _print(r: dict[str, Any]) -> None:
    nan = float("nan")
    done, sampled = r["caught_up"].split("/")
    verdicts = {
        "<= 6 status writes per training a minute": r["writes_per_training_min"] <= 60 / WRITE_GAP,
        "no two writes of a training under 10 s apart": r.get("gaps_under_10s", 0) == 0,
        "p99 < 50 ms": r["p99_ms"] < 50,
        "no refusals": not r["refused"],
        "status says the last report": done == sampled,
    }
    gaps = (
        f"min {r.get('min_gap_s', nan):.2f}s median {r.get('median_gap_s', nan):.1f}s, "
        f"{r.get('gaps_under_10s', '?')}/{r.get('gaps', '?')} under 10s"
    )
    lines = [
        f"N={r['count']:5d}  {r['reports']} reports in {r['window_s']:.0f}s ({r['reports_per_s']}/s)  "
        f"status writes/training/min {r['writes_per_training_min']:.2f} "
        f"(max {r.get('max_writes_per_training_min', nan):.2f}; between two: {gaps}; "
        f"a report's wait for a status write: {r.get('report_to_status_s')})",
        f"operator: {_latency_line(r)}  (its histogram: p50 <= {r['server_p50_le_ms']:g} ms, "
        f"p99 <= {r['server_p99_le_ms']:g} ms)  CPU s/min {r['cpu_s_per_min']}  "
        f"peak RSS MB {r['peak_rss_mb']}",
        f"the machine: {100 * r['machine_busy']:.0f}% busy in the window, load {r['load_1m']} at its end",
    ]
    for gate in ("accept", "review"):
        if f"floor_{gate}" in r:
            f = r[f"floor_{gate}"]
            handled = f"handled p50 {f['handled_p50_ms']:.1f} ms p99 {f['handled_p99_ms']:.1f} ms"
            lines.append(
                f"endpoint alone, {gate}: {_latency_line(f)}  ({handled})  CPU s/min {f['cpu_s_per_min']}"
            )
    lines.append(
        f"status caught up with the last report: {r['caught_up']} (within {r['caught_up_max_s']:.1f}s)  "
        f"operator requests/s: {r['operator_requests_per_s']}"
    )
    lines.append(
        "goals: " + ";  ".join(f"{goal}: {'PASS' if ok else 'FAIL'}" for goal, ok in verdicts.items())
    )
    print("\n         ".join(lines), flush=True)


def _latency_line(r: dict[str, Any]) -> str:
    refused = sum(r["refused"].values())
    return (
        f"p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms max {r['max_ms']:.0f} ms "
        f"(connect+TLS p50 {r['connect_p50_ms']:.1f} p99 {r['connect_p99_ms']:.1f}; "
        f"generator's loop lag p99 {r['loop_lag_p99_ms']:.0f} ms)  refused {refused} {r['refused'] or ''}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("counts", nargs="*", type=int, default=[100, 1000])
    parser.add_argument("--kubeconfig", type=Path, default=ROOT / ".controlplane" / "kubeconfig")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of reports before the window")
    parser.add_argument("--window", type=float, default=180.0, help="seconds measured")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between a trainer's reports")
    parser.add_argument("--scrape-interval", type=float, default=10.0, help="the operator's tick")
    parser.add_argument("--sample", type=int, default=20, help="trainings whose status is checked at the end")
    parser.add_argument(
        "--generator-nice", type=int, default=-10, help="the load generator's niceness (root only; 0: as is)"
    )
    parser.add_argument("--audit-log", type=Path, help="the API server's (default: beside the kubeconfig)")
    parser.add_argument(
        "--no-floors", dest="floors", action="store_false", help="skip the endpoint-alone runs after each N"
    )
    parser.add_argument("--floor-warmup", type=float, default=20.0, help="seconds before a floor's window")
    parser.add_argument("--floor-window", type=float, default=120.0, help="seconds a floor is measured")
    parser.add_argument(
        "--operator-cpus",
        type=_cpus,
        help="CPUs the operator (and its endpoint child) is kept on, as 1 or 2,3: "
        "a cluster's operator pod has its node's CPUs, not the API server's or the trainers'",
    )
    parser.add_argument(
        "--bench-cpus",
        type=_cpus,
        help="CPUs the bench and its load generator are kept on (the control plane's "
        "processes are set outside, e.g. taskset -a -p -c 0 PID for each)",
    )
    parser.add_argument("--generate", type=Path, help=argparse.SUPPRESS)  # the load generator's process
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # an endpoint alone, for a floor
    args = parser.parse_args()
    if args.generate:
        return generate(args.generate)
    if args.serve:
        return serve(args.serve)
    kubeconfig = args.kubeconfig.resolve()
    if args.bench_cpus is not None:
        os.sched_setaffinity(0, args.bench_cpus)
    config.load_kube_config(config_file=str(kubeconfig))
    scale._install_crds()
    for count in args.counts:
        result = run(kubeconfig, count, args)
        _print(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
