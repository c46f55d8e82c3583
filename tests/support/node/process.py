"""The processes of a node: started to die with the process that started them, stopped in order,
and found again by what they were told (their command line names the node's work directory).

A node's containerd-shim-runc-v2 processes are not its children: a shim double-forks so that
containers outlive a containerd restart, and is re-parented to init. What :func:`processes_naming`
finds is the way back to them: every shim's command line carries its containerd's socket, which
lies in that node's work directory, so the node kills its own shims and nobody else's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from support.plane.controlplane import Component


def _die_with_parent() -> None:
    """Run in the child before exec: SIGKILL it when the process that started it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Supervised(Component):
    """A started daemon and its log (the control plane's :class:`Component`, watched)."""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def spawn(name: str, command: list[str], log: Path, env: Mapping[str, str] | None = None) -> Supervised:
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent, cwd=log.parent, env=dict(env) if env is not None else None,
        )  # fmt: skip
    return Supervised(name, process, log)


def wait_until(ready: Callable[[], bool], timeout: float, what: str, process: Supervised | None = None,
               interval: float = 0.2) -> None:  # fmt: skip
    """Poll ``ready`` until it holds; RuntimeError (with the process's log tail) on timeout or
    when ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise RuntimeError(f"{process.name} exited with {process.process.returncode} while waiting "
                               f"for {what}:\n{process.log_tail(30)}")  # fmt: skip
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(interval)
    tail = f":\n{process.log_tail(30)}" if process is not None else ""
    raise RuntimeError(f"no {what} after {timeout:g}s{tail}")


def processes_naming(text: str) -> dict[int, str]:
    """Live processes whose command line contains ``text``: {pid: command line}."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command_line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = _stat(int(entry.name))
        if text in command_line and fields is not None and fields[0] != "Z":
            found[int(entry.name)] = command_line.strip()
    return found


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command's closing parenthesis (state, ppid...: the
    3rd field on), or None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """When a live process started, in clock ticks after boot (stat's 22nd field): with its pid,
    what tells it from a later process the kernel gave the same pid. None when it is gone or a
    zombie."""
    fields = _stat(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def kill_all(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM each, SIGKILL what is left after ``grace`` seconds, and wait until they are gone."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        if not any(_alive(pid) for pid in pids):
            return


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    if fields is None:
        return False
    if fields[0] == "Z":  # a child of ours that exited: reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True
