"""cosign, Sigstore's signer of OCI images, built from its Go module (``tests/cosign/go.mod``) with
the ordinary ``go`` client.

``make release COSIGN_KEY=cosign.key`` signs each image it pushed with that key (the password in
``COSIGN_PASSWORD``, cosign's own variable) and leaves the public key in ``dist/cosign.pub``;
tests/release verifies the session's release with ``cosign verify`` as a user would. The release
workflow signs keyless instead (GitHub's OIDC identity), which needs Sigstore's public services.

    PYTHONPATH=tests python3 -m support.tools.cosign      # build (or find) it, print its path
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from support.paths import ROOT
from support.plane import gobuild

MODULE: Final = ROOT / "tests" / "cosign"
COSIGN: Final = "github.com/sigstore/cosign/v3"


def recipe() -> gobuild.Recipe:
    version = gobuild.required_version(MODULE, COSIGN)
    return gobuild.Recipe(
        name="cosign",
        module=MODULE,
        packages={"cosign": f"{COSIGN}/cmd/cosign"},
        label=f"cosign-{version}",
        cold_cost="measured 5.1 min on 2 cores with empty Go caches and the module sources downloaded "
        "(about 1 min more to download them)",
    )


def ensure() -> Path:
    """The cached cosign binary, built first when missing. Safe from several processes."""
    return gobuild.ensure(recipe()) / "cosign"


if __name__ == "__main__":
    sys.exit(gobuild.print_built(ensure))
