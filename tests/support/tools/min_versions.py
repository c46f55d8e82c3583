"""The minimum-versions job (``make min-versions``): the operator's unit tests against the lowest
versions pyproject.toml declares.

pyproject.toml's ``dependencies`` and ``[operator]`` extra each give a lower bound
(``kopf>=1.37``); here each becomes an exact pin (``kopf==1.37``) in a constraints file, and
``.[operator]`` is installed with them into a venv of its own outside the work tree,
``~/.cache/gpuop/min-versions-<hash>/`` (``$GPUOP_CACHE`` moves it), keyed by the pins, the test
tools' pins and the Python: a change to any bound makes a fresh venv, anything else reuses it.
What those packages pull in floats to the newest that they allow, as it would for a user. The
project is an editable install, pointed at this checkout on every run.

The test tools come at the versions constraints.txt pins (they are not what is tested). Torch
and the trainer are no part of the operator's minimums, nor are the dev-only checkers, so the
unit test files that need them are left out, each named below with why; the rest runs, and then
a smoke of the operator's Kopf handlers (which no unit test reaches). It prints the pins, every
package installed, what was left out and the verdict; it exits non-zero when anything failed.

    PYTHONPATH=tests python3 -m support.tools.min_versions      # install (or find) and run
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from support.paths import ROOT
from support.plane.gobuild import cache_root

PYPROJECT = ROOT / "pyproject.toml"
CONSTRAINTS = ROOT / "constraints.txt"
# What the selected unit tests need besides the operator: pytest and hypothesis (property
# tests), at constraints.txt's pins. (jsonschema, kmock and pytest-asyncio only serve files left
# out below.)
TOOLS = ("pytest", "hypothesis")
# Left out, with why: none of these is a dependency of the operator.
_SCHEMAS = (
    "support.schemas validates against Kubeflow's and our CRD schemas with kubernetes-validate and "
    "cel-python (dev tools; cel-python 0.5.0 needs pyyaml>=6.0.2, above our minimum)"
)
IGNORED = {
    "tests/unit/test_crd.py": _SCHEMAS,
    "tests/unit/test_crd_agreement.py": _SCHEMAS,
    "tests/unit/test_render.py": _SCHEMAS,
    "tests/unit/test_trainjob.py": _SCHEMAS,
    "tests/unit/test_backend_env.py": (
        "reads Trainer v2's pods as support.schemas.kubeflow merges them, a module that imports "
        "kubernetes-validate (a dev tool); it renders, and no client runs"
    ),
    "tests/unit/test_operator_parts.py": (
        "its API emulator (support.emulator) checks objects against our CRD's schema with cel-python, "
        "as above"
    ),
    "tests/unit/test_bench_counting.py": (
        "imports bench/operator_scale.py, which imports the API emulator (support.emulator: jsonpatch "
        "and cel-python, dev tools)"
    ),
    "tests/unit/test_layers.py": "runs lint-imports (import-linter, a dev tool)",
    "tests/unit/test_docs.py": "runs Mermaid's parser from npm (a docs tool)",
    "tests/unit/test_credentials_agreement.py": "compares our kubeconfig reader with the kubernetes client's (a dev tool)",
    "tests/unit/test_kubeflow_sdk.py": "puts the Kubeflow SDK's kubernetes first on the path, and imports transformers (torch)",
    "tests/unit/test_report_client.py": (
        "gpureport, the trainer side's report client (standard library only), and its runs of torch "
        "and the built-in trainer"
    ),
}
DESELECTED = {
    "tests/unit/test_cli.py::test_completion_completes_commands_and_choices": (
        "runs .venv/bin/gpuop, the dev venv's command and click, not this venv's (completion itself "
        "is run here by test_shell_completion_scripts)"
    ),
    "tests/unit/test_contract.py::test_a_picture_that_cannot_be_written_is_one_line_naming_the_path": (
        "draws with matplotlib, the [plots] extra"
    ),
    "tests/unit/test_dcgm.py::test_an_odd_line_costs_that_line_only": (
        "prometheus-client before 0.22 reads the malformed line (a stray quote) with the labels meant, "
        "where 0.22 on refuses it; no other line is lost either way"
    ),
}

# Kopf at its minimum: the handlers the operator registers, its startup settings, its login with
# what gpuop.controller.credentials read from a kubeconfig, and the probe. The unit
# tests reach none of it (the control-plane suites do, with the dev venv); Kopf's registry is
# read through its internals, fine for the one Kopf version this runs with.
SMOKE = """
import asyncio, json, logging, kopf
from gpuop.controller import app
from gpuop.controller.credentials import from_kubeconfig
from gpuop.controller.kube import Kube
from gpuop.controller.reconciler import Reconciler
from support.tools.operator_args import parse_operator_args

settings = parse_operator_args(["--namespace", "team-a"], {})
reconciler = Reconciler(Kube(from_kubeconfig()), settings)
registry = app.build_registry(reconciler, settings, app.ApiRetries())
handlers = {h.activity.value: h.fn for h in registry._activities.get_all_handlers()}
kopf_settings = kopf.OperatorSettings()
asyncio.run(handlers["startup"](settings=kopf_settings))
login = handlers["authentication"](logger=logging.getLogger("login"))
seen = {
    "watched": len(registry._watching.get_all_handlers()),
    "activities": sorted(handlers),
    "scanning_disabled": kopf_settings.scanning.disabled,
    "posting": kopf_settings.posting.enabled,
    "server": login.server,
    "token": login.token,
    "tracked": handlers["probe"](),
}
reconciler.close()
print(json.dumps(seen))
"""
SMOKE_EXPECTED = {
    "watched": 1,  # GpuTraining (its jobs are watched by gpuop.controller.jobwatch)
    "activities": ["authentication", "probe", "startup"],
    "scanning_disabled": True,  # watching given namespaces
    "posting": False,
    "server": "https://127.0.0.1:6443",
    "token": "min-versions",
    "tracked": 0,
}
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: min-versions}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
"""


def lower_bounds() -> list[str]:
    """``name==X`` for each ``name>=X`` of ``dependencies`` and the ``[operator]`` extra."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    pins = []
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["operator"]]:
        match = re.fullmatch(
            r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(,[^;]*)?",
            requirement,
        )
        if match is None:
            raise SystemExit(f"min-versions: {requirement!r} declares no lower bound (name>=X) to test")
        pins.append(f"{match.group(1)}=={match.group(3)}")  # a constraint names no extras
    return pins


def tool_pins() -> list[str]:
    """The test tools' lines of constraints.txt."""
    pinned = {}
    for line in CONSTRAINTS.read_text().splitlines():
        name, _, version = line.partition("==")
        if version and not line.startswith("#"):
            pinned[name.strip().lower()] = f"{name.strip()}=={version.strip()}"
    missing = [tool for tool in TOOLS if tool not in pinned]
    if missing:
        raise SystemExit(f"min-versions: constraints.txt pins no {', '.join(missing)}")
    return [pinned[tool] for tool in TOOLS]


def build_requirements() -> list[str]:
    """setuptools, as the build system asks for it: the editable install runs without isolation."""
    return list(tomllib.loads(PYPROJECT.read_text())["build-system"]["requires"])


def _say(line: str) -> None:
    print(f"min-versions: {line}", flush=True)


def ensure(bounds: list[str], tools: list[str]) -> Path:
    """The venv with the minimums and the tools, created first when missing. Safe from several
    processes."""
    python = f"{sys.implementation.name}{sys.version_info.major}.{sys.version_info.minor}"
    key = json.dumps({"python": python, "bounds": bounds, "tools": tools, "build": build_requirements()})
    home = cache_root() / f"min-versions-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (home / ".installed").is_file():
        _say(f"reusing {home}")
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    with (home.parent / ".min-versions.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (home / ".installed").is_file():
            started = time.monotonic()
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            (home / "key.json").write_text(key + "\n")
            (home / "constraints.txt").write_text("\n".join([*bounds, *tools]) + "\n")
            _say(f"creating {home} ({python}): {' '.join(bounds)}")
            subprocess.run([sys.executable, "-m", "venv", str(home / "venv")], check=True)
            pip = [str(home / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet"]
            subprocess.run([*pip, "--upgrade", "pip", *build_requirements()], check=True)
            # The project's own requirements with those pins: pip refuses when they conflict
            # (one bound below what another dependency needs, or no Python here it installs on).
            subprocess.run([*pip, "-c", str(home / "constraints.txt"), "--no-build-isolation",
                            "-e", f"{ROOT}[operator]", *tools], check=True)  # fmt: skip
            (home / ".editable").write_text(_editable_stamp())
            (home / ".installed").touch()
            _say(f"installed in {time.monotonic() - started:.0f} s")
    return home


def point_at_this_checkout(home: Path) -> None:
    """The venv's editable install of the project, this checkout's (a no-deps reinstall when the
    venv was made from another checkout, or pyproject.toml changed since)."""
    stamp = home / ".editable"
    if stamp.is_file() and stamp.read_text() == _editable_stamp():
        return
    python = str(home / "venv" / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "-e", str(ROOT)], check=True)  # fmt: skip
    stamp.write_text(_editable_stamp())


def _editable_stamp() -> str:
    return f"{ROOT}\n{hashlib.sha256(PYPROJECT.read_bytes()).hexdigest()}\n"


def main() -> int:
    started = time.monotonic()
    bounds, tools = lower_bounds(), tool_pins()
    home = ensure(bounds, tools)
    with (home.parent / ".min-versions.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one checkout's editable install at a time
        point_at_this_checkout(home)
        python = str(home / "venv" / "bin" / "python")
        frozen = subprocess.run([python, "-m", "pip", "list", "--format=freeze", "--exclude-editable"],
                                capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
        _say(f"the declared minimums: {' '.join(bounds)}")
        _say(f"the test tools (constraints.txt): {' '.join(tools)}")
        _say(f"installed, all {len(frozen)}: {' '.join(frozen)}")
        _say(f"and gpu-training-operator[operator], editable from {ROOT}")
        for path, why in IGNORED.items():
            _say(f"left out {path}: {why}")
        for node, why in DESELECTED.items():
            _say(f"deselected {node}: {why}")
        command = [python, "-m", "pytest", "-p", "no:cacheprovider", "tests/unit",
                   # pyproject.toml's asyncio_default_fixture_loop_scope: pytest-asyncio is not here
                   "-W", "ignore:Unknown config option:pytest.PytestConfigWarning",
                   *(f"--ignore={path}" for path in IGNORED), *(f"--deselect={node}" for node in DESELECTED)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        result = subprocess.run(command, cwd=ROOT, env=env, check=False)
        smoke = _smoke(python, env)
    failed = [f"pytest exit {result.returncode}"] if result.returncode else []
    failed += [smoke] if smoke else []
    verdict = f"FAILED ({'; '.join(failed)})" if failed else "passed"
    _say(f"{verdict} with {' '.join(bounds)} in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


def _smoke(python: str, env: dict[str, str]) -> str | None:
    """Kopf's part of the operator at the minimums (SMOKE); None when it holds, else why not."""
    with tempfile.TemporaryDirectory() as scratch:
        kubeconfig = Path(scratch) / "kubeconfig"
        kubeconfig.write_text(KUBECONFIG)
        done = subprocess.run([python, "-c", SMOKE], cwd=ROOT, capture_output=True, text=True, check=False,
                              env={**_outside_a_pod(env), "KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(ROOT / "tests")})  # fmt: skip
    if done.returncode != 0:
        return f"the Kopf smoke failed: {done.stderr.strip()[-2000:]}"
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if seen != SMOKE_EXPECTED:
        return f"the Kopf smoke saw {seen}, not {SMOKE_EXPECTED}"
    _say(f"Kopf smoke: the operator's handlers, startup settings, login and probe: {seen}")
    return None


def _outside_a_pod(env: dict[str, str]) -> dict[str, str]:
    """The login reads the kubeconfig, not a ServiceAccount, even when this job runs in a pod."""
    return {k: v for k, v in env.items() if not k.startswith("KUBERNETES_SERVICE_")}


if __name__ == "__main__":
    sys.exit(main())
