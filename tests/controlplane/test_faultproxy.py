"""The fault proxy's cut is what a dropped connection leaves of a watch: a chunked body with no
last chunk, which a client sees as cut short. A body that only the connection's close
delimited would end cleanly mid-event, and a client that reads lines would take the half
line it got for a whole one: Kopf's watcher then fails on it and takes the operator down, a
failure no API server or load balancer can cause."""

from __future__ import annotations

import http.client
import urllib.parse

from support.plane.controlplane import ControlPlane
from support.plane.faultproxy import FaultProxy

ACCOUNT = "fault-proxy-check"


def _token(plane: ControlPlane) -> str:
    """A bearer token that may watch (the proxy passes the client's token on)."""
    plane.kubectl("create", "serviceaccount", ACCOUNT, "-n", "default", check=False)
    plane.kubectl("create", "clusterrolebinding", ACCOUNT, "--clusterrole=view",
                  f"--serviceaccount=default:{ACCOUNT}", check=False)  # fmt: skip
    return plane.kubectl("create", "token", ACCOUNT, "-n", "default").stdout.strip()


def _watch(proxy: FaultProxy, token: str, timeout_seconds: int) -> tuple[bytes, str]:
    """The ConfigMaps of ``default`` watched through the proxy: what came, and how it ended."""
    address = urllib.parse.urlsplit(proxy.url)
    connection = http.client.HTTPConnection(address.hostname or "127.0.0.1", address.port, timeout=60)
    try:
        connection.request("GET", f"/api/v1/namespaces/default/configmaps?watch=1&timeoutSeconds={timeout_seconds}",
                           headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        response = connection.getresponse()
        assert response.status == 200, response.read()[:300]
        try:
            return response.read(), "ended"
        except http.client.IncompleteRead as short:
            return short.partial, "cut short"
    finally:
        connection.close()


def test_a_cut_watch_is_cut_short_and_one_the_server_ends_ends_cleanly(plane: ControlPlane) -> None:
    token = _token(plane)
    cutting = FaultProxy(plane.server, plane.ca.cert, rate=0.0, watch_rate=1.0, seed=3)
    try:
        # Cut after 0.5 to 3 s, long before the server's 30 s; kube-root-ca.crt came first.
        came, how = _watch(cutting, token, timeout_seconds=30)
        assert how == "cut short", came[-200:]
        assert b"kube-root-ca.crt" in came
    finally:
        cutting.close()
    passing = FaultProxy(plane.server, plane.ca.cert, rate=0.0, watch_rate=0.0)
    try:
        came, how = _watch(passing, token, timeout_seconds=1)
        assert how == "ended", came[-200:]
        assert came.endswith(b"\n")  # whole events only
        assert b"kube-root-ca.crt" in came
    finally:
        passing.close()
