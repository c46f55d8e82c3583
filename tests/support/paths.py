"""Where things are: the repository root, the tests, and the upstream reference files."""

from __future__ import annotations

from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
TESTS: Final = ROOT / "tests"
# Upstream files the tests validate against (tests/reference/SOURCES.md says where each came from).
REFERENCE: Final = TESTS / "reference"
