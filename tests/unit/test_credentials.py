"""gpuop.controller.credentials: the ServiceAccount in a pod, a kubeconfig's context elsewhere,
tokens that rotate or expire, and one line naming what is wrong with a kubeconfig."""

from __future__ import annotations

import base64
import json
import stat
import sys
from pathlib import Path

import pytest
import yaml

from gpuop.controller import credentials
from gpuop.controller.credentials import CredentialsError, ExecToken, TokenFile, from_kubeconfig, in_cluster


def _kubeconfig(path: Path, cluster: dict[str, object], user: dict[str, object], name: str = "c") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": name,
        "clusters": [{"name": name, "cluster": cluster}], "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": "team-a"}}],
    }))  # fmt: skip
    return path


def test_in_a_pod_the_service_account_and_its_token_reread_every_minute(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("first\n")
    (tmp_path / "ca.crt").write_text("CA")
    (tmp_path / "namespace").write_text("ops")
    found = in_cluster(tmp_path, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert found is not None
    assert (found.server, found.in_cluster, found.ca_file, found.namespace) == (
        "https://10.96.0.1:443", True, str(tmp_path / "ca.crt"), "ops",
    )  # fmt: skip
    assert found.bearer() == "first"
    ipv6 = in_cluster(tmp_path, {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert ipv6 is not None
    assert ipv6.server == "https://[fd00::1]:443"
    # Outside a pod (no service variables, or no token mounted): not in a cluster.
    assert in_cluster(tmp_path, {}) is None
    assert (
        in_cluster(tmp_path / "none", {"KUBERNETES_SERVICE_HOST": "h", "KUBERNETES_SERVICE_PORT": "1"})
        is None
    )

    now = [0.0]
    token = TokenFile(tmp_path / "token", clock=lambda: now[0])
    assert token() == "first"
    (tmp_path / "token").write_text("rotated")
    now[0] = 59.0
    assert token() == "first"  # read at most once a minute
    now[0] = 60.0
    assert token() == "rotated"
    (tmp_path / "token").unlink()  # a rotation caught half-way: the last one read serves
    now[0] = 130.0
    assert token() == "rotated"


def test_a_kubeconfig_with_inline_certificates_and_a_token(tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path / "config", {
        "server": "https://api.example:6443/", "certificate-authority-data": base64.b64encode(b"CA").decode(),
        "tls-server-name": "kubernetes", "proxy-url": "http://proxy:3128",
    }, {
        "client-certificate-data": base64.b64encode(b"CERT").decode(),
        "client-key-data": base64.b64encode(b"KEY").decode(), "token": "t0k",
    })  # fmt: skip
    found = from_kubeconfig(str(path))
    assert (found.server, found.in_cluster, found.tls_server_name, found.proxy, found.namespace) == (
        "https://api.example:6443", False, "kubernetes", "http://proxy:3128", "team-a",
    )  # fmt: skip
    assert found.bearer() == "t0k"
    assert found.insecure is False
    for written, data in ((found.ca_file, b"CA"), (found.cert_file, b"CERT"), (found.key_file, b"KEY")):
        assert written is not None
        assert Path(written).read_bytes() == data
        # The key and certificate are credentials: only this process's user may read them.
        assert stat.S_IMODE(Path(written).parent.stat().st_mode) == 0o700


def test_files_named_relative_to_the_kubeconfig_and_the_first_file_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    first = _kubeconfig(tmp_path / "a" / "config", {"server": "https://first", "certificate-authority": "ca.pem"},
                        {"tokenFile": "token"})  # fmt: skip
    (tmp_path / "a" / "token").write_text("from-file\n")
    second = _kubeconfig(
        tmp_path / "second", {"server": "https://second", "insecure-skip-tls-verify": True}, {}
    )
    monkeypatch.setenv("KUBECONFIG", f"{first}:{second}")
    found = from_kubeconfig()
    assert found.server == "https://first"
    assert found.ca_file == str(tmp_path / "a" / "ca.pem")
    assert found.bearer() == "from-file"
    assert from_kubeconfig(f"{tmp_path / 'missing'}:{second}").insecure is True


@pytest.mark.parametrize(
    ("cluster", "user", "context", "says"),
    [
        ({"server": "https://x"}, {}, "other", "has no context 'other'"),
        ({}, {}, None, "the kubeconfig's cluster has no server"),
        ({"server": "https://x"}, {"auth-provider": {"name": "gcp"}}, None, "use a token, a client certificate or an exec plugin"),
        ({"server": "https://x", "certificate-authority-data": "not base64!"}, {}, None, "certificate-authority-data is not base64"),
    ],
)  # fmt: skip
def test_what_is_wrong_with_a_kubeconfig_is_one_line(
    tmp_path: Path, cluster: dict[str, object], user: dict[str, object], context: str | None, says: str
) -> None:
    path = _kubeconfig(tmp_path / "config", cluster, user)
    with pytest.raises(CredentialsError, match=says):
        from_kubeconfig(str(path), context)
    with pytest.raises(CredentialsError, match="cannot read the kubeconfig"):
        from_kubeconfig(str(tmp_path / "absent"))


PLUGIN = """import json, os, sys, pathlib
runs = pathlib.Path(sys.argv[1])
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
assert info["spec"]["interactive"] is False and os.environ["REGION"] == "eu"
if len(runs.read_text()) > 2:
    sys.exit("the cloud refuses")
print(json.dumps({"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                  "status": {"token": "tok-" + str(len(runs.read_text())), "expirationTimestamp": "2030-01-01T00:00:00Z"}}))
"""


def test_an_exec_plugin_is_run_again_when_its_token_expires(tmp_path: Path) -> None:
    (tmp_path / "plugin.py").write_text(PLUGIN)
    spec = {"apiVersion": "client.authentication.k8s.io/v1", "command": sys.executable,
            "args": [str(tmp_path / "plugin.py"), str(tmp_path / "runs")], "env": [{"name": "REGION", "value": "eu"}]}  # fmt: skip
    expires = 1893456000.0  # 2030-01-01T00:00:00Z
    now = [expires - 3600]
    token = ExecToken(spec, tmp_path, clock=lambda: now[0])
    assert token() == "tok-1"
    now[0] = expires - credentials.EXEC_TOKEN_MARGIN_SECONDS - 1
    assert token() == "tok-1"  # kept until shortly before it expires
    now[0] += 2
    assert token() == "tok-2"
    now[0] = expires + 1
    with pytest.raises(CredentialsError, match="exited 1: the cloud refuses"):
        token()
    # Through a kubeconfig, as EKS's, GKE's and AKS's are written.
    (tmp_path / "runs").unlink()
    path = _kubeconfig(tmp_path / "config", {"server": "https://x"}, {"exec": spec})
    assert from_kubeconfig(str(path)).bearer() == "tok-1"


def test_an_exec_plugin_that_is_not_there_says_how_to_install_it(tmp_path: Path) -> None:
    token = ExecToken({"command": "/nonexistent/aws", "installHint": "install the AWS CLI"}, tmp_path)
    with pytest.raises(CredentialsError, match=r"/nonexistent/aws: .*\(install the AWS CLI\)"):
        token()
    printing = tmp_path / "printing.py"
    printing.write_text("print(" + repr(json.dumps({"status": {}})) + ")")
    with pytest.raises(CredentialsError, match="gave no token"):
        ExecToken({"command": sys.executable, "args": [str(printing)]}, tmp_path)()
