"""What one progress report costs the report endpoint itself: CPU per report and the client's
latency, with a gate that asks nobody (no API server), so only the endpoint's own work counts.

The endpoint (``gpuop.observing.endpoint.ReportServer`` with a certificate from
tests/support/tls.py) runs in a process of its own, as the operator runs it; a client process
sends N reports, C at a time, each on a fresh TLS connection as Kubeflow's clients send them.
The endpoint's CPU is its process's user + system time over the reports (its start-up
subtracted: measured with one report first). Rounds alternate between the source trees given,
so each tree meets the same machine:

    .venv/bin/python bench/endpoint_cpu.py --reports 2000 --rounds 5 . /tmp/old-checkout

Each tree is a checkout of this project (its ``operator/`` is put first on the path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATH = "/apis/gpuop.io/v1alpha1/namespaces/bench/gputrainings/t/status"


def serve(port: int, tls_dir: str) -> int:
    """The endpoint, in this process, until stdin closes; prints its CPU seconds then."""
    import gpuop
    from gpuop.observing.endpoint import Limits, ReportBook, ReportServer

    class AcceptAll:
        limits = Limits(reports_per_second=1e9, burst=10**9)

        def authenticate(self, key: tuple[str, str], token: str) -> str:
            return "pod"

        def close(self) -> None:
            pass

    server = ReportServer(AcceptAll(), ReportBook(), port=port, tls_dir=Path(tls_dir), host="127.0.0.1")
    server.start()
    print(f"ready {Path(gpuop.__file__).resolve()}", flush=True)
    sys.stdin.read()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime}), flush=True)
    server.close()
    return 0


async def _send(port: int, ca: str, reports: int, concurrency: int) -> list[float]:
    body = json.dumps({"trainerStatus": {
        "progressPercentage": 41, "lastUpdatedTime": "2026-11-24T00:00:00Z",
        "metrics": [{"name": "loss", "value": "0.69"}, {"name": "current_step", "value": "615"},
                    {"name": "total_steps", "value": "1500"}],
    }}).encode()  # fmt: skip
    request = (
        f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer t\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    context = ssl.create_default_context(cafile=ca)
    gate = asyncio.Semaphore(concurrency)
    took: list[float] = []

    async def one() -> None:
        async with gate:
            began = time.perf_counter()
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
            )
            writer.write(request)
            answer = await reader.read()
            writer.close()
            took.append(time.perf_counter() - began)
            if b" 200 " not in answer.split(b"\r\n", 1)[0]:
                raise RuntimeError(f"refused: {answer[:80]!r}")

    await asyncio.gather(*(one() for _ in range(reports)))
    return took


def _round(tree: Path, tls_dir: Path, reports: int, concurrency: int) -> tuple[float, list[float]]:
    """The endpoint's CPU seconds for ``reports`` (start-up and one warm-up report taken off)
    and the client's latencies, with ``tree``'s code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "operator"), str(tree / "trainer")])}

    def run(count: int) -> tuple[float, list[float]]:
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(port), str(tls_dir)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert server.stdin is not None
        assert server.stdout is not None
        ready, _, module = server.stdout.readline().strip().partition(" ")
        if ready != "ready" or not Path(module).is_relative_to(tree):
            raise RuntimeError(f"the endpoint did not start with {tree}'s code ({module or 'no answer'})")
        took = asyncio.run(_send(port, str(tls_dir / "ca.crt"), count, concurrency))
        server.stdin.close()
        cpu = float(json.loads(server.stdout.readline())["cpu_s"])
        server.wait(30)
        return cpu, took

    base, _ = run(1)
    cpu, took = run(reports + 1)
    return cpu - base, took


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "TLS_DIR"), help=argparse.SUPPRESS)
    parser.add_argument("trees", nargs="*", type=Path, default=[HERE.parent])
    args = parser.parse_args()
    if args.serve:
        return serve(int(args.serve[0]), args.serve[1])
    sys.path.insert(0, str(HERE.parent / "tests"))
    from support.tls import serving_directory

    with tempfile.TemporaryDirectory() as tmp:
        tls_dir = serving_directory(Path(tmp) / "tls")
        results: dict[Path, list[tuple[float, list[float]]]] = {tree: [] for tree in args.trees}
        for number in range(args.rounds):
            for tree in args.trees:
                cpu, took = _round(tree.resolve(), tls_dir, args.reports, args.concurrency)
                results[tree].append((cpu, took))
                print(
                    f"round {number + 1} {tree}: {cpu / args.reports * 1000:.3f} ms CPU a report", flush=True
                )
    print(
        f"\n{args.reports} reports, {args.concurrency} at a time, {args.rounds} rounds; medians over rounds:"
    )
    print("| tree | endpoint CPU per report | client p50 | client p99 |")
    print("| --- | --- | --- | --- |")
    for tree, rounds in results.items():
        per_report = statistics.median(cpu / args.reports * 1000 for cpu, _ in rounds)
        p50 = statistics.median(statistics.quantiles(took, n=100)[49] * 1000 for _, took in rounds)
        p99 = statistics.median(statistics.quantiles(took, n=100)[98] * 1000 for _, took in rounds)
        print(f"| {tree} | {per_report:.3f} ms | {p50:.1f} ms | {p99:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
