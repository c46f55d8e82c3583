"""Certificates for tests, made with the ``openssl`` CLI: a CA that signs serving and client
certificates (the real control plane's PKI, :mod:`support.plane.controlplane`), and a serving
directory laid out as a ``kubernetes.io/tls`` Secret mounted with its CA (``tls.crt``,
``tls.key``, ``ca.crt``: what the operator's report endpoint reads).

The certificates carry what a strict verifier asks for (Python 3.13's default
``VERIFY_X509_STRICT``, Go's ``crypto/x509``): a CA with critical basicConstraints and key
identifiers, leaves with an authority key identifier, a serverAuth or clientAuth usage and, for
servers, their names as subjectAltNames.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def openssl(*args: str, cwd: Path) -> None:
    """Run ``openssl`` in ``cwd``; RuntimeError with its stderr when it fails."""
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {result.stderr.strip()}")


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA in ``directory`` (``ca.crt``, ``ca.key``) and the certificates it issues there."""

    directory: Path

    @property
    def cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def key(self) -> Path:
        return self.directory / "ca.key"

    @classmethod
    def create(
        cls, directory: Path, common_name: str = "gpuop-test-ca", days: int = 3650
    ) -> CertificateAuthority:
        directory.mkdir(parents=True, exist_ok=True)
        openssl("req", "-x509", *_EC_KEY, "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
                "-subj", f"/CN={common_name}",
                "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                "-addext", "subjectKeyIdentifier=hash",
                cwd=directory)  # fmt: skip
        return cls(directory)

    def issue(
        self,
        name: str,
        common_name: str,
        *,
        organization: str | None = None,
        sans: Sequence[str] = (),
        days: int = 3650,
    ) -> tuple[Path, Path]:
        """A key and a certificate signed by this CA, as ``<name>.crt`` and ``<name>.key``:
        (cert, key). With ``sans`` (like "IP:127.0.0.1", "DNS:localhost") a serving
        certificate, without a client certificate."""
        subject = f"/CN={common_name}" + (f"/O={organization}" if organization else "")
        openssl("req", "-new", *_EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
                cwd=self.directory)  # fmt: skip
        extensions = self.directory / f"{name}.ext"
        usage = "serverAuth" if sans else "clientAuth"
        lines = ["basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment",
                 f"extendedKeyUsage={usage}", "subjectKeyIdentifier=hash", "authorityKeyIdentifier=keyid"]  # fmt: skip
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        extensions.write_text("\n".join(lines) + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", str(days), "-extfile", extensions.name, cwd=self.directory)  # fmt: skip
        return self.directory / f"{name}.crt", self.directory / f"{name}.key"


def serving_directory(
    directory: Path, *, ips: Sequence[str] = ("127.0.0.1",), dns_names: Sequence[str] = ("localhost",)
) -> Path:
    """A fresh CA and a serving certificate it signed for ``ips`` and ``dns_names``, written into
    ``directory`` as ``tls.crt``, ``tls.key`` and ``ca.crt`` (with the CA's key and openssl's
    scratch files beside them); returns ``directory``."""
    if not ips and not dns_names:
        raise ValueError("a serving certificate names at least one IP or DNS name")
    ca = CertificateAuthority.create(directory, common_name="gpuop-test-serving-ca", days=2)
    sans = [f"IP:{ip}" for ip in ips] + [f"DNS:{name}" for name in dns_names]
    ca.issue("tls", (list(dns_names) or list(ips))[0], sans=sans, days=2)
    return directory
