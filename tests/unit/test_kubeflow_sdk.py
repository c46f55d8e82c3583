"""The Kubeflow SDK and Hugging Face Transformers beside us, in the same Python.

A training image may hold the Kubeflow SDK (``kubeflow`` 0.5.0 on PyPI, which pins
``kubernetes<36``), Transformers and our packages at once. Here the SDK is installed once, with
what it pulls in, into a cache of its own (pip's ``--target``, first on the path of this venv's
Python, so that its kubernetes 35 shadows the venv's), and:

- the operator imports and drives the API emulator through :meth:`Kube.login` (a kubeconfig
  loaded by the SDK's client): discovery, create, a 409, merge patch, get, a status patch, a
  labelled list;
- the SDK's own ``update_trainjob_status()`` reports to our endpoints: ``gpuop run``'s loopback
  one (plain HTTP, which the SDK posts to as it is: it checks no scheme, and with no CA variable
  it verifies with the system's trust, which plain HTTP never asks) and the operator's TLS one
  with the CA Kubeflow's controller names in ``KUBEFLOW_TRAINER_SERVER_CA_CERT``. With that
  variable missing, the SDK falls back to the system's trust, the handshake fails, and it
  returns False without raising: nothing lands in the book;
- Transformers imports with the SDK and our packages, and its Kubeflow integration switches on
  from our endpoint's variables alone.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuop.api.identity import REPORT_CA_ENV, REPORT_TOKEN_ENV, REPORT_URL_ENV, report_path
from gpuop.local.runreports import LocalGate, serving
from gpuop.observing.endpoint import TLS_CA, ReportBook, ReportServer
from gpuop.observing.records import ReceivedReport
from support.emulator.server import ApiServer, RunningApiServer
from support.plane.gobuild import cache_root
from support.tls import serving_directory

SDK_VERSION = "0.5.0"
# The kubernetes client kubeflow 0.5.0 resolves to (it requires kubernetes>=27.2.0,<36).
SDK_KUBERNETES = "35.0.0"

# Variables that would change where the SDK's requests go or what they trust: a proxy would
# take loopback traffic elsewhere, a CA bundle would stand in for the missing CA case's
# system trust. The subprocesses run without them.
_UNSET = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", REPORT_URL_ENV, REPORT_CA_ENV,
          REPORT_TOKEN_ENV, "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY",
          "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "DISABLE_KUBEFLOW_INTEGRATION")  # fmt: skip


def _sdk() -> Path:
    """kubeflow==SDK_VERSION with its dependencies, installed once per Python version.

    Measured 2026-11 on a 2-core machine with a `make test` beside it (load average 12): cold,
    pip's own cache empty (--no-cache-dir), 31 s, 6 s from pip's cache, 75 MB; warm (the
    directory there) one stat. This file's five tests took 112 s cold, 36 to 57 s warm (load 10
    to 13), 15 to 38 s of it the Transformers test's Python importing torch (7 s of CPU).
    """
    target = (
        cache_root() / "kubeflow-sdk" / f"{SDK_VERSION}-py{sys.version_info.major}{sys.version_info.minor}"
    )
    if not (target / "kubeflow" / "trainer" / "__init__.py").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(partial), f"kubeflow=={SDK_VERSION}"],
            check=True, timeout=600,
        )  # fmt: skip
        if not target.exists():  # another process may have finished first
            partial.rename(target)
    return target


def _run(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> tuple[Any, str]:
    """The script's last line of output as JSON (and its stderr), run by this venv's Python with
    the SDK first on its path."""
    base = {k: v for k, v in os.environ.items() if k not in _UNSET}
    path = os.pathsep.join([str(_sdk()), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**base, **(env or {}), "PYTHONPATH": path}, capture_output=True, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture
def emulator() -> Iterator[RunningApiServer]:
    with RunningApiServer(ApiServer()) as running:
        yield running


OPERATOR = """
import json, sys
from kubeflow.trainer import TrainerClient  # the SDK first, as a training image would
import kubernetes
from gpuop.controller import app  # Kopf and the operator's wiring
from gpuop.controller.apiclient import ApiError, Backoff
from gpuop.controller.kube import Kube

kube = Kube.login()  # the kubeconfig, read by the SDK's kubernetes client
kube.backoff = Backoff(attempts=2, base_seconds=0.001)
seen = {"client": kubernetes.__version__, "client_file": kubernetes.__file__, "sdk": TrainerClient.__module__,
        "in_cluster": kube.in_cluster, "app": app.run_operator.__name__}
seen["served"] = sorted(kube.served_resources("kubeflow.org/v1"))
job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
       "metadata": {"name": "j", "namespace": "default", "labels": {"gpuop.io/gputraining": "t"}}, "spec": {}}
seen["created"] = kube.create_object(job, "pytorchjobs")["metadata"]["name"]
try:
    kube.create_object(job, "pytorchjobs")
except ApiError as exc:
    seen["again"] = exc.status
seen["patched"] = kube.patch_object("kubeflow.org/v1", "pytorchjobs", "default", "j",
                                    {"spec": {"runPolicy": {"suspend": True}}})["spec"]["runPolicy"]
seen["got"] = kube.get_object("kubeflow.org/v1", "pytorchjobs", "default", "j")["spec"]["runPolicy"]
kube.create_object({"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining",
                    "metadata": {"name": "t", "namespace": "default"}, "spec": {}}, "gputrainings")
seen["status"] = (kube.patch_training_status("default", "t", {"status": {"phase": "Running"}}) or {})["status"]
pod = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "p", "namespace": "default", "labels": {"gpuop.io/gputraining": "t"}}, "spec": {}}
kube._request("POST", "/api/v1/namespaces/default/pods", body=pod)
seen["pods"] = [p["metadata"]["name"] for p in kube.list_training_pods("default")]
print(json.dumps(seen))
"""


def test_the_operator_works_beside_the_sdks_kubernetes_client(
    emulator: RunningApiServer, tmp_path: Path
) -> None:
    kubeconfig = emulator.kubeconfig(tmp_path / "kubeconfig")
    seen, _ = _run(OPERATOR, env={"KUBECONFIG": str(kubeconfig)})
    assert Path(seen.pop("client_file")).is_relative_to(_sdk())  # the SDK's client, not the venv's
    assert "pytorchjobs" in seen.pop("served")
    assert seen == {
        "client": SDK_KUBERNETES,
        "sdk": "kubeflow.trainer.api.trainer_client",
        "in_cluster": False,
        "app": "run_operator",
        "created": "j",
        "again": 409,
        "patched": {"suspend": True},
        "got": {"suspend": True},
        "status": {"phase": "Running"},
        "pods": ["p"],
    }


REPORT = """
import json, logging
logging.basicConfig(level=logging.WARNING)  # the SDK says why a report failed at WARNING
from kubeflow.trainer.backends.kubernetes.utils import update_trainjob_status
sent = update_trainjob_status(
    progress_percent=40, estimated_remaining_seconds=90,
    metrics={"loss": 0.25, "current_step": 40, "total_steps": 100, "current_epoch": 1.5, "learning_rate": 0.0001},
)
print(json.dumps({"sent": sent}))
"""


def _assert_figures(received: ReceivedReport | None) -> None:
    assert received is not None
    report = received.report
    assert received.pod == "pod-0"
    assert (report.percent, report.estimated_remaining_seconds) == (40.0, 90.0)
    assert (report.step, report.total_steps, report.epoch, report.loss) == (40, 100, 2, 0.25)
    assert report.other == (("learning_rate", "0.0001"),)
    assert report.sent_at is not None


def test_the_sdk_reports_to_gpuop_runs_loopback_endpoint(tmp_path: Path) -> None:
    with serving("default", "sdk-run", tmp_path, "pod-0") as endpoint:
        assert endpoint.env[REPORT_URL_ENV].startswith("http://127.0.0.1:")
        assert REPORT_CA_ENV not in endpoint.env
        assert _run(REPORT, env=endpoint.env)[0] == {"sent": True}
        _assert_figures(endpoint.latest())


@pytest.fixture
def tls_endpoint(tmp_path: Path) -> Iterator[tuple[dict[str, str], ReportBook]]:
    """The operator's endpoint as a cluster runs it: TLS, a CA file, a token file."""
    tls = serving_directory(tmp_path / "tls", ips=("127.0.0.1",), dns_names=())
    token = secrets.token_urlsafe(32)
    (tmp_path / "token").write_text(token)
    key = ("default", "sdk-tls")
    book = ReportBook()
    server = ReportServer(LocalGate(key, token, "pod-0"), book, port=0, tls_dir=tls, host="127.0.0.1")
    server.start()
    try:
        url = f"https://127.0.0.1:{server.port}{report_path(key[0], key[1])}"
        env = {
            REPORT_URL_ENV: url,
            REPORT_TOKEN_ENV: str(tmp_path / "token"),
            REPORT_CA_ENV: str(tls / TLS_CA),
        }
        yield env, book
    finally:
        server.close()


def test_the_sdk_reports_to_the_operators_tls_endpoint(
    tls_endpoint: tuple[dict[str, str], ReportBook],
) -> None:
    env, book = tls_endpoint
    assert _run(REPORT, env=env)[0] == {"sent": True}
    _assert_figures(max(book.of(("default", "sdk-tls")), key=lambda r: r.received_at, default=None))


def test_without_the_ca_the_sdk_trusts_the_system_and_reports_nothing(
    tls_endpoint: tuple[dict[str, str], ReportBook],
) -> None:
    env, book = tls_endpoint
    env = {k: v for k, v in env.items() if k != REPORT_CA_ENV}
    sent, said = _run(REPORT, env=env)
    assert sent == {"sent": False}  # raised nothing
    assert "CERTIFICATE_VERIFY_FAILED" in said, said
    assert book.of(("default", "sdk-tls")) == ()


TRANSFORMERS = """
import json, os
import kubeflow.trainer.backends.kubernetes.utils
import gpuop.controller.app, gpuop.local.runreports, gpureport, gputrain.contract
import transformers
from transformers.integrations.integration_utils import is_kubeflow_available
seen = {"transformers": transformers.__version__, "with_our_env": is_kubeflow_available()}
del os.environ["KUBEFLOW_TRAINER_SERVER_URL"]
seen["without"] = is_kubeflow_available()
print(json.dumps(seen))
"""


def test_transformers_imports_beside_the_sdk_and_us_and_sees_our_endpoint(tmp_path: Path) -> None:
    with serving("default", "hf-run", tmp_path, "pod-0") as endpoint:
        seen, _ = _run(TRANSFORMERS, env=endpoint.env, timeout=300)
    assert seen["with_our_env"] is True
    assert seen["without"] is False
    assert seen["transformers"].split(".")[0] == "5"
