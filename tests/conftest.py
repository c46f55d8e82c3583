"""Suite-wide: the suites marked by their directory, and tests marked ``gpu`` run only where a
CUDA GPU is visible."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Final

import pytest

HERE = Path(__file__).resolve().parent
# The session's shared fixtures (the real control plane and its client; the real nodes), defined once.
pytest_plugins = ["support.fixtures", "support.node.fixtures"]
# Every test under tests/<directory>/ carries that suite's marker (`pytest -m e2e_local`).
DIRECTORY_MARKERS = {
    "controlplane": pytest.mark.controlplane,
    "e2e_local": pytest.mark.e2e_local,
    "node": pytest.mark.node,
}


def _no_gpu_reason() -> str | None:
    import torch  # only when GPU tests were collected: the operator's tests never need it

    if torch.cuda.is_available():
        return None
    return f"no CUDA GPU visible to torch {torch.__version__}; run `pytest -m gpu` on a GPU machine"


# The real-node suite runs first, on a cluster nobody else has touched: the operator it runs in a
# pod must be the only one reconciling, and the chart it installs must be the first. Each of its
# modules, and the end-to-end chain's, leaves the cluster as it found it (nodes, controllers and
# their webhooks, the chart).
FIRST_SUITES: Final = ("node",)


def _suite(item: pytest.Item) -> str:
    return Path(item.path).resolve().relative_to(HERE).parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _suite(item) not in FIRST_SUITES)  # stable: modules stay whole
    for item in items:
        suite = _suite(item)
        if suite in DIRECTORY_MARKERS:
            item.add_marker(DIRECTORY_MARKERS[suite])
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    reason = _no_gpu_reason() if gpu_tests else None
    if reason is not None:
        for item in gpu_tests:
            item.add_marker(pytest.mark.skip(reason=reason))


# -- nothing of one test runs into the next ---------------------------------------------------
# A thread or child process a test leaves running costs every later test CPU (a process-wide
# clock once charged a 0.155 s call 1.0009 s) and can act on their objects. Each one still
# alive when the session ends (every fixture torn down) fails the run, named with the test
# during which it appeared.

_appeared_in: dict[tuple[str, int], str] = {}  # ("thread"|"process", ident) -> test id


def _children() -> set[int]:
    """Live (not zombie) child processes of this one, from /proc."""
    me, found = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def _running() -> set[tuple[str, int]]:
    threads = {("thread", t.ident) for t in threading.enumerate() if t.ident is not None}
    return threads | {("process", pid) for pid in _children()}


# -- where the suite's time goes --------------------------------------------------------------
# Wall time per suite (tests/<directory>) and per module, setup and teardown included, so that a
# package fixture's minutes count where they are paid; printed at the end of every run, CI's too.
_seconds: dict[str, dict[str, float]] = {"suite": {}, "module": {}}
_tests_in: dict[str, int] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    before, started = _running(), time.monotonic()
    try:
        return (yield)
    finally:
        took, suite = time.monotonic() - started, _suite(item)
        module = str(Path(item.path).resolve().relative_to(HERE))
        for kind, name in (("suite", suite), ("module", module)):
            _seconds[kind][name] = _seconds[kind].get(name, 0.0) + took
        _tests_in[suite] = _tests_in.get(suite, 0) + 1
        for thing in _running() - before:
            _appeared_in.setdefault(thing, item.nodeid)


def _time_lines() -> list[str]:
    total = sum(_seconds["suite"].values()) or 1.0
    by_time = sorted(_seconds["suite"].items(), key=lambda pair: -pair[1])
    lines = [
        f"{name:<14}{_tests_in[name]:>6} tests {took:>8.0f} s {100 * took / total:>4.0f}%"
        for name, took in by_time
    ]
    slowest = sorted(_seconds["module"].items(), key=lambda pair: -pair[1])[:12]
    return [*lines, "the slowest modules:", *(f"  {took:>6.0f} s  {name}" for name, took in slowest)]


def _strays() -> list[str]:
    threads = {t.ident: t for t in threading.enumerate()}
    running = _running()
    deadline = time.monotonic() + 5  # what is stopping as the session ends gets a moment
    while running & _appeared_in.keys() and time.monotonic() < deadline:
        time.sleep(0.1)
        running = _running()
    out = []
    for kind, ident in sorted(running & _appeared_in.keys()):
        if kind == "thread":
            thread = threads.get(ident)
            name = f"thread {thread.name!r}{' (daemon)' if thread and thread.daemon else ''}"
        else:
            try:
                argv = Path(f"/proc/{ident}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            except OSError:
                continue
            name = f"process {ident} ({argv.strip()})"
        out.append(f"{name}, started in {_appeared_in[(kind, ident)]}")
    return out


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    strays = _strays()
    if strays:
        session.config.stash[_STRAYS] = strays
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


_STRAYS = pytest.StashKey[list[str]]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if len(_seconds["suite"]) > 1 or len(_seconds["module"]) > 3:
        terminalreporter.section("time by suite (setup and teardown included)")
        for line in _time_lines():
            terminalreporter.line(line)
    strays = config.stash.get(_STRAYS, [])
    if strays:
        terminalreporter.section("left running after the session (each a failure)", red=True)
        for line in strays:
            terminalreporter.line(line)
