"""Stopping a local run for good: torchrun and every process below it.

torchrun starts each rank in a session of its own (torch's elastic subprocess handler), so a
signal to torchrun's process group never reaches the ranks. Killing that group alone leaves
the ranks running, orphaned, holding their GPU and their port (seen with `gpuop run`'s second
Ctrl-C, and in bench/first_step.py, whose next start was timed against the last one's rank).
So torchrun is stopped first (it starts no rank after that), its ranks are found in Linux's
/proc, and each one's group (the rank and its DataLoader workers) is killed. Where there is no
/proc, only torchrun's group is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has stopped running; its parent reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()
    return bool(fields) and fields[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, nearest first (none where /proc is absent)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop(0)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(child) for child in (task / "children").read_text().split()]
            except OSError:  # gone meanwhile
                continue
            found += children
            pending += children
    return found


def kill_tree(process: subprocess.Popen[Any], wait_seconds: float = 30.0) -> None:
    """SIGKILL ``process`` (torchrun, leading its own group) and every process below it, and
    wait up to ``wait_seconds`` until none runs. Nothing when ``process`` was already reaped:
    its pid may be another process's by now."""
    if process.poll() is not None:
        return
    below: list[int] = []
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGSTOP)
        below = descendants(process.pid)
        for pid in below:
            # A rank leads its own group: its workers go with it. One that leads no group, or
            # runs as another user (setuid), is passed over: what can be killed still is.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    finally:  # never left stopped
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + wait_seconds
    while any(alive(pid) for pid in below) and time.monotonic() < deadline:
        time.sleep(0.05)  # no longer our children's children once torchrun is gone: poll, not wait
