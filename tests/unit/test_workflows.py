"""The GitHub Actions workflows pass actionlint (built from tests/actionlint/go.mod): their
expressions, the job outputs and contexts they name, runner labels and action inputs are
checked here, not first on GitHub after a push. A broken workflow shows the check can fail."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from support.paths import ROOT
from support.tools import actionlint

WORKFLOWS = sorted(p for p in (ROOT / ".github" / "workflows").iterdir() if p.suffix in (".yaml", ".yml"))
# shellcheck and pyflakes, which actionlint runs over `run:` scripts when they are on PATH, are
# turned off: the verdict is then the same on every machine, whatever it has installed.
FLAGS = ("-shellcheck=", "-pyflakes=", "-format", "{{json .}}")


@pytest.fixture(scope="module")
def binary() -> Path:
    # `make test` builds it before pytest runs; without that the first use here builds it (about 1 min).
    return actionlint.ensure()


def _lint(binary: Path, *paths: Path, cwd: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [str(binary), *FLAGS, *(str(p.relative_to(cwd)) for p in paths)],
        cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # 0: nothing found, 1: problems found; anything else is actionlint failing to run.
    assert done.returncode in (0, 1), f"actionlint exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    errors: list[dict[str, Any]] = json.loads(done.stdout or "[]")
    assert (done.returncode == 1) == bool(errors), done.stdout
    return errors


def _readable(errors: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{e['filepath']}:{e['line']}:{e['column']}: {e['message']} [{e['kind']}]\n{e['snippet']}"
        for e in errors
    )


def test_there_are_workflows_to_check() -> None:
    assert {p.name for p in WORKFLOWS} >= {"ci.yaml", "release.yaml"}


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[p.name for p in WORKFLOWS])
def test_the_workflow_passes_actionlint(binary: Path, workflow: Path) -> None:
    errors = _lint(binary, workflow, cwd=ROOT)
    assert not errors, f"actionlint found {len(errors)} problem(s):\n{_readable(errors)}"


def _workflow(label: str, output: str, expression: str) -> str:
    return f"""\
name: broken
on: push
jobs:
  build:
    runs-on: {label}
    outputs:
      digest: ${{{{ steps.push.outputs.digest }}}}
    steps:
      - id: push
        run: echo "digest=sha256:0" >> "$GITHUB_OUTPUT"
  publish:
    needs: build
    runs-on: ubuntu-24.04
    steps:
      - run: echo "${{{{ needs.build.outputs.{output} }}}}"
      - run: echo "${{{{ {expression} }}}}"
"""


def test_a_broken_workflow_is_reported_and_the_same_one_mended_is_not(binary: Path, tmp_path: Path) -> None:
    """Three mistakes a YAML parser accepts, each reported where it is; the same workflow with
    them mended passes, so the reports come from the mistakes and not from where it lies."""
    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    broken = workflows / "broken.yaml"
    broken.write_text(_workflow("ubuntu-99.04", "digset", "github.event_name =="))
    errors = _lint(binary, broken, cwd=tmp_path)
    found = {(e["line"], e["kind"]) for e in errors}
    assert found == {(5, "runner-label"), (15, "expression"), (16, "expression")}, _readable(errors)
    by_line = {e["line"]: e["message"] for e in errors}
    assert 'label "ubuntu-99.04" is unknown' in by_line[5]
    assert 'property "digset" is not defined' in by_line[15]
    assert "unexpected end of input" in by_line[16]

    mended = workflows / "mended.yaml"
    mended.write_text(_workflow("ubuntu-24.04", "digest", "github.event_name == 'push'"))
    assert _lint(binary, mended, cwd=tmp_path) == []
