"""The operator's layers import only downwards, and the contract that says so can fail.

`make test` runs `lint-imports` on the tree (pyproject.toml's [tool.importlinter]); here the
same contracts run on a copy with one import each that breaks them.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": f"{tree / 'operator'}:{tree / 'trainer'}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(tree / "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for part in ("operator/gpuop", "trainer/gputrain"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_tree_keeps_every_contract(tree: Path) -> None:
    done = _lint(tree)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        # A toolkit reaching up into the API it serves.
        ("gpuop/_kits/quantity.py", "import gpuop.api.spec", "gpuop's layers import only downwards"),
        # The derivation reaching up into the controller that calls it.
        ("gpuop/observing/derive.py", "import gpuop.controller.kube", "gpuop's layers import only downwards"),
        # The two siblings may not know each other.
        ("gpuop/local/plots.py", "import gpuop.controller.settings", "gpuop's layers import only downwards"),
        ("gpuop/api/status.py", "import gputrain.train", "the operator never imports torch"),
        ("gputrain/contract.py", "import gpuop.api.identity", "the trainer does not know the operator"),
    ],
)
def test_an_upward_import_breaks_the_contract(tree: Path, module: str, line: str, contract: str) -> None:
    path = next(p for p in (tree / "operator" / module, tree / "trainer" / module) if p.exists())
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    done = _lint(tree)
    assert done.returncode != 0
    assert f"{contract}" in done.stdout
    assert "BROKEN" in done.stdout
    assert line.split()[-1] in done.stdout  # the report names the import


# The modules that may assign a training's state (gpuop.controller.table.Tracked): the table,
# which defines it and whose see_* methods are the one way in for what was seen (the watches,
# the tick), and the reconcile (sync.py), which applies what the others return.
STATE_OWNERS = ("table.py", "sync.py")


def _state_writes(source: str) -> list[str]:
    """Each ``tracked.<field> = ...`` (plain, augmented or in a tuple) in ``source``, as
    "line: field"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AugAssign | ast.AnnAssign) else []  # fmt: skip
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id == "tracked"
                ):
                    found.append(f"{node.lineno}: {part.attr}")
    return found


def test_a_trainings_state_is_written_by_the_reconcile_alone() -> None:
    """Children, the status writer and the pod reader return what they made or saw; only the
    reconcile keeps it. Checked on the source, with a write the check must catch."""
    assert _state_writes("def f(tracked):\n    tracked.pods, tracked.child = (), None\n") == [
        "2: pods",
        "2: child",
    ]
    writes = {
        path.name: found
        for path in sorted((ROOT / "operator" / "gpuop" / "controller").glob("*.py"))
        if path.name not in STATE_OWNERS and (found := _state_writes(path.read_text()))
    }
    assert writes == {}, f"a training's state written outside {STATE_OWNERS}: {writes}"
