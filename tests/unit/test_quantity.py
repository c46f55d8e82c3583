"""Kubernetes quantities: exact values, and bounded work for any text a user can write."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from gpuop._kits.quantity import MAX_QUANTITY, format_bytes, parse_quantity

EXACT = [
    ("512Mi", Fraction(512 * 2**20)),
    ("1.5", Fraction(3, 2)),
    ("500m", Fraction(1, 2)),
    ("1E", Fraction(10**18)),  # exa, not an exponent
    ("1Ei", Fraction(2**60)),
    ("2e3", Fraction(2000)),
    ("1e-3", Fraction(1, 1000)),
    (1024, Fraction(1024)),
]


@pytest.mark.parametrize(("text", "value"), EXACT, ids=[str(e[0]) for e in EXACT])
def test_exact_values(text: str | int, value: Fraction) -> None:
    assert parse_quantity(text) == value


# The CRD's pattern admits each of these; none may cost more than a moment.
OUT_OF_RANGE = ["1e999999999", "9e99999", "1e19", "9Ei", "-9Ei", 2**63, "1" * 64 + "Ei"]


@pytest.mark.parametrize("text", OUT_OF_RANGE, ids=[str(t)[:20] for t in OUT_OF_RANGE])
def test_values_no_int64_holds_are_refused_at_once(text: str | int) -> None:
    started = time.thread_time()  # this thread's CPU only (see support/cost.py)
    with pytest.raises(ValueError, match=r"out of range|not a Kubernetes quantity"):
        parse_quantity(text)
    assert time.thread_time() - started < 0.01


def test_the_largest_is_accepted_and_printed() -> None:
    assert parse_quantity(str(MAX_QUANTITY)) == MAX_QUANTITY
    assert format_bytes(8 * 2**60) == "8Ei"
