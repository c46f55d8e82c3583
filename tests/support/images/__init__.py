"""The project's own container images, built for real on this machine: no Docker, no registry.

- :mod:`.buildkit`: BuildKit v0.34 (buildkitd, buildctl) from its Go module in tests/images, and a
  buildkitd that runs for one build on the real node's runc and leaves nothing behind.
- :mod:`.base`: the stand-in for the Dockerfile's ``FROM python:3.11.11-slim-bookworm`` (which
  cannot be pulled here): Debian bookworm made with debootstrap, Python in a venv at /usr/local.
- :mod:`.build`: the operator and trainer images from images/operator.Dockerfile and
  images/trainer.Dockerfile, unchanged, as OCI archives named as the chart's defaults name them
  (:func:`operator_image`, :func:`trainer_image`); and a team's own image on ours
  (examples/own-code.Dockerfile), pushed to a registry (:func:`own_code_image`).

They are kept in ``~/.cache/gpuop/images`` by :mod:`support.buildcache`'s rule (once per content,
whole or not at all).

``python -m support.images`` (from tests/) builds the operator and trainer images, or finds them,
and says where.

The rule: an image here is built from the repository's own Dockerfile and nothing else decides
what is in it; each is cached by a hash of everything that goes into it, so an edit rebuilds and
an unchanged tree costs milliseconds. This role uses ``plane`` (the Go builds) and ``node`` (runc,
the OCI archive format, daemons' processes and mounts); neither of them imports it.

Needs root (debootstrap, chroot, buildkitd). Cold, once per machine: BuildKit's build, the base
and the image (see each module's cold cost).
"""

from support.images.build import (
    chart_image,
    image_config,
    image_manifest,
    operator_image,
    own_code_image,
    trainer_image,
)

__all__ = [
    "chart_image",
    "image_config",
    "image_manifest",
    "operator_image",
    "own_code_image",
    "trainer_image",
]
