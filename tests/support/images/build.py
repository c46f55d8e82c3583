"""Our images, built for real from their Dockerfiles (unchanged) by BuildKit, on the debootstrap
stand-in for their base (:mod:`support.images.base`), as OCI image archives that ``make release``
pushes to a registry (:mod:`support.release`):

- :func:`operator_image`: images/operator.Dockerfile, named as the chart deploys it by default;
- :func:`trainer_image`: images/trainer.Dockerfile, the GPU trainer every training without a
  ``spec.image`` runs (PyPI's CUDA torch, which runs on a CPU node with gloo all the same).

Each is cached in ``<cache>/images/<name>-<hash>.tar`` by the content of everything that goes
into it: the Dockerfile, every file its COPY lines take from the repository, the base's digest,
the BuildKit version, the image name and the layers' compression (:data:`COMPRESSION`). A second call costs
milliseconds (it hashes about 80 small files); an edit of operator/ rebuilds. BuildKit is given a
context holding exactly those files (not the repository, whose .venv alone is gigabytes), so the
key covers all it can see.

The trainer's 4 GB of dependencies are a layer of their own, above our code's; BuildKit's layer
cache (``<cache>/images/trainer-layers-<hash>``, kept per base and constraints.txt) holds it, so a
change to our code rebuilds only the small layer and writes the archive again (see
:data:`TRAINER_COLD_COST`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml

from support import buildcache
from support.images import base, buildkit
from support.node.images import ImageArchive, blob_path
from support.paths import ROOT
from support.plane import gobuild
from support.registry import Registry

OPERATOR_DOCKERFILE: Final = ROOT / "images" / "operator.Dockerfile"
TRAINER_DOCKERFILE: Final = ROOT / "images" / "trainer.Dockerfile"
# A user's image FROM ours (examples/own-code.Dockerfile): the chain's custom-code trainings run it.
OWN_CODE_DOCKERFILE: Final = ROOT / "examples" / "own-code.Dockerfile"
OWN_CODE_REPOSITORY: Final = "team/own-code:1"
OWN_CODE_COLD_COST: Final = (
    "measured 125 s on 2 cores: the trainer image pulled and unpacked, Transformers installed, "
    "the new layers pushed"
)
CHART: Final = ROOT / "charts" / "gpu-training-operator"
CONSTRAINTS: Final = ROOT / "constraints.txt"
OPERATOR_COLD_COST: Final = "measured 51 to 90 s on 2 cores at load 6 to 9, most of it pip's install"
TRAINER_COLD_COST: Final = (
    "measured 4.2 min cold on 2 cores, 2 of them pip's download and install of torch; 2 min after a change to "
    "our code, the dependencies' layer taken from the layer cache"
)
# Derived files the build does not need: Python's bytecode caches, rewritten by every test run.
SKIPPED: Final = frozenset({"__pycache__"})
# zstd: the trainer's 5.4 GB of layers in half the bytes for the registry, the cache and every
# node's pull, at a few seconds of one core; gzip would take minutes. containerd (1.5 and later),
# CRI-O and Docker (23 and later) pull it.
COMPRESSION: Final = "zstd"
BUILD_FORMAT: Final = b"2"  # bump when _build changes what goes into the image (its options)


@dataclass(frozen=True)
class _Recipe:
    """One image: its Dockerfile, the name it is built under, what its cache entry is called."""

    dockerfile: Path
    name: str
    cached_as: str  # "operator": <cache>/images/operator-<hash>.tar
    cold_cost: str
    layer_cache: bool  # keep BuildKit's layer cache between builds (the trainer's 4 GB layer)


def chart_image() -> str:
    """The image the chart's Deployment runs by default: repository:tag, the tag defaulting to
    the chart's appVersion (templates/_helpers.tpl, ``gpuop.image``)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    image = values["image"]
    return f"{image['repository'] or values['registry'] + '/operator'}:{image['tag'] or _app_version()}"


def chart_trainer_image() -> str:
    """The trainer image a training without ``spec.image`` runs under the chart's defaults
    (templates/_helpers.tpl, ``gpuop.trainerImage``): ``<registry>/trainer:<appVersion>``."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return f"{values['registry']}/trainer:{_app_version()}"


def _app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def pulls_bases() -> bool:
    """Whether a build pulls the Dockerfile's base from its registry (``BASE_IMAGES=pull``, where
    one can be reached: the release workflow) instead of the stand-in made here."""
    return os.environ.get("BASE_IMAGES", "") == "pull"


def operator_image(say: gobuild.Say = gobuild.say_on_stderr) -> ImageArchive:
    """The operator image as an OCI archive, built first when its inputs changed (cold: the
    base's and BuildKit's own cold costs once per machine, then :data:`OPERATOR_COLD_COST`)."""
    return _image(_Recipe(OPERATOR_DOCKERFILE, chart_image(), "operator", OPERATOR_COLD_COST, False), say)


def trainer_image(say: gobuild.Say = gobuild.say_on_stderr) -> ImageArchive:
    """The GPU trainer image as an OCI archive, built first when its inputs changed (cold:
    :data:`TRAINER_COLD_COST`)."""
    return _image(_Recipe(TRAINER_DOCKERFILE, chart_trainer_image(), "trainer", TRAINER_COLD_COST, True), say)


def _image(recipe: _Recipe, say: gobuild.Say) -> ImageArchive:
    dockerfile = recipe.dockerfile.read_text()
    (base_reference,) = _base_references(dockerfile)
    files = _context_files(recipe.dockerfile, dockerfile)
    parent = None if pulls_bases() else base.base_image(say)
    base_digest = parent.digest.encode() if parent else b"pulled"
    compression = COMPRESSION
    inputs = buildcache.key([
        dockerfile.encode(), recipe.name.encode(), buildkit.version().encode(), base_digest, BUILD_FORMAT,
        compression.encode(), *(part for relative, path in files for part in (relative.encode(), _content(path))),
    ])  # fmt: skip
    root = buildcache.directory("images")
    # The layer cache lives as long as what decides the dependencies' layer: the base and the pins.
    layers = root / (
        f"{recipe.cached_as}-layers-"
        + buildcache.key(
            [base_digest, buildkit.version().encode(), compression.encode(), CONSTRAINTS.read_bytes()]
        )
    )

    def build(archive: Path) -> None:
        _build(archive, recipe, base_reference, files, parent, compression,
               layers if recipe.layer_cache else None, say)  # fmt: skip

    archive = buildcache.ensure(root, recipe.cached_as, inputs, build, suffix=".tar")
    if recipe.layer_cache:  # earlier bases' and pins' layers: gigabytes no build will read again
        for old in root.glob(f"{recipe.cached_as}-layers-*"):
            if old != layers:
                shutil.rmtree(old, ignore_errors=True)
    return ImageArchive(recipe.name, archive)


def _build(archive: Path, recipe: _Recipe, base_reference: str, files: list[tuple[str, Path]],
           parent: base.BaseImage | None, compression: str, layers: Path | None, say: gobuild.Say) -> None:  # fmt: skip
    context = archive.with_name("context")
    for relative, path in files:
        (context / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, context / relative)
    dockerfile = recipe.dockerfile
    with buildkit.running_buildkitd(say) as daemon:
        say(f"building {recipe.name} from {os.path.relpath(dockerfile, ROOT)} with BuildKit {buildkit.version()} "
            f"on {base.NAME if parent else base_reference} ({recipe.cold_cost})")  # fmt: skip
        started = time.monotonic()
        # FROM <the official image> resolves to the stand-in, by digest, from its layout.
        standin = [f"--oci-layout=base={parent.layout}",
                   f"--opt=context:{base_reference}=oci-layout://base@{parent.digest}"] if parent else []  # fmt: skip
        cache = []
        if layers is not None:
            if (layers / "index.json").is_file():
                cache.append(f"--import-cache=type=local,src={layers}")
            cache.append(f"--export-cache=type=local,dest={layers},mode=max,compression={compression}")
        command = [
            *daemon.buildctl(), "build", "--progress=plain", "--frontend=dockerfile.v0",
            f"--local=context={context}", f"--local=dockerfile={dockerfile.parent}",
            f"--opt=filename={dockerfile.name}", *standin, *cache,
            f"--output=type=oci,dest={archive},name={recipe.name},compression={compression},force-compression=true",
        ]  # fmt: skip
        _buildctl(daemon, command, archive.with_name("buildctl.log"), recipe.name, say, started)
    archive.chmod(0o644)  # buildctl makes it writable by anyone
    say(f"built {recipe.name} in {time.monotonic() - started:.0f}s: {archive.stat().st_size / 1e6:.0f} MB")


def own_code_image(registry: Registry, trainer: str, say: gobuild.Say = gobuild.say_on_stderr) -> str:
    """A team's own image as a user builds it on ours: examples/own-code.Dockerfile with
    ``TRAINER_IMAGE=trainer`` (a reference in ``registry``, which BuildKit pulls it from), pushed
    to ``registry`` as ``team/own-code:1``; that reference.

    Built again for each registry, not cached: it is the tests' stand-in for a user's build, and
    its base changes with every change to our trainer (cold: :data:`OWN_CODE_COLD_COST`)."""
    target = f"{registry.address}/{OWN_CODE_REPOSITORY}"
    with buildkit.running_buildkitd(say, trusted={registry.address: registry.ca}) as daemon:
        say(f"building {target} from {os.path.relpath(OWN_CODE_DOCKERFILE, ROOT)} on {trainer} "
            f"({OWN_CODE_COLD_COST})")  # fmt: skip
        started = time.monotonic()
        command = [
            *daemon.buildctl(), "build", "--progress=plain", "--frontend=dockerfile.v0",
            f"--local=context={OWN_CODE_DOCKERFILE.parent}", f"--local=dockerfile={OWN_CODE_DOCKERFILE.parent}",
            f"--opt=filename={OWN_CODE_DOCKERFILE.name}", f"--opt=build-arg:TRAINER_IMAGE={trainer}",
            f"--output=type=image,name={target},push=true,compression={COMPRESSION},force-compression=true",
        ]  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="gpuop-own-code-") as scratch:
            _buildctl(daemon, command, Path(scratch) / "buildctl.log", target, say, started)
    say(f"built and pushed {target} in {time.monotonic() - started:.0f}s")
    return target


def _buildctl(daemon: buildkit.Buildkitd, command: list[str], log: Path, name: str, say: gobuild.Say,
              started: float) -> None:  # fmt: skip
    """Run a ``buildctl build``; a failure raises with buildctl's own last word first ("failed
    to solve: process ... exit code: 3"), then the tails of its log and the daemon's."""
    returncode = _run_reporting(command, log, say, started)
    if returncode != 0:
        lines = log.read_text(errors="replace").splitlines()
        said = [line.removeprefix("error: ") for line in lines if line.startswith("error:")]
        cause = said[-1] if said else f"buildctl exited with {returncode}"
        raise RuntimeError(f"building {name} failed: {cause}\n-- buildctl:\n{_tail(log, 40)}\n"
                           f"-- buildkitd:\n{daemon.log_tail(15)}")  # fmt: skip


def _run_reporting(command: list[str], log: Path, say: gobuild.Say, started: float) -> int:
    """Run ``command`` with its output in ``log``, saying its latest step every 30 s."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        last_report, step = started, ""
        for line in process.stdout:
            out.write(line)
            if re.match(r"#\d+ \[", line):  # "#9 [4/8] RUN python -m pip install ...": a step starts
                step = line.strip()
            if time.monotonic() - last_report >= 30:
                last_report = time.monotonic()
                say(f"  {last_report - started:.0f}s (now {step[:100]})")
        return process.wait()


def _tail(log: Path, lines: int) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# -- what the Dockerfile takes ------------------------------------------------------------


def _instructions(dockerfile: str, wanted: set[str]) -> Iterator[list[str]]:
    """The arguments of each ``wanted`` instruction (FROM, COPY...), split as the Dockerfile
    parser does: a JSON array, or words; continuation lines joined."""
    for line in re.sub(r"\\\n", " ", dockerfile).splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() in wanted:
            rest = rest.strip()
            yield json.loads(rest) if rest.startswith("[") else shlex.split(rest)


def _base_references(dockerfile: str) -> list[str]:
    """The images FROM names (not earlier stages): each must be provided to the build."""
    stages: set[str] = set()
    references = []
    for arguments in _instructions(dockerfile, {"FROM"}):
        image, *alias = [argument for argument in arguments if not argument.startswith("--")]
        if image not in stages and image not in references:
            references.append(image)
        if len(alias) == 2 and alias[0].upper() == "AS":
            stages.add(alias[1])
    return references


def _context_files(path: Path, dockerfile: str) -> list[tuple[str, Path]]:
    """(path in the context, path here) of every file the COPY and ADD lines take from the
    build context, sorted; directories walked, :data:`SKIPPED` left out."""
    sources = []
    for arguments in _instructions(dockerfile, {"COPY", "ADD"}):
        if not any(argument.startswith("--from") for argument in arguments):
            sources += [argument for argument in arguments[:-1] if not argument.startswith("--")]
    files: dict[str, Path] = {}
    for source in sources:
        copied = ROOT / source
        if not copied.exists():
            raise RuntimeError(f"{os.path.relpath(path, ROOT)} copies {source}, which is not in {ROOT}")
        walked = [copied] if copied.is_file() else sorted(_files_under(copied))
        files |= {found.relative_to(ROOT).as_posix(): found for found in walked}
    # A .dockerignore beside the context or the Dockerfile goes with them: BuildKit applies it.
    for ignore in (ROOT / ".dockerignore", path.with_name(path.name + ".dockerignore")):
        if ignore.is_file():
            files[ignore.relative_to(ROOT).as_posix()] = ignore
    return sorted(files.items())


def _files_under(directory: Path) -> Iterator[Path]:
    for root, directories, names in os.walk(directory):
        directories[:] = [name for name in directories if name not in SKIPPED]
        yield from (Path(root) / name for name in names)


def _content(path: Path) -> bytes:
    """What of a file goes into the image: its bytes and whether it is executable."""
    return (b"x" if os.access(path, os.X_OK) else b"-") + path.read_bytes()


# -- reading an archive -------------------------------------------------------------------


def image_manifest(archive: Path) -> dict[str, Any]:
    """The OCI manifest of the one image in an OCI archive (``layers`` with their sizes)."""
    index = _json_member(archive, "index.json")
    return _json_member(archive, blob_path(index["manifests"][0]["digest"]))


def image_config(archive: Path) -> dict[str, Any]:
    """The OCI image configuration of the one image in an OCI archive (``config`` holds User,
    Entrypoint, Cmd, Env; ``rootfs`` the layers' digests)."""
    return _json_member(archive, blob_path(image_manifest(archive)["config"]["digest"]))


def _json_member(archive: Path, member: str) -> dict[str, Any]:
    with tarfile.open(archive) as tar:
        found = tar.extractfile(member)
        if found is None:
            raise RuntimeError(f"{archive} holds no file {member}")
        loaded: dict[str, Any] = json.load(found)
        return loaded
