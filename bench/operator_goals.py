"""Issue 30's goals for the operator at scale, judged over the rounds of one run of
``bench/operator_scale.py --kubeconfig --rounds K``.

The goals are set for N=1000 (at another N the same bounds are checked, and the verdict says
so):

* operator/floor <= 1.10: the time until the operator has made every write (Events too)
  against the plain loop making the same writes. Judged only when the arrival is not paced:
  paced, the operator's time includes the arrival (N / rate: 12.5 s for 1,000 at 80/s) and the
  floor's loop, never paced, does not, so the ratio says nothing of cost;
* create->child p99 <= 1.5x the reactive floor's. The issue says "the floor loop's own p99";
  the serial floor's job is made by the very thread that made its training, one request
  later, which no controller that watches can match, so the bound is the reactive floor: a
  plain controller in a process of its own meeting the same arrival (bench/operator_scale.py
  says how it is built);
* 3 writes per job and 0 idle writes, exactly, in every round.

Why rounds, and the median. On this project's 2-core host one run's p99 is one draw from a
wide spread: two identical controllers, run one after the other, gave p99 ratios of 2.28x,
0.95x and 0.74x (docs/benchmarks.md, "two identical controllers"), so a single run can miss
1.5x with no difference in the code, and can meet it by luck. Each round runs the reactive
floor and the operator side by side, their order alternating, since the second meets an etcd
that also holds the first's objects (an even K puts each first equally often), and a goal is
judged on the median of the rounds' ratios. A round in which a watch missed names has no p99
to compare, and then the goal is not judged at all: a median of the rounds that happened to
be seen whole could be any of them.
"""

from __future__ import annotations

import statistics
from typing import Any, Final, Literal

OPERATOR_FLOOR_GOAL: Final = 1.10
P99_GOAL: Final = 1.5
WRITES_PER_JOB: Final = 3
FEWEST_ROUNDS: Final = 3  # fewer, and their median is hardly steadier than one run's figure
GOALS_AT: Final = 1000  # the N the issue sets the goals for
# A round's "order", as run_real records it: which of the two ran first.
REACTIVE_FIRST: Final = "reactive floor first"
OPERATOR_FIRST: Final = "operator first"

Verdict = Literal["met", "NOT MET", "no verdict"]


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


def _shown(ratios: list[float | None]) -> str:
    return ", ".join("n/a" if x is None else f"{x:.2f}x" for x in ratios)


def _median_against(name: str, ratios: list[float | None], goal: float) -> tuple[str, Verdict]:
    judged = [x for x in ratios if x is not None]
    if len(judged) < len(ratios):
        missing = len(ratios) - len(judged)
        return (
            f"{name}: NOT JUDGED, {missing} of {len(ratios)} rounds had no figure ({_shown(ratios)})",
            "no verdict",
        )
    median = statistics.median(judged)
    verdict: Verdict = "met" if median <= goal else "NOT MET"
    return (
        f"{name}: {verdict}, median {median:.2f}x of rounds {_shown(ratios)} (goal <= {goal:.2f}x)",
        verdict,
    )


def _by_order(rounds: list[dict[str, Any]], ratios: list[float | None]) -> str:
    """The p99 ratio's median for each order of the round: what running second costs."""
    parts = []
    for order in (REACTIVE_FIRST, OPERATOR_FIRST):
        mine = [x for r, x in zip(rounds, ratios, strict=True) if r.get("order") == order and x is not None]
        if mine:
            parts.append(f"{order} {statistics.median(mine):.2f}x ({len(mine)})")
    return "p99 ratio's median by order: " + ("; ".join(parts) or "n/a")


def judge(rounds: list[dict[str, Any]]) -> tuple[list[str], Verdict]:
    """The verdict on the goals over the rounds of one count, and a line per goal: NOT MET
    when any goal judged is missed, no verdict when one could not be judged or there were
    too few rounds, met otherwise."""
    if not rounds:
        return ["no round finished: nothing judged"], "no verdict"
    lines: list[str] = []
    verdicts: list[Verdict] = []
    if len(rounds) < FEWEST_ROUNDS:
        lines.append(
            f"only {len(rounds)} round(s): a single run's p99 ratio spreads 0.74-2.28x between two identical "
            f"controllers on this host; give --rounds {FEWEST_ROUNDS} or more for a verdict"
        )
        verdicts.append("no verdict")
    ratios = [p99_ratio(r) for r in rounds]
    line, verdict = _median_against("create->child p99 / reactive floor's", ratios, P99_GOAL)
    lines += [line, _by_order(rounds, ratios)]
    verdicts.append(verdict)
    if rounds[0]["arrival_rate"] is None:
        line, verdict = _median_against(
            "operator / floor", [floor_ratio(r) for r in rounds], OPERATOR_FLOOR_GOAL
        )
        lines.append(line)
        verdicts.append(verdict)
    else:
        lines.append("operator / floor: not judged when paced (the operator's time includes the arrival)")
    totals = [int(r["writes_total"]) for r in rounds]
    idle = [int(r["idle_writes"]) for r in rounds]
    # Writes are counted, not timed: every round must have exactly these, not their median.
    exact = all(t == WRITES_PER_JOB * r["count"] for t, r in zip(totals, rounds, strict=True)) and not any(
        idle
    )
    per_job = ", ".join(f"{t / r['count']:.3f}" for t, r in zip(totals, rounds, strict=True))
    lines.append(
        f"writes/job {per_job}, idle writes {', '.join(map(str, idle))}: "
        + ("met" if exact else f"NOT MET (goal {WRITES_PER_JOB} and 0 in every round)")
    )
    verdicts.append("met" if exact else "NOT MET")
    overall: Verdict = (
        "NOT MET" if "NOT MET" in verdicts else "no verdict" if "no verdict" in verdicts else "met"
    )
    return lines, overall


def headline(count: int, rounds: int, verdict: Verdict) -> str:
    """The verdict's first line: the goals at N=1000, their bounds at any other N."""
    what = (
        "issue 30's goals" if count == GOALS_AT else f"issue 30's bounds (its goals are set at N={GOALS_AT})"
    )
    return f"N={count:5d}  {what} over {rounds} round(s): {verdict}"
