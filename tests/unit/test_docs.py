"""The docs' diagrams parse with Mermaid, as GitHub renders them (tests/support/tools/mermaid.py)."""

from __future__ import annotations

from pathlib import Path

from support.tools import mermaid

ROOT = Path(__file__).resolve().parents[2]


def _markdown() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(ROOT.glob("charts/*/README.md")),
    ]


def test_every_mermaid_block_in_the_docs_parses() -> None:
    found = [block for path in _markdown() for block in mermaid.blocks(path)]
    assert any(b["where"].startswith("architecture.md:") for b in found), "the data-flow diagram is gone"
    result = mermaid.check(found)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == len(found), result.stdout


def test_a_broken_diagram_is_caught() -> None:
    """The checker can fail: an unclosed node label is Mermaid's parse error, named by place."""
    result = mermaid.check([{"where": "broken.md:1", "text": "flowchart LR\n    a[never closed --> b\n"}])
    assert result.returncode == 1
    assert result.stdout.startswith("error broken.md:1: "), result.stdout
