"""`make test`'s lanes, run at once: each a command (a sub-``make``) with its own output log.

The suites that need the real nodes (root, two kubelets, the images), the trainer suite and the
suites that need neither (lint, types, the unit and control-plane tests) share nothing but the
machine, so they overlap: the run costs the longest lane, not the sum (which lane holds which
suite, and why, is the Makefile's). Cold, each lane builds what it needs first, and the builds
they share are built once (:mod:`support.buildcache` locks per entry): the unit tests run while
the nodes' builds run.

One suite needs the machine to itself: the chain's paced trainings (tests/e2e_local) miss their
stall timeouts and waits beside any other CPU-bound work (a false Stalled). It takes the machine's
turn (:func:`machine_turn`, exclusive); each lane named by ``--holds-turn`` holds that turn,
shared, from its start to its end, so the chain waits for those lanes to be over. The driver
takes their holds before it starts any lane: a chain cannot slip in first. Work that the chain
need not wait for can run beside it instead, with ``--low-priority LANE``
(:func:`low_priority_group`).

A lane named by ``--after LANE=EARLIER`` starts when EARLIER ends (whatever its verdict); by
``--after LANE=EARLIER:MARK``, as soon as EARLIER says MARK, or when it ends without saying it.
A lane says a mark by making a file of that name in the folder ``$GPUOP_LANE_MARKS`` names (its
own, emptied when the driver starts): `make test`'s nodes lane says ``built`` once its builds
are done, and its trainer lane starts then (the Makefile says why).

The first lane is echoed as it runs; every lane is written to ``<logs>/<name>.log``. A lane that
ends says so in one line at once, its log is printed whole at the end (so CI's log holds all of
it), then one line per lane: its verdict and its time. Exits non-zero when any lane failed.
SIGINT or SIGTERM is passed on to every lane's process group (pytest then tears its fixtures
down: the nodes' mounts and processes), and a lane still there two minutes later is killed.

    GPUOP_TEST_TURN_LOCK=.test-logs/machine-turn.lock PYTHONPATH=tests \\
        python3 -m support.tools.lanes --logs .test-logs --holds-turn checks --low-priority trainer \\
        --after trainer=nodes:built nodes="make test-nodes" checks="make test-checks" \\
        trainer="make test-trainer"
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

# How long a lane that was asked to stop may take to tear down before it is killed: the chain's
# teardown (two nodes, their pods and mounts) takes about a minute.
STOP_GRACE_S: Final = 120.0
# The file whose lock is the machine's turn: the chain takes it alone, the lanes named by
# --holds-turn hold it shared; `make test` names it for every lane (unset, each suite runs as it
# comes).
TURN_LOCK_VARIABLE: Final = "GPUOP_TEST_TURN_LOCK"
# The folder each lane is given to say its marks in (a file a mark), the lane's own: see --after.
MARKS_VARIABLE: Final = "GPUOP_LANE_MARKS"
# A low-priority lane's group is an idle one (cpu.idle: its tasks run on what no one else wants,
# and any other task that wakes takes the CPU from them at once), of the least weight.
LOW_PRIORITY_SHARES: Final = 2
CPU_CGROUPS: Final = Path("/sys/fs/cgroup/cpu")
# How long a low-priority lane's group may take to empty once the lane is over: a process that
# left the lane's session (setsid) can outlive its shell by a moment, and the kernel counts an
# exiting task in the group a little after its output closes.
GROUP_EMPTY_WAIT_S: Final = 10.0


@contextlib.contextmanager
def machine_turn() -> Iterator[float]:
    """Have the machine to itself: wait until no lane holds the turn (see :func:`held_turn`),
    then hold it, alone; yields the seconds waited. Outside `make test` (no lock named) at
    once. A lock of the kernel's (flock): a holder that dies lets go with it."""
    path = os.environ.get(TURN_LOCK_VARIABLE)
    if not path:
        yield 0.0
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        began = time.monotonic()
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - began
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def held_turn(path: Path) -> IO[str]:
    """A hold on the machine's turn, shared with the other lanes that hold it, until the
    returned file is closed: :func:`machine_turn` waits for every such hold to go."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a")
    fcntl.flock(handle, fcntl.LOCK_SH)
    return handle


def low_priority_group(name: str) -> Path | None:
    """An idle cpu cgroup (v1) of weight LOW_PRIORITY_SHARES beside this process's own, for the
    lane ``name`` (a kernel without cpu.idle: the weight alone). A group, not ``nice``: under the
    kernel's autogroups a nice counts only within its own session, and torchrun starts each rank
    in a session of its own. None where no v1 cpu controller can be written (no root, a v2-only
    host): that lane then starts at once and holds the turn, as without ``--low-priority`` and
    ``--after``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            break
    else:
        return None
    # The driver's pid in the name: two drivers (a `make check` beside a `make test`) never share
    # a group, so neither one's leftovers keep the other's from going.
    group = CPU_CGROUPS / path.lstrip("/") / f"gpuop-lane-{name}-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.shares").write_text(str(LOW_PRIORITY_SHARES))
    except OSError:
        return None
    with contextlib.suppress(FileNotFoundError):  # cpu.idle: Linux 5.15 and later
        (group / "cpu.idle").write_text("1")
    return group


def remove_group(group: Path) -> str | None:
    """Remove a lane's group once its processes are gone, waiting up to GROUP_EMPTY_WAIT_S for
    them. None once it is gone; else why it is left in place: the pids still in it, or the error
    that kept it (any error is said: a group left in silence would be found by no one)."""
    deadline = time.monotonic() + GROUP_EMPTY_WAIT_S
    while True:
        try:
            group.rmdir()
            return None
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno == errno.EBUSY and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            failure = error
        with contextlib.suppress(OSError):
            if pids := [int(pid) for pid in (group / "cgroup.procs").read_text().split()]:
                return f"still holds {pids}"
        return f"could not be removed ({failure.strerror})"


@dataclass
class Lane:
    name: str
    command: str
    log: Path
    echo: bool
    holds_turn: bool = False
    after: str | None = None  # the lane whose end (or mark) starts this one
    mark: str | None = None  # that lane's mark that starts this one; None: only its end
    group: Path | None = None  # the low-priority cpu cgroup it runs in
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ended: float | None = None
    returncode: int | None = None
    pump: threading.Thread | None = field(default=None, repr=False)
    turn: IO[str] | None = field(default=None, repr=False)  # its hold on the turn while it runs

    @property
    def took(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started

    @property
    def marks(self) -> Path:
        """The folder this lane says its marks in."""
        return self.log.parent / "marks" / self.name


def parse_lane(text: str) -> tuple[str, str]:
    name, sep, command = text.partition("=")
    if not sep or not name.isidentifier() or not command.strip():
        raise argparse.ArgumentTypeError(f"a lane is NAME=COMMAND, got {text!r}")
    return name, command


def parse_after(text: str) -> tuple[str, str, str | None]:
    """``LANE=EARLIER`` or ``LANE=EARLIER:MARK``: the lane, the one it waits for, and the mark."""
    name, sep, rest = text.partition("=")
    earlier, colon, mark = rest.partition(":")
    if not (sep and name.isidentifier() and earlier.isidentifier() and (mark.isidentifier() or not colon)):
        raise argparse.ArgumentTypeError(f"--after is LANE=EARLIER or LANE=EARLIER:MARK, got {text!r}")
    return name, earlier, mark or None


def verdict(returncode: int | None) -> str:
    return "passed" if returncode == 0 else f"FAILED (exit {returncode})"


def clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def _pump(lane: Lane, out: IO[bytes]) -> None:
    """Copy the lane's output to its log, and to our stdout for the echoed lane."""
    assert lane.process is not None
    assert lane.process.stdout is not None
    pipe = lane.process.stdout.fileno()
    with lane.log.open("wb") as log:
        for chunk in iter(lambda: os.read(pipe, 65536), b""):  # what is there, not a full buffer
            log.write(chunk)
            log.flush()
            if lane.echo:
                out.write(chunk)
                out.flush()


def start(lane: Lane, out: IO[bytes]) -> None:
    lane.log.parent.mkdir(parents=True, exist_ok=True)
    lane.started = time.monotonic()
    env = {**os.environ, MARKS_VARIABLE: str(lane.marks.absolute())}  # its processes may run anywhere
    # The shell joins the group before it runs the command: all it starts is born there.
    command = lane.command if lane.group is None else f"echo $$ > {lane.group}/cgroup.procs && {lane.command}"
    # A session of its own: a signal reaches the whole lane (make, pytest and what they started).
    lane.process = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)  # fmt: skip
    lane.pump = threading.Thread(target=_pump, args=(lane, out), name=f"lane-{lane.name}", daemon=True)
    lane.pump.start()


def _say(out: IO[bytes], line: str) -> None:
    out.write(f"\n[lanes] {line}\n".encode())
    out.flush()


def _signal_all(lanes: list[Lane], signum: int) -> None:
    for lane in lanes:
        if lane.process is not None and lane.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it ended since the last poll
                os.killpg(lane.process.pid, signum)


def _due(later: Lane, lanes: dict[str, Lane]) -> str | None:
    """Why the waiting lane ``later`` may start now (the words after "started, "), or None."""
    assert later.after is not None
    earlier = lanes[later.after]
    if later.mark is not None and (earlier.marks / later.mark).exists():
        return f"after {earlier.name} said {later.mark}"
    if earlier.ended is not None:
        return f"after {earlier.name}" + (f" (which ended without saying {later.mark})" if later.mark else "")
    return None


def run(lanes: list[Lane], out: IO[bytes]) -> int:
    stopping: list[float] = []
    by_name = {lane.name: lane for lane in lanes}
    for lane in lanes:  # no mark of an earlier run may start a lane of this one
        shutil.rmtree(lane.marks, ignore_errors=True)
        lane.marks.mkdir(parents=True)

    def stop(signum: int, _frame: object) -> None:
        if not stopping:
            stopping.append(time.monotonic())
            _say(out, f"stopping every lane ({signal.Signals(signum).name})")
        _signal_all(lanes, signal.SIGINT)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    turn = os.environ.get(TURN_LOCK_VARIABLE)
    try:
        for lane in lanes:  # every hold first: no lane's chain may take the turn before them
            if lane.holds_turn and turn:
                lane.turn = held_turn(Path(turn))
        waiting = [lane for lane in lanes if lane.after is not None]
        running = [lane for lane in lanes if lane.after is None]
        for lane in running:
            start(lane, out)
        while running:
            for lane in list(running):
                assert lane.process is not None
                code = lane.process.poll()
                if code is None:
                    continue
                lane.returncode, lane.ended = code, time.monotonic()
                if lane.turn is not None:
                    lane.turn.close()  # the turn's lock goes with its file
                running.remove(lane)
                _say(out, f"lane {lane.name} {verdict(code)} in {clock(lane.took)}; its log: {lane.log}")
            for later in list(waiting):
                if stopping or (why := _due(later, by_name)) is None:
                    continue
                waiting.remove(later)
                running.append(later)
                start(later, out)
                _say(out, f"lane {later.name} started, {why}")
                if stopping:  # the stop came between the check and the start: it stops this one too
                    _signal_all([later], signal.SIGINT)
            if stopping and time.monotonic() - stopping[0] > STOP_GRACE_S:
                _signal_all(running, signal.SIGKILL)
            time.sleep(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for lane in lanes:
            if lane.turn is not None:
                lane.turn.close()
        for lane in lanes:
            if lane.pump is not None:  # its output's end: what the lane started is over, or nearly
                lane.pump.join()
        for lane in lanes:
            if lane.group is not None and (why := remove_group(lane.group)):
                _say(out, f"{lane.name}'s group {lane.group} {why} and is left in place")
    for lane in lanes:
        if not lane.echo and lane.log.exists():
            out.write(f"\n{'=' * 30} lane {lane.name}: {lane.command} {'=' * 30}\n".encode())
            out.write(lane.log.read_bytes())
    out.write(b"\n")
    for lane in lanes:
        took = clock(lane.took) if lane.process is not None else "not started"
        out.write(f"[lanes] {lane.name:<10} {verdict(lane.returncode):<18} {took}\n".encode())
    out.flush()
    return 0 if all(lane.returncode == 0 for lane in lanes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logs", type=Path, required=True, help="the folder each lane's log is written to")
    parser.add_argument("--holds-turn", action="append", default=[], metavar="NAME",
                        help=f"this lane holds the machine's turn while it runs (with ${TURN_LOCK_VARIABLE})")  # fmt: skip
    parser.add_argument("--after", action="append", default=[], type=parse_after, metavar="LANE=EARLIER[:MARK]",
                        help="LANE starts when EARLIER ends (or says MARK), not at once")  # fmt: skip
    parser.add_argument("--low-priority", action="append", default=[], metavar="NAME",
                        help="this lane gets the CPU the others leave (an idle cpu cgroup)")  # fmt: skip
    parser.add_argument("lanes", nargs="+", type=parse_lane, metavar="NAME=COMMAND",
                        help="the first is echoed as it runs")  # fmt: skip
    args = parser.parse_args(argv)
    names = [name for name, _ in args.lanes]
    if len(set(names)) != len(names):
        parser.error(f"two lanes share a name: {names}")
    if unknown := sorted(set(args.holds_turn) - set(names)):
        parser.error(f"--holds-turn names no lane: {unknown}")
    after = {name: earlier for name, earlier, _ in args.after}
    marks = {name: mark for name, _, mark in args.after}
    if unknown := sorted({*after, *after.values()} - set(names)):
        parser.error(f"--after names no lane: {unknown}")
    if unknown := sorted(set(args.low_priority) - set(names)):
        parser.error(f"--low-priority names no lane: {unknown}")
    if chained := sorted(set(after) & set(after.values())):
        parser.error(f"a lane that starts --after another cannot be waited for in turn: {chained}")
    if names[0] in after:
        parser.error(f"the echoed lane {names[0]} cannot wait --after another")
    if held_later := sorted(set(after) & set(args.holds_turn)):
        # its hold would come after the chain may have taken the turn
        parser.error(f"a lane that starts --after another cannot hold the turn: {held_later}")
    lanes = [
        Lane(
            name,
            command,
            args.logs / f"{name}.log",
            echo=index == 0,
            holds_turn=name in args.holds_turn,
            after=after.get(name),
            mark=marks.get(name),
        )
        for index, (name, command) in enumerate(args.lanes)
    ]
    for lane in lanes:
        print(f"[lanes] {lane.name}: {shlex.join(['bash', '-c', lane.command])} -> {lane.log}", flush=True)
        if lane.name not in args.low_priority:
            continue
        lane.group = low_priority_group(lane.name)
        if lane.group is not None:
            print(f"[lanes] {lane.name} runs in {lane.group}", flush=True)
            continue
        # At the normal priority it would stretch the chain into false alarms: be waited for.
        lane.after, lane.mark, lane.holds_turn = None, None, True
        print(f"[lanes] {lane.name}: no v1 cpu cgroup to write; it starts at once and the chain waits for it",
              flush=True)  # fmt: skip
    return run(lanes, sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(main())
