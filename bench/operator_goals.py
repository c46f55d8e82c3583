"""Issue 30's goals for the operator at scale, judged over the rounds of one run of
``bench/operator_scale.py --kubeconfig --rounds K``.

The goals, at N=1000:

* operator/floor <= 1.10: the time until the operator has made every write (Events too)
  against the plain loop making the same writes. Judged only when the arrival is not paced:
  paced, both take the arrival's own 12.5 s and the ratio says nothing of cost;
* create->child p99 <= 1.5x the reactive floor's. The issue says "the floor loop's own p99";
  the serial floor's job is made by the very thread that made its training, one request
  later, which no controller that watches can match, so the bound is the reactive floor: a
  plain controller in a process of its own meeting the same arrival (bench/operator_scale.py
  says how it is built);
* 3.00 writes per job and 0 idle writes, in every round.

Why rounds, and the median. On this project's 2-core host one run's p99 is one draw from a
wide spread: two identical controllers, run one after the other, gave p99 ratios of 2.28x,
0.95x and 0.74x (docs/benchmarks.md, "two identical controllers"), so a single run can miss
1.5x with no difference in the code, and can meet it by luck. Each round runs the reactive
floor and the operator side by side (their order alternating, since the second meets an
etcd that also holds the first's objects), and the goal is judged on the median of the
rounds' ratios. A round in which a watch missed names has no p99 to compare: it is reported
as not judged, never counted as met.
"""

from __future__ import annotations

import statistics
from typing import Any, Final

OPERATOR_FLOOR_GOAL: Final = 1.10
P99_GOAL: Final = 1.5
WRITES_PER_JOB: Final = 3.0
FEWEST_ROUNDS: Final = 3  # fewer and the median is barely less a single draw than one run


def p99_ratio(r: dict[str, Any]) -> float | None:
    """The operator's create->child p99 over the reactive floor's, or None when either watch
    missed a name (a p99 over the names seen is not the p99 of the run)."""
    if r["unseen"] or r["reactive_unseen"] or not r["p99_ms"] or not r["reactive_p99_ms"]:
        return None
    return float(r["p99_ms"]) / float(r["reactive_p99_ms"])


def floor_ratio(r: dict[str, Any]) -> float | None:
    """Until every write was made, the operator's time over the floor's; None when paced or
    when not every training reached Created."""
    if r["arrival_rate"] is not None or r["created"] < r["count"]:
        return None
    return float(r["operator_written_s"]) / float(r["floor_s"])


def _median_against(name: str, ratios: list[float | None], goal: float) -> tuple[str, bool]:
    shown = ", ".join("n/a" if x is None else f"{x:.2f}x" for x in ratios)
    judged = [x for x in ratios if x is not None]
    if len(judged) < len(ratios):
        return (
            f"{name}: NOT JUDGED, {len(ratios) - len(judged)} of {len(ratios)} rounds had no figure "
            f"({shown})",
            False,
        )
    median = statistics.median(judged)
    verdict = "met" if median <= goal else "NOT MET"
    return f"{name}: {verdict}, median {median:.2f}x of rounds {shown} (goal <= {goal:.2f}x)", median <= goal


def judge(rounds: list[dict[str, Any]]) -> tuple[list[str], bool]:
    """The verdict on the goals over the rounds of one count: a line per goal, and whether
    every goal that applies was met."""
    if not rounds:
        return ["no round finished: nothing judged"], False
    lines: list[str] = []
    passed = True
    if len(rounds) < FEWEST_ROUNDS:
        lines.append(
            f"only {len(rounds)} round(s): a single run's p99 ratio spreads 0.74-2.28x between two identical "
            f"controllers on this host; give --rounds {FEWEST_ROUNDS} or more for a verdict"
        )
        passed = False
    line, met = _median_against(
        "create->child p99 / reactive floor's", [p99_ratio(r) for r in rounds], P99_GOAL
    )
    lines.append(line)
    passed &= met
    if rounds[0]["arrival_rate"] is None:
        line, met = _median_against("operator / floor", [floor_ratio(r) for r in rounds], OPERATOR_FLOOR_GOAL)
        lines.append(line)
        passed &= met
    else:
        lines.append(
            "operator / floor: not judged when paced (both take the arrival's time); run unpaced for it"
        )
    writes = [float(r["writes_per_job"]) for r in rounds]
    idle = [int(r["idle_writes"]) for r in rounds]
    # Writes are counted, not timed: every round must have exactly these, not their median.
    exact = all(abs(w - WRITES_PER_JOB) < 0.005 for w in writes) and not any(idle)
    lines.append(
        f"writes/job {', '.join(f'{w:.2f}' for w in writes)}, idle writes {', '.join(map(str, idle))}: "
        + ("met" if exact else f"NOT MET (goal {WRITES_PER_JOB:.2f} and 0 in every round)")
    )
    passed &= exact
    return lines, passed
