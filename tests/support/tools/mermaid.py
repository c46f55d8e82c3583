"""Mermaid's own parser, installed once per machine from the npm registry, for the docs test.

GitHub draws ```mermaid blocks with the Mermaid library; a block it cannot parse shows as an
error box instead of the diagram. tests/docs/ pins mermaid and jsdom (package-lock.json); they
are installed with ``npm ci`` into the cache, keyed by the lock file's hash (cold: measured 8 s
and 172 MB on disk; warm: nothing).

    PYTHONPATH=tests python -m support.tools.mermaid     # install (or find), print the directory
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from support.paths import TESTS
from support.plane.gobuild import cache_root

SOURCE = TESTS / "docs"
FILES = ("package.json", "package-lock.json", "mermaid_check.mjs")
BLOCK = re.compile(r"^```mermaid\n(.*?)^```", re.MULTILINE | re.DOTALL)


def directory() -> Path:
    digest = hashlib.sha256(b"".join((SOURCE / name).read_bytes() for name in FILES)).hexdigest()[:12]
    return cache_root() / f"mermaid-{digest}"


def ensure() -> Path:
    """The installed checker's directory, installed first when missing. Safe from several processes."""
    target = directory()
    if (target / ".installed").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / ".mermaid.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".installed").is_file():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            for name in FILES:
                shutil.copy(SOURCE / name, target / name)
            # --ignore-scripts: nothing from the registry runs at install time.
            subprocess.run(["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"],
                           cwd=target, check=True)  # fmt: skip
            (target / ".installed").touch()
    return target


def blocks(markdown: Path) -> list[dict[str, str]]:
    """Each ```mermaid block of a Markdown file, with where it starts (file:line)."""
    text = markdown.read_text()
    return [
        {"where": f"{markdown.name}:{text.count(chr(10), 0, m.start()) + 1}", "text": m.group(1)}
        for m in BLOCK.finditer(text)
    ]


def check(found: list[dict[str, str]]) -> subprocess.CompletedProcess[str]:
    """Mermaid's verdict on each block: exit 0 when all parse, one line per block."""
    target = ensure()
    return subprocess.run(["node", str(target / "mermaid_check.mjs")], input=json.dumps(found),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


if __name__ == "__main__":
    print(ensure(), file=sys.stdout)
