"""`make test`'s lanes: every suite runs in exactly one, and the driver that runs them at once
reports each lane's verdict, fails when any lane fails and stops them all when it is stopped."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.paths import ROOT
from support.tools import lanes
from support.waiting import wait_for

LANE_LISTS = ("NODE_SUITES", "TRAINER_SUITES", "CHECK_SUITES", "SERVER_SUITES")
# `make e2e`'s alone: the kind suite needs Docker, and a runner with it would spend an hour.
NOT_IN_MAKE_TEST = {"tests/e2e"}


def _make_variable(name: str) -> list[str]:
    found = re.search(rf"^{name} := (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, f"the Makefile defines no {name}"
    return found.group(1).split()


def test_every_suite_runs_in_exactly_one_lane() -> None:
    suites = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").iterdir()
        if path.is_dir() and any(path.rglob("test_*.py"))
    }
    listed = [suite for name in LANE_LISTS for suite in _make_variable(name)]
    assert len(listed) == len(set(listed)), f"a suite in two lanes: {sorted(listed)}"
    assert set(listed) == suites - NOT_IN_MAKE_TEST


def _recipe(target: str) -> list[str]:
    """The Makefile's recipe of ``target``, a line per command (read, not run: `make -n` would
    run the lines that name $(MAKE), `make test`'s lanes among them)."""
    found = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, f"the Makefile has no recipe for {target}"
    return [" ".join(line.split()) for line in found.group(1).replace("\\\n", " ").splitlines()]


def test_the_trainer_lane_starts_once_the_nodes_lane_says_its_builds_are_done() -> None:
    """Not at once: on a machine without the builds, one that the trainer lane started at its low
    priority (SeaweedFS, which both lanes need) would hold up the nodes lane on its lock. The
    nodes lane's builds are its prerequisites, so its recipe's first line comes after them."""
    (test,) = _recipe("test")
    assert "--low-priority trainer --after trainer=nodes:built" in test, test
    mark, suites = _recipe("test-nodes")
    assert mark.startswith('@[ -z "$$GPUOP_LANE_MARKS" ] || touch "$$GPUOP_LANE_MARKS/built"'), mark
    assert suites == "$(PYTEST_LANE) $(NODE_SUITES)", suites


def _driver(tmp_path: Path, *specs: str) -> subprocess.Popen[str]:
    """The driver with its logs in ``tmp_path / "logs"``, named relative as `make test` names them."""
    return subprocess.Popen(
        [sys.executable, "-m", "support.tools.lanes", "--logs", "logs", *specs],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_a_failing_lane_fails_the_run_and_every_lane_is_reported_and_logged(tmp_path: Path) -> None:
    driver = _driver(tmp_path, "first=echo from-first", "second=echo from-second; exit 3")
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 1, out
    assert re.search(r"\[lanes\] first +passed", out), out
    assert re.search(r"\[lanes\] second +FAILED \(exit 3\)", out), out
    assert (tmp_path / "logs" / "first.log").read_text() == "from-first\n"
    assert (tmp_path / "logs" / "second.log").read_text() == "from-second\n"
    # the second lane is not echoed as it runs, but its log is printed whole at the end
    header = "lane second: echo from-second; exit 3 ="
    assert header in out, out
    assert "from-second\n" in out.split(header, 1)[1], out


def test_lanes_run_at_once(tmp_path: Path) -> None:
    """Each lane waits for the other's mark: run one after another, neither would finish."""
    marks = tmp_path / "marks"
    marks.mkdir()
    wait_for = "for i in $(seq 100); do [ -e {mark} ] && exit 0; sleep 0.1; done; exit 1"
    first = f"touch {marks}/a; " + wait_for.format(mark=marks / "b")
    second = f"touch {marks}/b; " + wait_for.format(mark=marks / "a")
    driver = _driver(tmp_path, f"a={first}", f"b={second}")
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 0, out


def test_all_passing_lanes_pass(tmp_path: Path) -> None:
    driver = _driver(tmp_path, "only=true", "other=true")
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 0, out


def test_a_stopped_run_stops_every_lane_with_sigint_so_pytest_tears_down(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    # a lane that says when it is interrupted, as pytest does when it tears its fixtures down
    lane = f"trap 'echo interrupted; exit 7' INT; touch {ready}-$LANE; while true; do sleep 0.1; done"
    driver = _driver(tmp_path, f"one=LANE=one; {lane}", f"two=LANE=two; {lane}")
    wait_for("both lanes started", lambda: all(Path(f"{ready}-{n}").exists() for n in ("one", "two")),
             timeout=30, every=0.05)  # fmt: skip
    driver.send_signal(signal.SIGTERM)
    out, _ = driver.communicate(timeout=30)
    assert driver.returncode == 1, out
    assert "stopping every lane (SIGTERM)" in out
    for name in ("one", "two"):
        assert (tmp_path / "logs" / f"{name}.log").read_text().strip() == "interrupted"
        assert re.search(rf"\[lanes\] {name} +FAILED \(exit 7\)", out), out


def test_a_lane_is_name_equals_command() -> None:
    assert lanes.parse_lane("checks=make test-checks") == ("checks", "make test-checks")
    for bad in ("make test-checks", "=make", "two words=make", "name="):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=COMMAND"):
            lanes.parse_lane(bad)


def test_clock() -> None:
    assert lanes.clock(0) == "0m00s"
    assert lanes.clock(3725.4) == "62m05s"


def test_the_machines_turn_is_had_by_one_lane_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two suites that take the turn: the second waits for the first's turn to end, and a
    holder that dies lets go with it."""
    monkeypatch.setenv(lanes.TURN_LOCK_VARIABLE, str(tmp_path / "logs" / "turn.lock"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom support.tools import lanes\nwith lanes.machine_turn():\n"
         "    print('held', flush=True)\n    time.sleep(60)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        threading.Timer(1.0, holder.kill).start()  # dies holding it
        with lanes.machine_turn() as waited:
            assert 0.8 <= waited < 30, waited
    finally:
        holder.kill()
        holder.wait()
    with lanes.machine_turn() as waited:  # free: at once
        assert waited < 0.5
    monkeypatch.delenv(lanes.TURN_LOCK_VARIABLE)
    with lanes.machine_turn() as waited:  # outside `make test`: no turn to wait for
        assert waited == 0.0


def test_the_chain_waits_for_every_lane_that_holds_the_turn_and_for_no_other(tmp_path: Path) -> None:
    """The driver holds the turn, shared, for each ``--holds-turn`` lane from before any lane
    starts until that lane ends; a suite's machine_turn (the chain's) gets it only then. A
    lane that does not hold it (the nodes lane, the chain's own) keeps no one waiting. Events,
    not timers: the held lane ends only once the test has seen the chain ask for the turn, and
    the free lane ends only once the chain has it."""
    asking, released, got = tmp_path / "asking", tmp_path / "released", tmp_path / "got"
    chain = tmp_path / "chain.py"
    chain.write_text(
        "from pathlib import Path\nfrom support.tools import lanes\n"
        f"Path({str(asking)!r}).touch()\n"
        "with lanes.machine_turn():\n"
        f"    print('released first:', Path({str(released)!r}).exists(), flush=True)\n"
        f"    Path({str(got)!r}).touch()\n"
    )
    until = "for i in $(seq 600); do [ -e {mark} ] && exit 0; sleep 0.1; done; exit 1"
    driver = subprocess.Popen(
        [sys.executable, "-m", "support.tools.lanes", "--logs", str(tmp_path / "logs"),
         "--holds-turn", "held", "--holds-turn", "quick",
         f"chain={sys.executable} {chain}", f"held={until.format(mark=released)}", "quick=true",
         f"free={until.format(mark=got)}"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "tests"),
                       lanes.TURN_LOCK_VARIABLE: str(tmp_path / "logs" / "turn.lock")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for("the chain asking for the turn", asking.exists, timeout=30, every=0.05)
        released.touch()  # the held lane may end now, and its hold go with it
        out, _ = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 0, out
    assert (tmp_path / "logs" / "chain.log").read_text() == "released first: True\n", out


def test_a_turn_held_by_no_lane_is_refused(tmp_path: Path) -> None:
    driver = _driver(tmp_path, "--holds-turn", "gone", "only=true")
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 2
    assert "--holds-turn names no lane: ['gone']" in out


def test_a_lane_after_another_starts_when_that_one_ends_whatever_its_verdict(tmp_path: Path) -> None:
    """The later lane finds the earlier one's mark (it ran and ended first) and is reported;
    a lane that neither follows nor is followed runs at once (it sees no mark yet)."""
    mark = tmp_path / "earlier-ended"
    driver = _driver(tmp_path, "--after", "later=earlier", "first=true",
                     f"earlier=sleep 1; touch {mark}; exit 3", f"later=test -e {mark}",
                     f"free=test ! -e {mark}")  # fmt: skip
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 1, out  # the earlier lane's exit 3
    assert re.search(r"\[lanes\] earlier +FAILED \(exit 3\)", out), out
    assert re.search(r"\[lanes\] later +passed", out), out
    assert re.search(r"\[lanes\] free +passed", out), out
    assert "lane later started, after earlier" in out, out


def test_a_lane_after_a_mark_starts_when_the_earlier_lane_says_it_or_when_it_ends(tmp_path: Path) -> None:
    """The earlier lane goes on only once the later one has run, so the later one must start on
    the mark, not at the earlier one's end; and it must not start on a mark an earlier run left
    (the driver empties each lane's folder), or it would find the earlier lane had said nothing
    yet. The folder is named absolute whatever --logs is: a lane's processes run anywhere."""
    stale = tmp_path / "logs" / "marks" / "earlier" / "built"
    stale.parent.mkdir(parents=True)
    stale.touch()
    said, ran, ended = (tmp_path / name for name in ("said", "later-ran", "earlier-ended"))
    says = (f'sleep 1; touch {said}; cd /; touch "$GPUOP_LANE_MARKS/built"; '
            f"for i in $(seq 300); do [ -e {ran} ] && break; sleep 0.1; done; touch {ended}")  # fmt: skip
    driver = _driver(tmp_path, "--after", "later=earlier:built", "--after", "never=earlier:other", "first=true",
                     f"earlier={says}", f"later=test -e {said} && touch {ran}", f"never=test -e {ended}")  # fmt: skip
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 0, out
    assert "lane later started, after earlier said built" in out, out
    assert "lane never started, after earlier (which ended without saying other)" in out, out


@pytest.mark.parametrize(
    ("specs", "refusal"),
    [
        (["--after", "later=gone"], "--after names no lane: ['gone']"),
        (["--after", "later=gone:built"], "--after names no lane: ['gone']"),
        (["--after", "later=middle:"], "--after is LANE=EARLIER or LANE=EARLIER:MARK"),
        (["--after", "first=later"], "the echoed lane first cannot wait --after another"),
        (["--after", "later=middle", "--after", "middle=later"], "cannot be waited for in turn"),
        (["--after", "later=middle", "--holds-turn", "later"], "cannot hold the turn: ['later']"),
    ],
)
def test_an_after_that_cannot_be_run_is_refused(tmp_path: Path, specs: list[str], refusal: str) -> None:
    driver = _driver(tmp_path, *specs, "first=true", "middle=true", "later=true")
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 2, out
    assert refusal in out, out


def test_a_low_priority_lane_and_all_it_starts_run_in_a_cpu_group_of_low_weight(tmp_path: Path) -> None:
    """A group, not nice: a process that starts a session of its own (as torchrun's ranks do)
    stays in it. Where no v1 cpu controller can be written the lane runs as any other, and the
    driver says so (what it does then: the next test)."""
    in_group = "grep -E '^[0-9]+:([^:]*,)?cpu(,[^:]*)?:' /proc/self/cgroup"
    # setsid, as the lane's process group leader, forks: the lane's shell is over at once while
    # the grandchild still runs, writes, then lingers in the group with its output closed.
    grandchild = f"setsid sh -c {shlex.quote(f'sleep 1; {in_group}; exec >&- 2>&-; sleep 2')}"
    driver = _driver(
        tmp_path, "--low-priority", "low", "first=true", f"low={grandchild}", f"normal={in_group}"
    )
    out, _ = driver.communicate(timeout=60)
    assert driver.returncode == 0, out
    low, normal = ((tmp_path / "logs" / f"{name}.log").read_text() for name in ("low", "normal"))
    if "low: no v1 cpu cgroup to write" in out:
        assert low == normal, out
        return
    group = Path(next(line for line in out.splitlines() if line.startswith("[lanes] low runs in "))
                 .removeprefix("[lanes] low runs in "))  # fmt: skip
    assert low.strip().endswith(f"/{group.name}"), out
    assert not normal.strip().endswith(f"/{group.name}"), out
    assert not group.exists(), f"the driver leaves no group behind: {out}"


@pytest.mark.parametrize(("procs", "why"), [("", "could not be removed (Directory not empty)"),
                                            ("4242\n", "still holds [4242]")])  # fmt: skip
def test_a_group_that_cannot_be_removed_says_why(tmp_path: Path, procs: str, why: str) -> None:
    """Any error, not only a busy group's, is said in the driver's line. A directory with a file
    in it stands in for the group: its rmdir fails at once with ENOTEMPTY, not EBUSY."""
    (tmp_path / "cgroup.procs").write_text(procs)
    assert lanes.remove_group(tmp_path) == why
    assert lanes.remove_group(tmp_path / "gone") is None


def test_a_low_priority_lane_with_no_cgroup_to_run_in_starts_at_once_and_holds_the_turn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """At the normal priority beside the chain it would stretch the chain into false alarms."""
    planned: list[lanes.Lane] = []
    monkeypatch.setattr(lanes, "low_priority_group", lambda name: None)
    monkeypatch.setattr(lanes, "run", lambda these, out: planned.extend(these) or 0)
    argv = ["--logs", str(tmp_path), "--after", "low=first:built", "--low-priority", "low", "first=true", "low=true"]  # fmt: skip
    assert lanes.main(argv) == 0
    low = planned[1]
    assert (low.name, low.after, low.mark, low.holds_turn, low.group) == ("low", None, None, True, None)
    said = "[lanes] low: no v1 cpu cgroup to write; it starts at once and the chain waits for it"
    assert said in capsys.readouterr().out
