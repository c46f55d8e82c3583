"""torch.compile for the built-in trainer: whether to compile, and the compile cache that spares
a training's later pods most of the compile.

Compiling ResNet-50 bf16 makes a step about 1.4x faster on an H100 or H200, but costs about 45 s
at a start with Inductor's caches empty and about 11 s with them filled (docs/benchmarks.md).
Every pod start pays it again (a restart, a preemption's resume, a Kueue re-admission, a lost
node), and a pod's caches live in its container. So the cache goes beside the checkpoints
(``settings.checkpoint_dir``, a volume or a bucket), which outlive the pod and follow the
training to another node: the first pod that compiles writes torch's portable cache artifacts
there (``torch.compiler.save_cache_artifacts()``: Inductor's and AOTAutograd's entries, the
Triton kernels and autotuning results, in one blob), and every later start loads them into its
own caches before compiling. ``TORCHINDUCTOR_CACHE_DIR`` pointed at the volume instead would
leave buckets out and have every rank of every pod write thousands of small files there.

The cache is keyed by what shapes the compiled code (:func:`cache_key`), and an entry is two
objects, as a checkpoint is: the blob, then a manifest that names it with its size, SHA-256 and
key, written last. Rank 0 alone reads and writes, and hands what it read to the other ranks, so
a per-pod emptyDir serves every pod. An entry that does not check out (a key of other settings,
a size or digest that differs, a blob torch refuses) is ignored with one log line: it costs a
compile, never the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist

from gputrain.contract import CompileMode, TrainerSettings
from gputrain.distributed import Cluster
from gputrain.storage import Location, open_location

log = logging.getLogger("gputrain")

CACHE_DIR: Final = "compile-cache"  # under the checkpoint directory; checkpoint listings skip it
_FORMAT: Final = 1

# The auto rule's figures, from ResNet-50 bf16 b256 on one H100 and one H200 (docs/benchmarks.md):
# a compiled step takes 1/1.4 of an eager one (1.41x and 1.44x measured), and compiling costs
# about 45 s with Inductor's caches empty and about 11 s with this cache's entry loaded. A
# smaller model compiles faster, so the rule errs towards eager for it: a run it leaves eager
# loses at most the speedup, one it compiles for nothing loses the whole compile.
COMPILED_SPEEDUP: Final = 1.4
COLD_COMPILE_SECONDS: Final = 45.0
WARM_COMPILE_SECONDS: Final = 11.0
# Eager steps timed before auto decides: the first carries cuDNN's autotuning (3.97 s of a
# 0.06 s step on the H200), so it is left out and the two after it are timed.
PROBE_STEPS: Final = 3


def c_compiler() -> str | None:
    """The C compiler Triton would build its CUDA launcher with, as Triton looks for one ($CC,
    then gcc, then clang); None when there is none. Triton 3.7 compiles that launcher
    (``cuda_utils``, from C source) at its first kernel launch in a process with an empty Triton
    cache, so without a compiler every compiled step on a GPU fails."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("gcc") or shutil.which("clang")


def fixed_choice(setting: bool | None, device_type: str, compiler: str | None) -> CompileMode | None:
    """The mode the settings and the machine decide alone; None: compiling can run here and
    the spec leaves it to :func:`pays` (compile: auto). ``True`` compiles wherever asked."""
    if setting is True:
        return "CompiledCacheMiss"  # until a cache entry is loaded
    if setting is False:
        return "EagerForced"
    if device_type != "cuda":
        return "EagerOnCpu"  # Inductor's C++ kernels ran the CNN slower than eager on 2 cores
    if compiler is None:
        return "EagerNoCompiler"
    return None


def pays(steps_left: int, eager_step_seconds: float, cache_warm: bool) -> bool:
    """Whether compiling wins back its cost within the run: the time the steps left save at
    :data:`COMPILED_SPEEDUP` against the compile, warm when this training's cache has an entry.
    ResNet-50 b256 on an H100 (0.064 s a step eager) breaks even at about 2,470 steps cold and
    about 600 warm."""
    saved = steps_left * eager_step_seconds * (1 - 1 / COMPILED_SPEEDUP)
    return saved > (WARM_COMPILE_SECONDS if cache_warm else COLD_COMPILE_SECONDS)


def cache_key(
    settings: TrainerSettings, world: int, device: torch.device, input_shape: tuple[int, ...]
) -> dict[str, str]:
    """What shapes the compiled code: torch's and Triton's versions, the model's definition and
    input, precision and memory format, the device (a GPU's model and compute capability), and
    whether DDP wraps it (its buckets split the graph). Not the world size beyond that: the
    graphs are the same at any size, so an elastic resize or a resume elsewhere keeps the entry."""
    models = Path(__file__).with_name("models.py").read_bytes()
    key = {
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
        "models": hashlib.sha256(models).hexdigest()[:16],
        "model": settings.model,
        "input": "x".join(map(str, input_shape)),
        "precision": settings.precision,
        "channels_last": str(settings.channels_last),
        "device": device.type,
        "ddp": str(world > 1),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        key["gpu"] = f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"
    return key


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def digest(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


class CompileCache:
    """The entries in ``<checkpoint dir>/compile-cache``: per key, ``<digest>.json`` naming
    ``<digest>-<token>.bin``. The token keeps two writers of one key (two trainings sharing a
    directory) from pairing one's manifest with the other's blob."""

    def __init__(self, where: Location | str) -> None:
        self.location = open_location(f"{where.rstrip('/')}/{CACHE_DIR}") if isinstance(where, str) else where

    def read(self, key: dict[str, str]) -> bytes | None:
        """The entry for ``key`` as written; None, with one log line, when there is none that
        checks out."""
        name = digest(key)
        try:
            if f"{name}.json" not in self.location.names():
                log.info("compile cache: no entry in %s for this training's key", self.location.uri)
                return None
            manifest = json.loads(self.location.read(f"{name}.json"))
            if manifest.get("format") != _FORMAT or manifest.get("key") != key:
                written = manifest.get("key") if isinstance(manifest.get("key"), dict) else {}
                differ = sorted(k for k in key.keys() | written.keys() if key.get(k) != written.get(k))
                raise ValueError(f"written for other settings ({', '.join(differ) or 'format'})")
            blob = self.location.read(str(manifest["blob"]))
            if len(blob) != manifest["size"] or hashlib.sha256(blob).hexdigest() != manifest["sha256"]:
                raise ValueError(f"{len(blob)} bytes whose size or SHA-256 differs from its manifest's")
        except Exception as exc:  # a corrupt entry or a store that fails: a compile, not the run
            log.warning("compile cache: entry %s/%s.json ignored: %s",
                        self.location.uri, name, _one_line(exc))  # fmt: skip
            return None
        return blob

    def write(self, key: dict[str, str], blob: bytes) -> bool:
        """Publish ``blob`` as the entry for ``key`` (blob, then manifest); False, with a
        warning, when the store refused."""
        name = digest(key)
        blob_name = f"{name}-{secrets.token_hex(4)}.bin"
        sha256 = hashlib.sha256(blob).hexdigest()
        manifest = {"format": _FORMAT, "key": key, "blob": blob_name, "size": len(blob), "sha256": sha256}
        try:
            self.location.write(blob_name, blob)
            self.location.write(f"{name}.json", json.dumps(manifest, sort_keys=True).encode())
            for old in self.location.names():  # earlier blobs of this key: no manifest names them now
                if old.startswith(f"{name}-") and old != blob_name:
                    self.location.delete(old)
        except Exception as exc:
            log.warning("compile cache: entry not written to %s: %s; training goes on",
                        self.location.uri, _one_line(exc))  # fmt: skip
            return False
        return True


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


@dataclass
class _Probe:
    """The eager steps auto times before it decides."""

    steps: int = 0
    since: float | None = None  # when the first (untimed) step was done
    seconds: float = 0.0


_EAGER_REASONS: Final = {
    "EagerForced": "forced by compile: false",
    "EagerOnCpu": "auto, on a CPU (slower compiled there)",
    "EagerNoCompiler": "auto, no C compiler for Triton's launcher ($CC, gcc, clang) in the image",
}


class ModelCompiler:
    """One rank's compile mode: fixed at the start where the settings and machine decide it,
    else (auto on a GPU) after :data:`PROBE_STEPS` eager steps, by rank 0 for every rank."""

    def __init__(self, settings: TrainerSettings, cluster: Cluster, key: dict[str, str],
                 say: Callable[[CompileMode], None]) -> None:  # fmt: skip
        self.cluster = cluster
        self.key = key
        self.cache = CompileCache(settings.checkpoint_dir)
        self.say = say  # tells the rank's outlets the mode, once known
        self.compiled = False
        self.steps_compiled = 0
        self.artifacts_kept = 0  # artifacts in the cache entry this process loaded or wrote
        self.probe: _Probe | None = None
        cuda = cluster.device.type == "cuda"
        compiler = c_compiler() if cuda else None
        self.mode: CompileMode | None = fixed_choice(settings.compile, cluster.device.type, compiler)
        if settings.compile is True and cuda and compiler is None:
            log.warning("compile: true on a GPU, but Triton finds no C compiler ($CC, gcc, clang) for its "
                        "launcher: the first compiled step fails; unset spec.training.compile (auto) or "
                        "use an image with gcc")  # fmt: skip

    def begin(self, module: Any) -> Any:
        """What the loop calls as its model from the first step: compiled where decided now."""
        if self.mode == "CompiledCacheMiss":
            shared = self._shared((self.mode, self._read_on_main()))
            return self._compile(module, "forced by compile: true", shared)
        if self.mode is None:
            self.probe = _Probe()
            log.info("compile: auto: timing %d eager steps to decide", PROBE_STEPS)
            return module
        log.info("compile: eager (%s)", _EAGER_REASONS[self.mode])
        self.say(self.mode)
        return module

    def step_done(self, steps_left: int, module: Any) -> Any | None:
        """After each optimizer step: the model to call from now on where it changes, else None."""
        if self.compiled:
            self.steps_compiled += 1
            if self.steps_compiled == 1:
                self.keep_new_artifacts()
            return None
        if self.probe is None:
            return None
        if self.cluster.device.type == "cuda":
            torch.cuda.synchronize(self.cluster.device)  # the clock counts the queued work
        now = time.perf_counter()
        probe = self.probe
        probe.steps += 1
        if probe.since is None:
            probe.since = now
        if probe.steps < PROBE_STEPS and steps_left > 0:
            return None
        self.probe = None
        eager = (now - probe.since) / max(probe.steps - 1, 1)
        return self._decide(steps_left, eager, module)

    def _decide(self, steps_left: int, eager_step_seconds: float, module: Any) -> Any | None:
        blob: bytes | None = None
        verdict = "EagerTooShort"
        if self.cluster.is_main and steps_left > 0:
            blob = self._read_on_main()
            if pays(steps_left, eager_step_seconds, cache_warm=blob is not None):
                verdict = "CompiledCacheMiss"
        verdict, blob = self._shared((verdict, blob if verdict != "EagerTooShort" else None))
        why = (f"auto: {steps_left} steps left at {eager_step_seconds:.3f} s eager, "
               f"{'warm' if blob is not None else 'cold'} compile")  # fmt: skip
        if verdict == "EagerTooShort":
            log.info("compile: eager (%s: the compile would not pay back)", why)
            self.mode = "EagerTooShort"
            self.say(self.mode)
            return None
        return self._compile(module, why, (verdict, blob))

    def _read_on_main(self) -> bytes | None:
        return self.cache.read(self.key) if self.cluster.is_main else None

    def _shared(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank: one reader of the store, one decision."""
        if not self.cluster.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _compile(self, module: Any, why: str, shared: tuple[CompileMode, bytes | None]) -> Any:
        blob = shared[1]
        self.mode = "CompiledCacheMiss"
        if blob is not None:
            try:
                info = torch.compiler.load_cache_artifacts(blob)
            except Exception as exc:  # torch's own format check: a blob of another torch, say
                log.warning("compile cache: entry not loaded: %s; compiling from scratch", _one_line(exc))
            else:
                self.mode = "CompiledCacheHit"
                self.artifacts_kept = _count(info)
        hit = self.mode == "CompiledCacheHit"
        log.info("compile: compiled, cache %s (%s)", "hit" if hit else "miss", why)
        self.compiled = True
        self.say(self.mode)
        return torch.compile(module)

    def keep_new_artifacts(self) -> None:
        """Rank 0 writes what this process compiled beyond the entry it loaded: after the first
        compiled step, and at each epoch's end (a smaller last batch compiles again)."""
        if not (self.compiled and self.cluster.is_main):
            return
        started = time.perf_counter()
        saved = torch.compiler.save_cache_artifacts()
        if saved is None or _count(saved[1]) <= self.artifacts_kept:
            return
        if self.cache.write(self.key, saved[0]):
            self.artifacts_kept = _count(saved[1])
            log.info("compile cache: entry written to %s/%s.json (%d artifacts, %.1f MB, %.2f s)",
                     self.cache.location.uri, digest(self.key), self.artifacts_kept, len(saved[0]) / 1e6,
                     time.perf_counter() - started)  # fmt: skip


def _count(info: Any) -> int:
    """Artifacts in torch's CacheInfo (None: none)."""
    artifacts = getattr(info, "artifacts", None) or {}
    return sum(len(names) for names in artifacts.values())
