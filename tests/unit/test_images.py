"""The images agree with what runs in them: non-root uids the pods expect, pinned bases,
ports, and exactly the packages their code imports (BuildKit builds them in tests/release)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuop.api.identity import DEFAULT_TRAINER_IMAGE, TRAINER_IMAGE_REPOSITORY
from gpuop.api.podspec import SecurityContext
from gputrain.contract import METRICS_PORT, RENDEZVOUS_PORT
from support.paths import ROOT

IMAGES = sorted((ROOT / "images").glob("*.Dockerfile"))
TRAINER_IMAGES = [p for p in IMAGES if p.name.startswith("trainer")]
OPERATOR_IMAGE = ROOT / "images" / "operator.Dockerfile"
# pip distribution -> the module it provides
MODULE_OF = {
    "kopf": "kopf", "kubernetes": "kubernetes", "urllib3": "urllib3", "pyyaml": "yaml",
    "prometheus-client": "prometheus_client", "torch": "torch", "torchvision": "torchvision",
    "nvidia-ml-py": "pynvml", "scikit-learn": "sklearn", "numpy": "numpy", "click": "click", "rich": "rich",
    "obstore": "obstore",
}  # fmt: skip
# Imported only by a command an image does not run, from an optional extra: `gpuop run --plot`
# (matplotlib) is for laptops, not the operator's pod.
OPTIONAL_EXTRAS = {"matplotlib"}
# Modules a package imports that arrive with another one it installs.
COMES_WITH = {"numpy": "torch"}


def _instructions(dockerfile: Path, name: str) -> list[str]:
    text = dockerfile.read_text().replace("\\\n", " ")
    return re.findall(rf"^{name}\s+(.+)$", text, flags=re.MULTILINE)


def _third_party_imports(package: Path) -> set[str]:
    modules: set[str] = set()
    for source in package.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return {
        m
        for m in modules
        if m not in sys.stdlib_module_names and m not in ("gpuop", "gputrain", "gpureport", *OPTIONAL_EXTRAS)
    }


def _installed(dockerfile: Path) -> set[str]:
    """Modules of the distributions the Dockerfile's pip installs name (flags and pins dropped)."""
    modules = set()
    for run in _instructions(dockerfile, "RUN"):
        for command in re.findall(r"pip install ([^&]+)", run):
            words = command.split()
            for i, word in enumerate(words):
                if (
                    word.startswith("-")
                    or (i and words[i - 1] in ("-c", "--index-url", "--root"))
                    or word == "."
                ):
                    continue
                name = re.split(r"[<>=!~\[]", word.strip("\"'"))[0].lower()
                modules.add(MODULE_OF[name])
    return modules


@pytest.mark.parametrize("dockerfile", IMAGES, ids=[p.name for p in IMAGES])
def test_every_package_an_image_installs_is_pinned(dockerfile: Path) -> None:
    """An image built next month gets what CI tested: each pip install pins its packages with
    == or takes them from constraints.txt (which pins every one it names)."""
    pinned = {
        line.split("==")[0].strip().lower()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    }
    for run in _instructions(dockerfile, "RUN"):
        for command in re.findall(r"pip install ([^&]+)", run):
            words = command.split()
            with_constraints = "-c" in words
            for i, word in enumerate(words):
                if (
                    word.startswith("-")
                    or (i and words[i - 1] in ("-c", "--index-url", "--root"))
                    or word == "."
                ):
                    continue
                name = word.strip("\"'")
                if "==" in name:
                    continue
                assert with_constraints, f"{dockerfile.name}: {name} is not pinned (== or -c constraints.txt)"
                assert name.lower() in pinned, f"{dockerfile.name}: constraints.txt does not pin {name}"


def test_there_is_an_operator_a_gpu_trainer_and_a_cpu_trainer_image() -> None:
    assert [p.name for p in IMAGES] == ["operator.Dockerfile", "trainer-cpu.Dockerfile", "trainer.Dockerfile"]


@pytest.mark.parametrize("dockerfile", IMAGES, ids=[p.name for p in IMAGES])
def test_every_image_pins_its_base_and_runs_as_a_non_root_uid(dockerfile: Path) -> None:
    froms = [line.split() for line in _instructions(dockerfile, "FROM")]
    stages = {words[2] for words in froms if len(words) == 3 and words[1].upper() == "AS"}
    bases = [words[0] for words in froms if words[0] not in stages]  # FROM <an earlier stage> pins nothing
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
    default_user = SecurityContext().run_as_user
    assert _instructions(dockerfile, "USER")[-1] == str(default_user), (
        "the uid spec.securityContext defaults to"
    )
    exposed = {int(p) for line in _instructions(dockerfile, "EXPOSE") for p in line.split()}
    assert {METRICS_PORT, RENDEZVOUS_PORT} <= exposed
    assert _instructions(dockerfile, "ENTRYPOINT") == ['["torchrun"]']
    needed = _third_party_imports(ROOT / "trainer" / "gputrain")
    installed = _installed(dockerfile)
    assert needed - {m for m in needed if COMES_WITH.get(m) in installed} <= installed
    assert installed <= needed  # nothing the trainer does not import: no kopf, no kubernetes


def test_operator_image_installs_exactly_what_the_operator_imports() -> None:
    assert _installed(OPERATOR_IMAGE) == _third_party_imports(ROOT / "operator" / "gpuop")  # so no torch


def test_operator_image_matches_the_chart() -> None:
    chart = ROOT / "charts" / "gpu-training-operator"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    assert _instructions(OPERATOR_IMAGE, "USER") == ["65532"]
    assert values["podSecurityContext"]["runAsUser"] == 65532
    exposed = {int(p) for line in _instructions(OPERATOR_IMAGE, "EXPOSE") for p in line.split()}
    assert exposed == {values["metrics"]["port"], values["health"]["port"]}
    assert _instructions(OPERATOR_IMAGE, "ENTRYPOINT") == ['["gpuop"]']
    assert _instructions(OPERATOR_IMAGE, "CMD") == ['["operator"]']


def test_the_release_workflow_publishes_what_the_chart_and_operator_name() -> None:
    """A tag runs `make release` against the registry the chart's defaults name (the operator and
    trainer images, the chart, the packages) and builds the trainer's variants under the names
    the examples use, all with the one version."""
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yaml").read_text())
    assert workflow[True]["push"]["tags"] == ["v*"]  # YAML 1.1 reads the key `on` as True
    registry = workflow["env"]["REGISTRY"]
    jobs = workflow["jobs"]
    chart = ROOT / "charts" / "gpu-training-operator"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    assert registry == values["registry"]
    assert values["image"]["repository"] == ""  # so the operator image is <registry>/operator
    assert f"{registry}/trainer" == TRAINER_IMAGE_REPOSITORY
    (make,) = [s["run"] for s in jobs["release"]["steps"] if "make release" in s.get("run", "")]
    assert 'REGISTRY="$REGISTRY"' in make
    assert 'VERSION="$VERSION"' in make
    assert jobs["release"]["env"]["VERSION"] == "${{ needs.version.outputs.version }}"
    # Published only once every image is pushed: the GitHub release comes after the variants'.
    assert set(jobs["release"]["needs"]) == {"version", "trainer-variants"}
    matrix = {
        m["image"] + m.get("suffix", ""): m for m in jobs["trainer-variants"]["strategy"]["matrix"]["include"]
    }
    # The plain trainer is `make release`'s (tests/support/release.py), never pushed twice.
    assert {name: m["dockerfile"] for name, m in matrix.items()} == {
        "trainer-cpu": "images/trainer-cpu.Dockerfile",
        "trainer-efa": "images/trainer.Dockerfile",
    }
    # The EFA example names the variant the release builds, with AWS's installer in it.
    assert matrix["trainer-efa"]["build-args"].startswith("EFA_INSTALLER_VERSION=")
    assert "ARG EFA_INSTALLER_VERSION" in (ROOT / "images" / "trainer.Dockerfile").read_text()
    efa_example = yaml.safe_load((ROOT / "examples" / "eks-p5-efa.yaml").read_text())
    assert efa_example["spec"]["image"] == DEFAULT_TRAINER_IMAGE + matrix["trainer-efa"]["suffix"]
    for m in matrix.values():
        assert (ROOT / m["dockerfile"]).is_file()
    (build,) = [
        s
        for s in jobs["trainer-variants"]["steps"]
        if s.get("uses", "").startswith("docker/build-push-action")
    ]
    assert (
        build["with"]["tags"]
        == "${{ env.REGISTRY }}/${{ matrix.image }}:${{ needs.version.outputs.version }}${{ matrix.suffix }}"
    )
    version_script = next(s["run"] for s in jobs["version"]["steps"] if "run" in s)
    assert "make -s version" in version_script
    # `make version` prints pyproject's version, which the chart's appVersion and version carry too.
    printed = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "version"], capture_output=True, text=True, check=True
    )
    chart_meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    assert printed.stdout.strip() == chart_meta["appVersion"] == chart_meta["version"]


def test_the_own_code_example_builds_on_our_trainer_with_the_versions_ci_tests() -> None:
    """examples/own-code.Dockerfile, the team image the chain's custom-code trainings run:
    FROM our trainer image of this version, what it adds pinned as constraints.txt pins it, and
    the trainer's non-root uid at the end."""
    dockerfile = ROOT / "examples" / "own-code.Dockerfile"
    assert _instructions(dockerfile, "ARG") == [f"TRAINER_IMAGE={DEFAULT_TRAINER_IMAGE}"]
    assert _instructions(dockerfile, "FROM") == ["${TRAINER_IMAGE}"]
    pins = dict(
        line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line
    )
    (command,) = [
        found for run in _instructions(dockerfile, "RUN") for found in re.findall(r"pip install (.+)", run)
    ]
    added = dict(word.split("==") for word in command.split() if "==" in word)
    assert added == {name: pins[name] for name in added}
    assert set(added) == {"transformers", "accelerate"}
    assert _instructions(dockerfile, "USER")[-1] == str(SecurityContext().run_as_user)
