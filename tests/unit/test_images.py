"""The images agree with what runs in them: non-root uids the pods expect, pinned bases,
ports, and exactly the packages their code imports (docker build cannot run here)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import yaml

from gpuop.render import RUN_AS_USER
from gputrain.contract import METRICS_PORT, RENDEZVOUS_PORT
from support.crdschema import ROOT

IMAGES = sorted((ROOT / "images").glob("*.Dockerfile"))
TRAINER_IMAGES = [p for p in IMAGES if p.name.startswith("trainer")]
OPERATOR_IMAGE = ROOT / "images" / "operator.Dockerfile"
# pip distribution -> the module it provides
MODULE_OF = {
    "kopf": "kopf", "kubernetes": "kubernetes", "urllib3": "urllib3", "pyyaml": "yaml",
    "prometheus-client": "prometheus_client", "torch": "torch", "torchvision": "torchvision",
    "nvidia-ml-py": "pynvml", "scikit-learn": "sklearn", "numpy": "numpy",
}  # fmt: skip
# Modules a package imports that arrive with another one it installs.
COMES_WITH = {"numpy": "torch"}


def _instructions(dockerfile: Path, name: str) -> list[str]:
    text = dockerfile.read_text().replace("\\\n", " ")
    return re.findall(rf"^{name}\s+(.+)$", text, flags=re.MULTILINE)


def _third_party_imports(package: Path) -> set[str]:
    modules: set[str] = set()
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ("gpuop", "gputrain")}


def _installed(dockerfile: Path) -> set[str]:
    """Modules of the distributions the Dockerfile's pip installs name (flags and pins dropped)."""
    modules = set()
    for run in _instructions(dockerfile, "RUN"):
        for command in re.findall(r"pip install ([^&]+)", run):
            words = command.split()
            for i, word in enumerate(words):
                if word.startswith("-") or (i and words[i - 1] in ("-c", "--index-url")) or word == ".":
                    continue
                name = re.split(r"[<>=!~\[]", word.strip("\"'"))[0].lower()
                modules.add(MODULE_OF[name])
    return modules


def test_there_is_an_operator_a_gpu_trainer_and_a_cpu_trainer_image() -> None:
    assert [p.name for p in IMAGES] == ["operator.Dockerfile", "trainer-cpu.Dockerfile", "trainer.Dockerfile"]


@pytest.mark.parametrize("dockerfile", IMAGES, ids=[p.name for p in IMAGES])
def test_every_image_pins_its_base_and_runs_as_a_non_root_uid(dockerfile: Path) -> None:
    bases = [line.split()[0] for line in _instructions(dockerfile, "FROM")]
    assert bases
    for base in bases:
        name, _, tag = base.rpartition(":")
        assert name, f"{base}: pin the base image by tag"
        assert tag not in ("", "latest"), f"{base}: pin the base image by tag"
        assert re.search(r"\d", tag), f"{base}: pin a version, not a moving tag"
    users = _instructions(dockerfile, "USER")
    assert users, "set a USER: images run as root otherwise"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), "a numeric uid, so runAsNonRoot can verify it"
    assert int(uid) > 0, "a non-root uid"


@pytest.mark.parametrize("dockerfile", TRAINER_IMAGES, ids=[p.name for p in TRAINER_IMAGES])
def test_trainer_image(dockerfile: Path) -> None:
    assert _instructions(dockerfile, "USER")[-1] == str(RUN_AS_USER), "the uid the pod securityContext sets"
    exposed = {int(p) for line in _instructions(dockerfile, "EXPOSE") for p in line.split()}
    assert {METRICS_PORT, RENDEZVOUS_PORT} <= exposed
    assert _instructions(dockerfile, "ENTRYPOINT") == ['["torchrun"]']
    needed = _third_party_imports(ROOT / "trainer" / "gputrain")
    installed = _installed(dockerfile)
    if dockerfile.name == "trainer.Dockerfile":  # the CUDA base image brings torch and torchvision
        installed |= {"torch", "torchvision"}
    assert needed - {m for m in needed if COMES_WITH.get(m) in installed} <= installed
    assert installed <= needed  # nothing the trainer does not import: no kopf, no kubernetes


def test_operator_image_installs_exactly_what_the_operator_imports() -> None:
    assert _installed(OPERATOR_IMAGE) == _third_party_imports(ROOT / "operator" / "gpuop")  # so no torch


def test_operator_image_matches_the_chart() -> None:
    chart = ROOT / "charts" / "gpu-training-operator"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    assert _instructions(OPERATOR_IMAGE, "USER") == ["65532"]
    assert "runAsUser: 65532" in (chart / "templates" / "deployment.yaml").read_text()
    exposed = {int(p) for line in _instructions(OPERATOR_IMAGE, "EXPOSE") for p in line.split()}
    assert exposed == {values["metrics"]["port"], values["health"]["port"]}
    assert _instructions(OPERATOR_IMAGE, "ENTRYPOINT") == ['["gpuop"]']
    assert _instructions(OPERATOR_IMAGE, "CMD") == ['["operator"]']
