"""The trainer image the tests' pods run: a STAND-IN for ``ghcr.io/gpu-training-operator/trainer``,
assembled here from this machine's own environment, because neither of the real recipes can
run here:

- images/trainer.Dockerfile starts from ``pytorch/pytorch`` (a registry image; none is
  reachable here), and
- images/trainer-cpu.Dockerfile installs torch from PyTorch's CPU wheel index (its
  ``TORCH_INDEX_URL`` build argument), which is not reachable here either; PyPI's torch is the
  CUDA build, whose CUDA libraries a build would download again (about 3 GB).

So the image is the operator image's base (:mod:`support.images.base`, Debian's Python 3.11 in
a venv at ``/usr/local``) plus one layer holding, in that venv's site-packages, the files the
project's own ``.venv`` installed for the ``trainer`` extra and everything it needs (torch, its
CUDA libraries, torchvision, numpy, scikit-learn and its digits...), and our three packages from
the work tree; and, inert unless a pod's ``PYTHONPATH`` names it, the tests' pacing and holding
hook (:data:`TEST_SITE`, support/trainer_hold). The rest is what the Dockerfiles say: ``torchrun -m gputrain``, uid 1000 named
``trainer``, ``/home/trainer``. How it differs from the real image: Debian's Python 3.11.2 (not
3.11.11 or the pytorch image's conda Python), torch as PyPI's CUDA wheel (as the GPU image has
it, not the CPU wheel), and no ``triton`` (torch imports it only to compile kernels for a GPU;
0.7 GB).

Named :data:`NAME`, the operator's default trainer image, so a GpuTraining with no
``spec.image`` runs it.

The same archive holds a second image, :data:`OWN_CODE_NAME`: a STAND-IN for a user's own image,
the one the tests' custom-code trainings name in ``spec.image`` with their own command and args
(a team's image with Hugging Face Transformers and its programs in it). It is the trainer
image's layers (the same blobs, stored once) plus one small layer: in site-packages, the
distributions ``transformers`` and ``accelerate`` need that the trainer layer lacks (what the
Hugging Face Trainer of examples/hf-trainer runs), and the examples' programs at
``/workspace/hf-trainer/train.py`` and ``/workspace/plain-loop/train.py``, ``/workspace`` its
working directory, writable by uid 1000. No entrypoint: the spec gives the command.

Kept as an OCI archive in ``<cache>/images/trainer-<hash>.tar``, keyed by the base's digest,
every distribution's name, version and RECORD, our packages' files and the examples'. About
4.8 GB: a node imports it only where a test asks (``ctr images import`` imports both images).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import io
import json
import os
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from packaging.requirements import Requirement

from gpuop.api.identity import DEFAULT_TRAINER_IMAGE, PACKAGE_VERSION
from support import buildcache
from support.images import base
from support.node.images import PATH_ENV, ImageArchive, blob_path, image_index
from support.paths import ROOT
from support.plane import gobuild
from support.training import HOLD_SITE

NAME: Final = DEFAULT_TRAINER_IMAGE
# The second image, a user's own (see the module's docstring): a name no registry here serves.
OWN_CODE_NAME: Final = "registry.example.com/team/own-code:1"
DISTRIBUTION: Final = "gpu-training-operator"
EXTRA: Final = "trainer"
# The own-code image's: our dev extra's requirements of these, with what they need in turn.
OWN_CODE_EXTRA: Final = "dev"
OWN_CODE_NEEDS: Final = ("transformers", "accelerate")
# The examples' programs, at /workspace/<example>/train.py in the own-code image.
EXAMPLES: Final = {name: ROOT / "examples" / name / "train.py" for name in ("hf-trainer", "plain-loop")}
WORKSPACE: Final = "workspace"
# torch's own requirement, never imported by a CPU training (see the module's docstring).
LEFT_OUT: Final = frozenset({"triton"})
# Our packages, from the work tree: the .venv holds them as an editable install (a path hook).
PACKAGES: Final = {
    "gpuop": ROOT / "operator" / "gpuop",
    "gputrain": ROOT / "trainer" / "gputrain",
    "gpureport": ROOT / "trainer" / "report" / "gpureport",
}
SITE_PACKAGES: Final = "usr/local/lib/python3.11/site-packages"
# support.training's hooks, where a test's spec.env can put them on PYTHONPATH (pace_env).
TEST_SITE: Final = "/opt/gpuop-test/site"
UID: Final = 1000
HOME: Final = "home/trainer"
TORCHRUN: Final = (
    b"#!/usr/local/bin/python3\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n"
)
COLD_COST: Final = "about 30 s: 4.8 GB of files read and written once"
LAYER_MEDIA_TYPE: Final = "application/vnd.oci.image.layer.v1.tar"  # uncompressed: gzip of 4 GB costs minutes
FORMAT: Final = b"2"  # bump when the packing below changes what the archive holds


def trainer_image(say: gobuild.Say = gobuild.say_on_stderr) -> ImageArchive:
    """The stand-in as an OCI archive, assembled first when its inputs changed; the archive
    holds the own-code image (:data:`OWN_CODE_NAME`) too."""
    parent = base.base_image(say)
    distributions = _distributions(importlib.metadata.requires(DISTRIBUTION) or [], EXTRA)
    own_code = _own_code_distributions(distributions)
    ours = sorted(_our_files())
    hooks = sorted(_files_under(HOLD_SITE))
    examples = sorted((f"{WORKSPACE}/{name}/train.py", path) for name, path in EXAMPLES.items())
    inputs = buildcache.key([
        FORMAT, NAME.encode(), OWN_CODE_NAME.encode(), parent.digest.encode(), TORCHRUN,
        *(f"{d.metadata['Name']}=={d.version}".encode() + (d.read_text("RECORD") or "").encode()
          for d in distributions),
        b"own-code:",  # the own-code layer's distributions, apart from the trainer layer's
        *(f"{d.metadata['Name']}=={d.version}".encode() + (d.read_text("RECORD") or "").encode()
          for d in own_code),
        *(part for inside, path in ours + hooks + examples for part in (inside.encode(), path.read_bytes())),
    ])  # fmt: skip

    def build(archive: Path) -> None:
        started = time.monotonic()
        say(f"assembling the stand-ins {NAME} and {OWN_CODE_NAME} from this machine's .venv ({COLD_COST})")
        _assemble(archive, parent, distributions, ours, hooks, own_code, examples)
        say(f"assembled {NAME} and {OWN_CODE_NAME} in {time.monotonic() - started:.0f}s: "
            f"{archive.stat().st_size / 1e9:.2f} GB")  # fmt: skip

    path = buildcache.ensure(buildcache.directory("images"), "trainer", inputs, build, suffix=".tar")
    return ImageArchive(NAME, path)


# -- what goes in -------------------------------------------------------------------------


def _distributions(requirements: list[str], extra: str) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``requirements`` (with their markers read for ``extra``)
    need, transitively, :data:`LEFT_OUT` left out, sorted by name."""
    found: dict[str, importlib.metadata.Distribution] = {}
    expanded: set[tuple[str, str]] = set()
    wanted = [(text, extra) for text in requirements]
    while wanted:
        text, for_extra = wanted.pop()
        requirement = Requirement(text)
        name = _canonical(requirement.name)
        if requirement.marker and not requirement.marker.evaluate({"extra": for_extra}):
            continue
        if name in LEFT_OUT:
            continue
        if name not in found:
            found[name] = importlib.metadata.distribution(requirement.name)
        # A dependency's own extras: the ones its requirement names. Each (distribution, extra)
        # once: one met again with another extra may need more.
        for chosen in sorted(requirement.extras or {""}):
            if (name, chosen) not in expanded:
                expanded.add((name, chosen))
                wanted += [(needed, chosen) for needed in found[name].requires or []]
    return [found[name] for name in sorted(found)]


def _own_code_distributions(
    trainer: list[importlib.metadata.Distribution],
) -> list[importlib.metadata.Distribution]:
    """What the own-code image's layer adds: the distributions :data:`OWN_CODE_NEEDS` need
    (as our dev extra requires them), less those the trainer layer already has. The whole
    closure first, then the difference, so that a trainer distribution met with an extra of
    its own still brings what that extra needs."""
    requirements = [
        text for text in importlib.metadata.requires(DISTRIBUTION) or []
        if _canonical(Requirement(text).name) in OWN_CODE_NEEDS
    ]  # fmt: skip
    assert len(requirements) == len(OWN_CODE_NEEDS), (
        f"our {OWN_CODE_EXTRA} extra lacks one of {OWN_CODE_NEEDS}"
    )
    have = {_canonical(d.metadata["Name"]) for d in trainer}
    return [
        d for d in _distributions(requirements, OWN_CODE_EXTRA) if _canonical(d.metadata["Name"]) not in have
    ]


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _installed_files(distribution: importlib.metadata.Distribution) -> Iterator[tuple[str, Path]]:
    """(path under site-packages, path here) of what the distribution's RECORD lists there;
    its scripts (``../../../bin/...``) stay out: the image has its own ``torchrun``."""
    for file in distribution.files or []:
        relative = Path(str(file))
        if ".." in relative.parts:
            continue
        located = Path(str(file.locate()))
        if located.is_file():
            yield relative.as_posix(), located


def _our_files() -> Iterator[tuple[str, Path]]:
    """Our packages' files at their place in site-packages."""
    for package, source in PACKAGES.items():
        for inside, path in _files_under(source):
            yield f"{package}/{inside}", path


def _files_under(source: Path) -> Iterator[tuple[str, Path]]:
    """(path relative to ``source``, path here) of its files, bytecode caches left out."""
    for root, directories, names in os.walk(source):
        directories[:] = sorted(name for name in directories if name != "__pycache__")
        for name in sorted(names):
            path = Path(root) / name
            yield path.relative_to(source).as_posix(), path


# -- packing ------------------------------------------------------------------------------


class _Hashing:
    """A write-only file that counts and hashes what passes through it."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.digest, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.out.write(data)

    def tell(self) -> int:  # tarfile asks where it starts
        return self.size


def _assemble(
    archive: Path,
    parent: base.BaseImage,
    distributions: list[importlib.metadata.Distribution],
    ours: list[tuple[str, Path]],
    hooks: list[tuple[str, Path]],
    own_code: list[importlib.metadata.Distribution],
    examples: list[tuple[str, Path]],
) -> None:
    manifest = _blob_json(
        parent.layout, json.loads((parent.layout / "index.json").read_text())["manifests"][0]
    )
    config = _blob_json(parent.layout, manifest["config"])
    (base_layer,) = manifest["layers"]
    passwd, group = _base_accounts(parent.layout / blob_path(base_layer["digest"]))

    # The layers go straight into the archive, as its first members (the trainer's, then the
    # own-code image's), so the 4 GB are written once, not to a scratch file and then copied.
    with archive.open("w+b") as raw:
        trainer_layer = _streamed_layer(
            raw, lambda layer: _fill(layer, distributions, ours, hooks, passwd, group)
        )
        own_code_layer = _streamed_layer(raw, lambda layer: _fill_own_code(layer, own_code, examples))
        # The end-of-archive blocks, before which the other members are appended.
        raw.write(bytes(2 * tarfile.BLOCKSIZE))

    config["config"] = {
        "User": str(UID),
        "Env": [PATH_ENV, "PYTHONUNBUFFERED=1", f"HOME=/{HOME}", "LANG=C.UTF-8"],
        "WorkingDir": f"/{HOME}",
        "Entrypoint": ["torchrun"],
        "Cmd": ["--nproc-per-node=1", "-m", "gputrain"],
        "ExposedPorts": {"9090/tcp": {}, "23456/tcp": {}},
    }
    config["rootfs"]["diff_ids"].append(trainer_layer["digest"])  # uncompressed: its digest is its diff_id
    config["history"] = [*config.get("history", []),
                         {"created_by": "support.images.trainer (a stand-in assembled from the .venv)"}]  # fmt: skip
    layers = [base_layer, trainer_layer]
    trainer = _image(manifest, config, layers)

    # A user's image: ours beneath, and nothing of ours run unless the spec says so (its
    # command and args name the program).
    own_config = copy.deepcopy(config)
    own_config["config"] |= {"WorkingDir": f"/{WORKSPACE}", "Cmd": ["python3"]}
    del own_config["config"]["Entrypoint"]
    own_config["rootfs"]["diff_ids"].append(own_code_layer["digest"])
    own_config["history"].append(
        {"created_by": "support.images.trainer (a user's own image: Transformers and the examples)"}
    )
    own = _image(manifest, own_config, [*layers, own_code_layer])

    index = image_index(
        NAME, trainer.digest, len(trainer.manifest), (OWN_CODE_NAME, own.digest, len(own.manifest))
    )
    with tarfile.open(archive, "a") as out:  # after the layers
        _member(out, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        _member(out, "index.json", json.dumps(index, sort_keys=True).encode())
        for image in (trainer, own):
            _member(out, blob_path(image.digest), image.manifest)
            _member(out, blob_path(image.config_digest), image.config)
        out.add(parent.layout / blob_path(base_layer["digest"]), arcname=blob_path(base_layer["digest"]))


def _streamed_layer(raw: IO[bytes], fill: Callable[[tarfile.TarFile], None]) -> dict[str, Any]:
    """Write a layer (what ``fill`` adds) as the archive's next member; its descriptor. The
    member's header (which needs the layer's size and digest) is written over a placeholder
    once the layer is done, so the layer is written once and never held in memory."""
    start = raw.tell()
    raw.write(bytes(tarfile.BLOCKSIZE))
    hashing = _Hashing(raw)
    with tarfile.open(fileobj=hashing, mode="w", format=tarfile.PAX_FORMAT) as layer:  # type: ignore[call-overload]
        fill(layer)
    raw.write(bytes(-hashing.size % tarfile.BLOCKSIZE))  # the member's padding
    end = raw.tell()
    digest = f"sha256:{hashing.digest.hexdigest()}"
    header = tarfile.TarInfo(blob_path(digest))
    header.size = hashing.size
    raw.seek(start)
    raw.write(header.tobuf(format=tarfile.USTAR_FORMAT))
    raw.seek(end)
    return {"mediaType": LAYER_MEDIA_TYPE, "digest": digest, "size": hashing.size}


@dataclass(frozen=True)
class _Image:
    digest: str  # the manifest's
    manifest: bytes
    config_digest: str
    config: bytes


def _image(manifest: dict[str, Any], config: dict[str, Any], layers: list[dict[str, Any]]) -> _Image:
    """The base's manifest made to name ``config`` and ``layers``."""
    config_bytes = json.dumps(config, sort_keys=True).encode()
    config_digest = f"sha256:{hashlib.sha256(config_bytes).hexdigest()}"
    manifest = {
        **manifest,
        "config": {**manifest["config"], "digest": config_digest, "size": len(config_bytes)},
        "layers": layers,
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    return _Image(
        f"sha256:{hashlib.sha256(manifest_bytes).hexdigest()}", manifest_bytes, config_digest, config_bytes
    )


def _fill(
    layer: tarfile.TarFile,
    distributions: list[importlib.metadata.Distribution],
    ours: list[tuple[str, Path]],
    hooks: list[tuple[str, Path]],
    passwd: bytes,
    group: bytes,
) -> None:
    """The trainer layer: installed files keep their mtimes, so the bytecode pip compiled
    beside them stays valid (a torch import compiles nothing)."""
    files = _site_packages(distributions)
    files |= {f"{SITE_PACKAGES}/{inside}": path for inside, path in ours}
    files |= {f"{TEST_SITE.lstrip('/')}/{inside}": path for inside, path in hooks}
    made = {
        f"{SITE_PACKAGES}/gpu_training_operator-{PACKAGE_VERSION}.dist-info/METADATA":
            f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {PACKAGE_VERSION}\n".encode(),
        "usr/local/bin/torchrun": TORCHRUN,
        "etc/passwd": passwd + f"trainer:x:{UID}:{UID}::/{HOME}:/usr/sbin/nologin\n".encode(),
        "etc/group": group + f"trainer:x:{UID}:\n".encode(),
    }  # fmt: skip
    _write_entries(layer, files, made, executable="usr/local/bin/torchrun", owned=HOME)


def _fill_own_code(
    layer: tarfile.TarFile,
    distributions: list[importlib.metadata.Distribution],
    examples: list[tuple[str, Path]],
) -> None:
    """The own-code layer: ``/workspace`` is uid 1000's, so a program run there can write
    beside itself; the examples at mtime 0, so that the layer's digest follows their content
    alone."""
    made = {name: path.read_bytes() for name, path in examples}
    _write_entries(layer, _site_packages(distributions), made, executable=None, owned=WORKSPACE)


def _site_packages(distributions: list[importlib.metadata.Distribution]) -> dict[str, Path]:
    """Where in the image each installed file of ``distributions`` goes, and where it is here."""
    files: dict[str, Path] = {}
    for distribution in distributions:
        files |= {f"{SITE_PACKAGES}/{inside}": path for inside, path in _installed_files(distribution)}
    return files


def _write_entries(
    layer: tarfile.TarFile, files: dict[str, Path], made: dict[str, bytes], executable: str | None, owned: str
) -> None:
    """A layer's entries, sorted, root-owned but the directory ``owned`` (uid 1000's): the
    files copied from here, those ``made`` from bytes (mtime 0; 0644, ``executable`` 0755),
    and every directory above them."""
    directories = {parent.as_posix() for name in (*files, *made) for parent in Path(name).parents} - {"."}
    for name in sorted(directories | set(files) | set(made) | {owned}):
        if name == owned:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, UID, UID
            layer.addfile(info)
        elif name in made:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(made[name]), 0o755 if name == executable else 0o644
            layer.addfile(info, io.BytesIO(made[name]))
        elif name in files:
            _add_installed(layer, name, files[name])
        else:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            layer.addfile(info)


def _add_installed(layer: tarfile.TarFile, name: str, path: Path) -> None:
    """An installed file, root-owned, keeping its mode and mtime (see :func:`_fill`)."""
    info = layer.gettarinfo(str(path), arcname=name)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    with path.open("rb") as data:
        layer.addfile(info, data)


def _base_accounts(layer_blob: Path) -> tuple[bytes, bytes]:
    """The base's /etc/passwd and /etc/group, to which the trainer's account is added."""
    with tarfile.open(layer_blob) as layer:
        read = {}
        for name in ("etc/passwd", "etc/group"):
            member = layer.extractfile(name)
            assert member is not None, f"the base image has no {name}"
            read[name] = member.read()
    return read["etc/passwd"], read["etc/group"]


def _blob_json(layout: Path, descriptor: dict[str, str]) -> dict:  # type: ignore[type-arg]
    loaded: dict = json.loads((layout / blob_path(descriptor["digest"])).read_bytes())  # type: ignore[type-arg]
    return loaded


def _member(out: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))


if __name__ == "__main__":
    image = trainer_image()
    print(image.name, image.path, os.path.getsize(image.path))
