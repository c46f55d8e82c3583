"""What the operator costs at scale: N GpuTrainings created at once against the API emulator.

Runs the real ``gpuop operator`` process against tests/support's emulator (real HTTP), creates
N GpuTrainings as fast as the emulator takes them, and reports: the time until every one has
its PyTorchJob and status Created; p50/p99 latency from a GpuTraining's creation to its
PyTorchJob's (the emulator stamps both, no client-side timing); the operator's API requests
per job by verb; status patches during a quiet period afterwards (expected: none); and the
operator's peak RSS (VmHWM from /proc).

    .venv/bin/python bench/operator_scale.py 100 500 1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.apiserver import ApiServer  # noqa: E402
from support.cluster import JOBS, TRAININGS, cluster, training  # noqa: E402


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(count: int, quiet_seconds: float) -> dict[str, Any]:
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
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * _percentile(latencies, 0.99),
            "writes_per_job": sum(writes_at_created.values()) / count,
            "writes": {k: round(v / count, 2) for k, v in writes_at_created.items()},
            "requests_per_job": {k: round(v / count, 2) for k, v in sorted(requests.items())},
            "quiet_status_patches": quiet_patches,
            "peak_rss_mb": rss,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("counts", nargs="*", type=int, default=[100, 500, 1000])
    parser.add_argument("--quiet-seconds", type=float, default=12.0, help="idle period checked for patches")
    args = parser.parse_args()
    for count in args.counts:
        r = run(count, args.quiet_seconds)
        print(
            f"N={r['count']:5d}  all Created in {r['converged_s']:6.2f}s "
            f"(submitted in {r['created_in_s']:.2f}s)  "
            f"create->child p50 {r['p50_ms']:7.1f} ms p99 {r['p99_ms']:7.1f} ms  "
            f"writes/job {r['writes_per_job']:.2f}  "
            f"quiet status patches {r['quiet_status_patches']}  "
            f"peak RSS {r['peak_rss_mb']:.0f} MB",
            flush=True,
        )
        print(f"         writes/job to Created: {r['writes']}", flush=True)
        print(f"         all requests/job: {r['requests_per_job']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
