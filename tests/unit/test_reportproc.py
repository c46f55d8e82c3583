"""The report endpoint's own process (gpuop.controller.reportproc): what it says when it cannot
start, and that what it serves comes back to the operator's process. No API server here: the
token reviews fail, which is itself an outcome that must reach the operator's metrics.
(tests/controlplane/test_operator.py sends real reports through it, and kills it.)"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuop.controller import app, reportproc
from gpuop.controller.settings import OperatorSettings, SettingsError
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing.endpoint import Limits, ReportBook
from support.waiting import wait_for


@pytest.fixture
def kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Credentials for an API server that is not there: the child logs in, every review fails."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    monkeypatch.setenv("KUBECONFIG", str(path))
    return path


Counted = list[tuple[Any, ...]]


@pytest.fixture
def endpoint_process(kubeconfig: Path) -> Iterator[tuple[reportproc.ReportProcess, Counted]]:
    counted: Counted = []
    process = reportproc.ReportProcess(
        reportproc.ReportConfig(port=0, tls_dir=None, limits=Limits(review_seconds=0.5)),
        ReportBook(),
        lambda outcome, seconds: counted.append(("outcome", outcome)),
        lambda verb, resource, code, seconds: counted.append(("api", verb, resource, code)),
    )
    process.start()
    yield process, counted
    process.close()


def test_what_the_child_serves_comes_back_to_the_operators_process(
    endpoint_process: tuple[reportproc.ReportProcess, Counted],
) -> None:
    process, counted = endpoint_process
    request = urllib.request.Request(
        f"http://127.0.0.1:{process.port}/apis/gpuop.io/v1alpha1/namespaces/team/gputrainings/a/status",
        data=b'{"trainerStatus": {"progressPercentage": 5}}', method="POST",
        headers={"Authorization": "Bearer some-token", "Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 503  # the API server cannot be asked: ask again later
    wait_for("the outcome counted in the operator's process", lambda: ("outcome", "review_failed") in counted)
    # The child's own call to the API server counts in the operator's metrics too (0: unreachable).
    assert ("api", "create", "tokenreviews", 0) in counted


def test_closing_stops_the_child(
    endpoint_process: tuple[reportproc.ReportProcess, Counted],
) -> None:
    process, _ = endpoint_process
    port = process.port
    process.close()
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))


def test_a_taken_port_is_one_line_naming_report_port(kubeconfig: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = OperatorSettings(report_url=f"http://127.0.0.1:{port}", report_port=port)
        with pytest.raises(SettingsError) as said:
            app._report_endpoint(settings, OperatorMetrics())
    message = str(said.value)
    assert message.startswith(f"--report-port / GPUOP_REPORT_PORT: cannot listen on {port} (")
    assert message.endswith("); choose a free port")
    assert "\n" not in message


def test_an_unreadable_certificate_is_one_line_naming_report_tls_dir(
    tmp_path: Path, kubeconfig: Path
) -> None:
    settings = OperatorSettings(
        report_url="https://gpuop-reports.gpuop-system.svc:8443", report_tls_dir=str(tmp_path / "missing")
    )
    with pytest.raises(SettingsError) as said:
        app._report_endpoint(settings, OperatorMetrics())
    assert str(said.value).startswith(
        f"--report-tls-dir / GPUOP_REPORT_TLS_DIR: cannot serve HTTPS from {tmp_path}"
    )
    assert str(said.value).endswith("it needs tls.crt, tls.key and ca.crt")
