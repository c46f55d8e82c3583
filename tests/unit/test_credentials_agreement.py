"""Our kubeconfig reader finds what the kubernetes client's loader finds (the one the operator
used before it read credentials itself) in the same files: server, CA, client certificate,
TLS checks and token."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from gpuop.controller.credentials import from_kubeconfig


def test_the_kubernetes_clients_loader_reads_the_same_kubeconfig_alike(tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_text("CA")
    (tmp_path / "token").write_text("from-file")
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "inline",
        "clusters": [
            {"name": "inline", "cluster": {"server": "https://a:6443", "certificate-authority-data": base64.b64encode(b"CA").decode()}},
            {"name": "files", "cluster": {"server": "https://b", "certificate-authority": str(tmp_path / "ca.pem"),
                                          "insecure-skip-tls-verify": False}},
            {"name": "insecure", "cluster": {"server": "https://c", "insecure-skip-tls-verify": True}},
        ],
        "users": [
            {"name": "inline", "user": {"client-certificate-data": base64.b64encode(b"CERT").decode(),
                                        "client-key-data": base64.b64encode(b"KEY").decode()}},
            {"name": "token", "user": {"token": "t0k"}},
            {"name": "file", "user": {"tokenFile": str(tmp_path / "token")}},
        ],
        "contexts": [
            {"name": "inline", "context": {"cluster": "inline", "user": "inline"}},
            {"name": "files", "context": {"cluster": "files", "user": "token"}},
            {"name": "insecure", "context": {"cluster": "insecure", "user": "file"}},
        ],
    }  # fmt: skip
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(config))
    for context in ("inline", "files", "insecure"):
        theirs = k8s_client.Configuration()
        k8s_config.load_kube_config(config_file=str(path), context=context, client_configuration=theirs)  # type: ignore[no-untyped-call]
        ours = from_kubeconfig(str(path), context)
        assert ours.server == theirs.host, context
        assert ours.insecure == (not theirs.verify_ssl), context

        def read(name: str | None) -> bytes | None:
            return Path(name).read_bytes() if name else None

        assert read(ours.ca_file) == read(theirs.ssl_ca_cert), context
        assert read(ours.cert_file) == read(theirs.cert_file), context
        assert read(ours.key_file) == read(theirs.key_file), context
        header = theirs.get_api_key_with_prefix("BearerToken") or theirs.get_api_key_with_prefix(
            "authorization"
        )
        assert (f"Bearer {ours.bearer()}" if ours.bearer() else None) == header, context
