"""The operator image, built for real from images/operator.Dockerfile (unchanged) by BuildKit,
on the debootstrap stand-in for its base (:mod:`support.images.base`), as an OCI image archive
that a node's containerd imports (``ctr images import``).

Named as the chart deploys it by default (``image.repository`` at the chart's appVersion, which
is the release version), so a pod of the chart's Deployment finds it on a node without a pull.

Cached in ``<cache>/images/operator-<hash>.tar`` by the content of everything that goes into it:
the Dockerfile, every file its COPY lines take from the repository, the base's digest, the
BuildKit version and the image name. A second call costs milliseconds (it hashes about 80 small
files); an edit of operator/ rebuilds. BuildKit is given a context holding exactly those files
(not the repository, whose .venv alone is gigabytes), so the key covers all it can see.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import yaml

from support import buildcache
from support.images import base, buildkit
from support.node.images import ImageArchive, blob_path
from support.paths import ROOT
from support.plane import gobuild

DOCKERFILE: Final = ROOT / "images" / "operator.Dockerfile"
CHART: Final = ROOT / "charts" / "gpu-training-operator"
COLD_COST: Final = "measured 51 to 90 s on 2 cores at load 6 to 9, most of it pip's install"
# Derived files the build does not need: Python's bytecode caches, rewritten by every test run.
SKIPPED: Final = frozenset({"__pycache__"})
BUILD_FORMAT: Final = b"1"  # bump when _build changes what goes into the image (its options)


def chart_image() -> str:
    """The image the chart's Deployment runs by default: repository:tag, the tag defaulting to
    the chart's appVersion (templates/_helpers.tpl, ``gpuop.image``)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    image = values["image"]
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    return f"{image['repository'] or values['registry'] + '/operator'}:{image['tag'] or app_version}"


def pulls_bases() -> bool:
    """Whether a build pulls the Dockerfile's base from its registry (``BASE_IMAGES=pull``, where
    one can be reached: the release workflow) instead of the stand-in made here."""
    return os.environ.get("BASE_IMAGES", "") == "pull"


def operator_image(say: gobuild.Say = gobuild.say_on_stderr) -> ImageArchive:
    """The operator image as an OCI archive, built first when its inputs changed (cold: the
    base's and BuildKit's own cold costs once per machine, then :data:`COLD_COST`)."""
    name = chart_image()
    dockerfile = DOCKERFILE.read_text()
    (base_reference,) = _base_references(dockerfile)
    files = _context_files(dockerfile)
    parent = None if pulls_bases() else base.base_image(say)
    inputs = buildcache.key([
        dockerfile.encode(), name.encode(), buildkit.version().encode(),
        parent.digest.encode() if parent else b"pulled", BUILD_FORMAT,
        *(part for relative, path in files for part in (relative.encode(), _content(path))),
    ])  # fmt: skip

    def build(archive: Path) -> None:
        _build(archive, name, base_reference, files, parent, say)

    return ImageArchive(
        name, buildcache.ensure(buildcache.directory("images"), "operator", inputs, build, suffix=".tar")
    )


def _build(archive: Path, name: str, base_reference: str, files: list[tuple[str, Path]],
           parent: base.BaseImage | None, say: gobuild.Say) -> None:  # fmt: skip
    context = archive.with_name("context")
    for relative, path in files:
        (context / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, context / relative)
    with buildkit.running_buildkitd(say) as daemon:
        say(f"building {name} from {os.path.relpath(DOCKERFILE, ROOT)} with BuildKit {buildkit.version()} "
            f"on {base.NAME if parent else base_reference} ({COLD_COST})")  # fmt: skip
        started = time.monotonic()
        # FROM <the official image> resolves to the stand-in, by digest, from its layout.
        standin = [f"--oci-layout=base={parent.layout}",
                   f"--opt=context:{base_reference}=oci-layout://base@{parent.digest}"] if parent else []  # fmt: skip
        command = [
            *daemon.buildctl(), "build", "--progress=plain", "--frontend=dockerfile.v0",
            f"--local=context={context}", f"--local=dockerfile={DOCKERFILE.parent}",
            f"--opt=filename={DOCKERFILE.name}", *standin,
            f"--output=type=oci,dest={archive},name={name}",
        ]  # fmt: skip
        log = archive.with_name("buildctl.log")
        returncode = _run_reporting(command, log, say, started)
        if returncode != 0:
            # buildctl's own last word ("error: failed to solve: process ... exit code: 3") first.
            lines = log.read_text(errors="replace").splitlines()
            said = [line.removeprefix("error: ") for line in lines if line.startswith("error:")]
            cause = said[-1] if said else f"buildctl exited with {returncode}"
            raise RuntimeError(f"building {name} failed: {cause}\n-- buildctl:\n{_tail(log, 40)}\n"
                               f"-- buildkitd:\n{daemon.log_tail(15)}")  # fmt: skip
    archive.chmod(0o644)  # buildctl makes it writable by anyone
    say(f"built {name} in {time.monotonic() - started:.0f}s: {archive.stat().st_size / 1e6:.0f} MB")


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
        if image not in stages:
            references.append(image)
        if len(alias) == 2 and alias[0].upper() == "AS":
            stages.add(alias[1])
    return references


def _context_files(dockerfile: str) -> list[tuple[str, Path]]:
    """(path in the context, path here) of every file the COPY and ADD lines take from the
    build context, sorted; directories walked, :data:`SKIPPED` left out."""
    sources = []
    for arguments in _instructions(dockerfile, {"COPY", "ADD"}):
        if not any(argument.startswith("--from") for argument in arguments):
            sources += [argument for argument in arguments[:-1] if not argument.startswith("--")]
    files: dict[str, Path] = {}
    for source in sources:
        path = ROOT / source
        if not path.exists():
            raise RuntimeError(f"{os.path.relpath(DOCKERFILE, ROOT)} copies {source}, which is not in {ROOT}")
        walked = [path] if path.is_file() else sorted(_files_under(path))
        files |= {found.relative_to(ROOT).as_posix(): found for found in walked}
    # A .dockerignore beside the context or the Dockerfile goes with them: BuildKit applies it.
    for ignore in (ROOT / ".dockerignore", DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore")):
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
