"""actionlint, the checker of GitHub Actions workflows, built from its Go module
(``tests/actionlint/go.mod``) with the ordinary ``go`` client.

It parses each workflow as the Actions runner would and checks what a YAML schema cannot: the
``${{ }}`` expressions and their types, the contexts and job outputs they name, ``needs:``
between jobs, runner labels, and the inputs of well-known actions. A workflow is otherwise
first run on GitHub, after the push; tests/unit/test_workflows.py runs this one over
.github/workflows/ instead. When ``shellcheck`` (or ``pyflakes``) is on PATH actionlint also
checks ``run:`` scripts with it; the test turns both off, so that its verdict is the same on
every machine.

    PYTHONPATH=tests python3 -m support.tools.actionlint      # build (or find) it, print its path
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from support.paths import ROOT
from support.plane import gobuild

MODULE: Final = ROOT / "tests" / "actionlint"
ACTIONLINT: Final = "github.com/rhysd/actionlint"


def recipe() -> gobuild.Recipe:
    version = gobuild.required_version(MODULE, ACTIONLINT)
    return gobuild.Recipe(
        name="actionlint",
        module=MODULE,
        packages={"actionlint": f"{ACTIONLINT}/cmd/actionlint"},
        label=f"actionlint-{version}",
        cold_cost="measured 74 s on 2 cores at load 2 to 4 with empty Go caches; 63 s with module sources "
        "downloaded; 1 s with Go's build cache warm",
    )


def ensure() -> Path:
    """The cached actionlint binary, built first when missing. Safe from several processes."""
    return gobuild.ensure(recipe()) / "actionlint"


if __name__ == "__main__":
    sys.exit(gobuild.print_built(ensure))
