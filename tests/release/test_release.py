"""``make release`` against a real registry (CNCF Distribution, :mod:`support.registry`): what it
pushes is what a user installs, and what it refuses it refuses with one line.

The release itself runs once per session (the ``released`` fixture, shared with the suites that
install the chart from it); these tests read back what it pushed, as a user's helm and a node's
containerd would, and install its packages as a user's pip would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import venv
from pathlib import Path

import pytest
import yaml

from support import oci
from support.fixtures import Released, cosign_key_pair
from support.paths import ROOT
from support.registry import Registry
from support.tools import cosign
from support.tools.helm import helm_binary

# This machine's name: a registry named so is spoken to over TLS (localhost would not be).
HOST = socket.gethostname()


def _helm(released: Released, *args: str) -> str:
    result = subprocess.run([str(helm_binary()), *args, *released.helm_chart()], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(
    ("image", "entrypoint", "user"), [("operator", ["gpuop"], "65532"), ("trainer", ["torchrun"], "1000")]
)
def test_each_image_is_in_the_registry_under_the_release_version(
    released: Released, image: str, entrypoint: list[str], user: str
) -> None:
    reference, _, digest = released.image(image).partition("@")
    target = oci.Reference.parse(reference)
    assert target.tag == released.version
    client = oci.Client(target.host, released.registry.ca)
    served, manifest = client.manifest(target.repository, target.tag)
    assert served == digest
    config = json.loads(client.blob(target.repository, manifest["config"]["digest"]))["config"]
    # The image its Dockerfile describes: its entrypoint, the non-root uid the chart expects.
    assert config["Entrypoint"] == entrypoint
    assert config["User"] == user
    # Every layer is there and whole (the registry checked each digest as it took it).
    for layer in manifest["layers"]:
        assert client.has_blob(target.repository, layer["digest"])


def test_the_chart_from_the_registry_names_this_releases_images(released: Released) -> None:
    values = yaml.safe_load(_helm(released, "show", "values"))
    assert values["registry"] == released.registry.address
    rendered = list(yaml.safe_load_all(_helm(released, "template", "gpuop", "--namespace", "gpuop-system")))
    (deployment,) = [doc for doc in rendered if doc and doc["kind"] == "Deployment"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"{released.registry.address}/operator:{released.version}"
    env = {item["name"]: item.get("value") for item in container["env"]}
    assert env["GPUOP_TRAINER_IMAGE"] == f"{released.registry.address}/trainer:{released.version}"
    chart = yaml.safe_load(_helm(released, "show", "chart"))
    assert chart["version"] == chart["appVersion"] == released.version
    # release.json names the chart by the digest the registry holds under the version.
    reference = released.chart.removeprefix("oci://")
    host, _, repository = reference.partition("/")
    digest, _ = oci.Client(host, released.registry.ca).manifest(repository, released.version)
    described = released.described["chart"]
    assert isinstance(described, dict)
    assert described["digest"] == digest


def test_dist_holds_the_packages_the_chart_and_the_notes(released: Released) -> None:
    names = sorted(path.name for path in released.dist.iterdir())
    version = released.version
    assert names == sorted([
        f"gpu-training-operator-{version}.tgz",
        f"gpu_training_operator-{version}-py3-none-any.whl", f"gpu_training_operator-{version}.tar.gz",
        f"gpuop_report-{version}-py3-none-any.whl", f"gpuop_report-{version}.tar.gz",
        "operator.spdx.json", "trainer.spdx.json", "release-notes.md", "release.json", "cosign.pub",
    ])  # fmt: skip
    files = released.described["files"]
    assert isinstance(files, dict)
    assert set(files) == set(names) - {"release.json"}
    assert (released.dist / "release-notes.md").read_text().strip()


def _cosign_verify(released: Released, image: str, public_key: Path) -> subprocess.CompletedProcess[str]:
    """``cosign verify`` of the image as pushed, as a user checks it before installing."""
    return subprocess.run(
        [str(cosign.ensure()), "verify", "--key", str(public_key), "--insecure-ignore-tlog=true",
         "--registry-cacert", str(released.registry.ca), released.image(image).replace(f":{released.version}@", "@")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("image", ["operator", "trainer"])
def test_each_image_is_signed_with_the_release_key_and_no_other(
    released: Released, image: str, tmp_path: Path
) -> None:
    """``make release COSIGN_KEY=...`` signed the image by its digest; ``cosign verify`` with the
    public key the release left in dist/ accepts it, and with another key refuses it."""
    verified = _cosign_verify(released, image, released.dist / "cosign.pub")
    assert verified.returncode == 0, verified.stderr
    (claim,) = json.loads(verified.stdout)
    digest = released.image(image).partition("@")[2]
    assert claim["critical"]["image"]["docker-manifest-digest"] == digest
    other = cosign_key_pair(tmp_path, "other", password="")
    refused = _cosign_verify(released, image, other.with_suffix(".pub"))
    assert refused.returncode != 0
    assert "signatures do not match" in refused.stderr, refused.stderr


def _venv(directory: Path) -> Path:
    venv.create(directory, with_pip=True)
    return directory / "bin"


def _run(*command: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, f"{command}: {result.stdout}\n{result.stderr}"
    return result


def test_the_cli_wheel_installs_and_works_without_torch(released: Released, tmp_path: Path) -> None:
    """A user's ``pip install`` of the wheel: the CLI's four dependencies come from the index,
    torch never (the trainer extra is not asked for)."""
    bin_ = _venv(tmp_path / "venv")
    (wheel,) = released.dist.glob("gpu_training_operator-*.whl")
    _run(bin_ / "pip", "install", "--quiet", "-c", ROOT / "constraints.txt", wheel)
    assert _run(bin_ / "gpuop", "--version").stdout.split()[-1] == released.version
    example = ROOT / "examples" / "first-training.yaml"
    assert _run(bin_ / "gpuop", "validate", "-f", example).returncode == 0
    rendered = yaml.safe_load(_run(bin_ / "gpuop", "render", "-f", example).stdout)
    assert rendered["kind"] == "PyTorchJob"
    assert _run(bin_ / "python", "-c", "import torch", check=False).returncode != 0


def test_the_report_wheel_installs_with_no_dependencies(released: Released, tmp_path: Path) -> None:
    bin_ = _venv(tmp_path / "venv")
    (wheel,) = released.dist.glob("gpuop_report-*.whl")
    # --no-index: had it any dependency, the install would fail here.
    _run(bin_ / "pip", "install", "--quiet", "--no-index", wheel)
    _run(bin_ / "python", "-c", "import gpureport; gpureport.report")


def _make_release(*variables: str, dist: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", "release", *variables, f"DIST={dist}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.parametrize(
    ("variables", "said"),
    [
        pytest.param([], "error: REGISTRY is not set: make release REGISTRY=host:port[/path]", id="no registry"),
        pytest.param(["REGISTRY=https://example.com"], "error: REGISTRY=https://example.com is not host[:port][/path]",
                     id="a URL"),
        pytest.param([f"REGISTRY={HOST}:1"], f"error: the registry {HOST}:1 cannot be reached", id="no registry there"),
        pytest.param(["REGISTRY=localhost:5000"], "error: REGISTRY=localhost:5000: helm talks plain HTTP to localhost",
                     id="localhost"),
        pytest.param(["REGISTRY=ghcr.io/Team"], "error: REGISTRY=ghcr.io/Team is not host[:port][/path] with a lowercase",
                     id="uppercase"),
        pytest.param(["VERSION=9.9.9", f"REGISTRY={HOST}:1"], "error: VERSION=9.9.9 is not pyproject.toml's version",
                     id="another version"),
    ],
)  # fmt: skip
def test_bad_input_stops_with_one_line_and_releases_nothing(
    variables: list[str], said: str, tmp_path: Path
) -> None:
    result = _make_release(*variables, dist=tmp_path / "dist")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(said), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "dist").exists()


@pytest.mark.parametrize(
    ("key", "password", "said"),
    [
        pytest.param(
            "missing.key", "x", "error: COSIGN_KEY={dir}/missing.key: no such file", id="no key file"
        ),
        pytest.param(
            "cosign.key", None, "error: COSIGN_KEY is set but COSIGN_PASSWORD is not", id="no password"
        ),
    ],
)
def test_a_signing_key_that_cannot_sign_stops_the_release_before_it_starts(
    key: str, password: str | None, said: str, tmp_path: Path
) -> None:
    (tmp_path / "cosign.key").write_text("a key\n")
    env = {name: value for name, value in os.environ.items() if name != "COSIGN_PASSWORD"}
    if password is not None:
        env["COSIGN_PASSWORD"] = password
    result = subprocess.run(["make", "-s", "release", f"REGISTRY={HOST}:1", f"COSIGN_KEY={tmp_path / key}",
                             f"DIST={tmp_path / 'dist'}"], cwd=ROOT, capture_output=True, text=True, env=env,
                            timeout=600)  # fmt: skip
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(said.format(dir=tmp_path)), result.stderr
    assert not (tmp_path / "dist").exists()


def test_a_dist_that_holds_something_else_is_never_emptied(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "mine.txt").write_text("not a release")
    result = _make_release(f"REGISTRY={HOST}:1", dist=dist)
    assert f"error: DIST={dist} holds files and no release.json" in result.stderr, result.stderr
    assert (dist / "mine.txt").read_text() == "not a release"


def test_a_registry_not_trusted_is_refused_before_anything_is_built(
    local_registry: Registry, tmp_path: Path
) -> None:
    result = _make_release(f"REGISTRY={local_registry.address}", dist=tmp_path / "dist")
    assert result.returncode != 0
    assert f"error: the registry {local_registry.address} is not trusted" in result.stderr
    assert "REGISTRY_CA" in result.stderr
    assert not (tmp_path / "dist").exists()


def test_the_operator_images_sbom_names_the_pushed_digest_and_what_the_image_holds(
    released: Released,
) -> None:
    document = json.loads((released.dist / "operator.spdx.json").read_text())
    assert document["spdxVersion"] == "SPDX-2.3"
    image, *contained = document["packages"]
    assert f"{image['name']}@{image['versionInfo']}" == released.image("operator")
    purls = {ref["referenceLocator"] for package in contained for ref in package["externalRefs"]}
    assert len(purls) == len(contained)  # each package named once, by its package URL
    pins = dict(
        line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line
    )
    # What the Dockerfile installs, at the versions CI pins, and ourselves; Debian's Python below.
    for name in ("kopf", "urllib3", "pyyaml"):
        assert f"pkg:pypi/{name}@{pins[name]}" in purls, sorted(purls)
    assert f"pkg:pypi/gpu-training-operator@{released.version}" in purls
    assert any(purl.startswith("pkg:deb/debian/python3@") for purl in purls), sorted(purls)
    # No torch, and no Kubernetes client: the operator reads its credentials itself.
    assert "pkg:pypi/torch@" not in " ".join(purls)
    assert "pkg:pypi/kubernetes@" not in " ".join(purls), sorted(purls)


def test_the_trainer_images_sbom_names_pypis_cuda_torch_and_our_trainer(released: Released) -> None:
    document = json.loads((released.dist / "trainer.spdx.json").read_text())
    image, *contained = document["packages"]
    assert f"{image['name']}@{image['versionInfo']}" == released.image("trainer")
    purls = {ref["referenceLocator"] for package in contained for ref in package["externalRefs"]}
    pins = dict(
        line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line
    )
    for name in ("torch", "torchvision", "scikit-learn", "obstore", "nvidia-ml-py"):
        assert f"pkg:pypi/{name}@{pins[name]}" in purls, sorted(purls)
    assert f"pkg:pypi/gpu-training-operator@{released.version}" in purls
    # PyPI's torch is the CUDA build: the CUDA runtime and NCCL come as wheels of their own.
    names = {purl.split("@")[0] for purl in purls}
    assert {"pkg:pypi/nvidia-nccl-cu13", "pkg:pypi/triton"} <= names, sorted(names)
    assert not names & {"pkg:pypi/kopf", "pkg:pypi/kubernetes"}  # the operator's stay out
    # A C compiler for torch.compile: Triton builds its CUDA launcher at the first compiled kernel.
    assert {"pkg:deb/debian/g++", "pkg:deb/debian/gcc", "pkg:deb/debian/libc6-dev"} <= names, sorted(names)
