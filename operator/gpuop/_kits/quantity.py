"""Kubernetes resource quantities (``512Mi``, ``2Gi``, ``500m``, ``1.5``) as exact numbers.

Only what the operator needs: parse a quantity to a :class:`~fractions.Fraction` so sizes
can be compared and computed without float rounding, and format a byte count back into the
canonical binary form the API server would print.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Final

# The API server's own quantity grammar (the same pattern the Kubeflow CRDs carry).
QUANTITY_PATTERN: Final = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_RE: Final = re.compile(QUANTITY_PATTERN)
# What our CRD admits: every quantity of a GpuTraining is an amount (memory, CPUs, a size).
AMOUNT_PATTERN: Final = QUANTITY_PATTERN.replace(r"^(\+|-)?", r"^\+?", 1)
_NUMBER_RE: Final = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")

_SUFFIXES: Final[dict[str, Fraction]] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}

MI: Final = 2**20
GI: Final = 2**30
# Bounds that keep every quantity a few microseconds of work, whatever a user writes: the
# CRD's pattern admits "1e999999999", whose exact value is a billion digits (a pegged core
# for a minute, and Python refuses to print it). Kubernetes keeps resource values in an
# int64, so nothing larger is a size anyone can have; the text is shorter than any real one.
MAX_QUANTITY: Final = 2**63 - 1
MAX_QUANTITY_TEXT: Final = 64
_MAX_EXPONENT: Final = 40


def is_quantity(text: str) -> bool:
    """True when ``text`` is a quantity the API server accepts."""
    return len(text) <= MAX_QUANTITY_TEXT and bool(_QUANTITY_RE.match(text))


def parse_quantity(value: str | int) -> Fraction:
    """The exact value of a quantity; ``ValueError`` when it is not one or is out of range
    (magnitude above :data:`MAX_QUANTITY`). Bounded time and memory for any input."""
    if isinstance(value, int):
        exact = Fraction(value)
    else:
        text = value.strip()
        if not is_quantity(text):
            raise ValueError(f"not a Kubernetes quantity: {value[:MAX_QUANTITY_TEXT]!r}")
        number = _NUMBER_RE.match(text)
        assert number is not None  # the full pattern matched, so its number part does
        mantissa = Fraction(number.group(0))
        suffix = text[number.end() :]
        if suffix in _SUFFIXES:  # "E" and "Ei" are exa and exbi, not an exponent
            exact = mantissa * _SUFFIXES[suffix]
        else:
            exponent = int(suffix[1:])
            if abs(exponent) > _MAX_EXPONENT:
                raise ValueError(f"quantity out of range: {text} (at most {MAX_QUANTITY})")
            exact = mantissa * Fraction(10) ** exponent
    if abs(exact) > MAX_QUANTITY:  # not printed: Python refuses to print an integer this large
        raise ValueError(f"quantity out of range (at most {MAX_QUANTITY})")
    return exact


def format_bytes(count: int) -> str:
    """A byte count in the largest binary unit that divides it exactly (``2Gi``, ``768Mi``)."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if count >= unit and count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)
