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


def is_quantity(text: str) -> bool:
    """True when ``text`` is a quantity the API server accepts."""
    return bool(_QUANTITY_RE.match(text))


def parse_quantity(value: str | int) -> Fraction:
    """The exact value of a quantity; ``ValueError`` when it is not one."""
    if isinstance(value, int):
        return Fraction(value)
    text = value.strip()
    if not _QUANTITY_RE.match(text):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number = _NUMBER_RE.match(text)
    assert number is not None  # the full pattern matched, so its number part does
    mantissa = Fraction(number.group(0))
    suffix = text[number.end() :]
    if suffix[:1] in ("e", "E"):
        return mantissa * Fraction(10) ** int(suffix[1:])
    return mantissa * _SUFFIXES[suffix]


def format_bytes(count: int) -> str:
    """A byte count in the largest binary unit that divides it exactly (``2Gi``, ``768Mi``)."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = int(_SUFFIXES[suffix])
        if count >= unit and count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)
