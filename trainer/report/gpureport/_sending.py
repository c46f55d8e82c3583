"""Where one process's reports go, and one POST there: the URL, TLS, the bearer token.

The :class:`~gpureport.Reporter` decides what to send and when; only its sender thread posts
through this (its counters are read from any thread).
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

log = logging.getLogger("gpureport")


class Endpoint:
    """The report server at ``url``, verified against ``ca_file``, with the token in ``token_file``."""

    def __init__(
        self,
        url: str,
        ca_file: str | None,
        token_file: str | None,
        *,
        request_timeout: float,
        token_ttl: float,
        clock: Callable[[], float],
    ) -> None:
        self.url, self.ca_file, self.token_file = url, ca_file, token_file
        self.request_timeout, self.token_ttl = request_timeout, token_ttl
        self._clock = clock
        self._scheme, self._host, self._port, self._path = _parts(url)
        # A token is a credential: over plain http it goes to this machine only.
        self._sends_token = self._scheme == "https" or _is_loopback(self._host)
        self._ssl_context: ssl.SSLContext | None = None
        self._token_cache: tuple[float, str] | None = None  # (clock when read, token)
        self._failing = False
        self.retryable = False  # whether the last failure may pass if tried again
        self.delivered = 0  # reports the server answered 200
        self.failures = 0  # reports it did not (or never got), and token files that could not be read

    @property
    def usable(self) -> bool:
        """Whether the URL names a server at all (http or https, with a host)."""
        return bool(self._host)

    def post(self, body: bytes) -> bool:
        """One POST on a new connection (one per min_interval: a TLS handshake every 5 s costs
        less than keeping a connection the server may drop). Never raises."""
        connection: http.client.HTTPConnection | None = None
        try:
            headers = {"Content-Type": "application/json", "Accept": "application/json"}
            token = self._token()
            if token:
                headers["Authorization"] = "Bearer " + token
            # http.client, not urllib: no proxy from the environment (the server is in the
            # cluster or on this machine) and no redirects, which would carry the token along.
            if self._scheme == "https":
                context = self._ssl_context or ssl.create_default_context(cafile=self.ca_file)
                self._ssl_context = context
                connection = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self.request_timeout, context=context
                )
            else:
                connection = http.client.HTTPConnection(self._host, self._port, timeout=self.request_timeout)
            connection.request("POST", self._path, body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read(512)
        except Exception as exc:  # OSError, ssl.SSLError, http.client.HTTPException, ...
            # A server whose certificate does not verify will not next time either.
            self.retryable = not isinstance(exc, ssl.SSLCertVerificationError)
            return self._failed(f"{type(exc).__name__}: {exc}")
        finally:
            if connection is not None:
                connection.close()
        self.retryable = response.status == 429 or response.status >= 500
        if response.status != 200:
            if response.status == 401:
                self._token_cache = None  # re-read at once: the kubelet may have rotated it
            return self._failed(f"HTTP {response.status} {answer[:200]!r}")
        self.delivered += 1
        if self._failing:
            self._failing = False
            log.debug("gpureport: reports reach %s again", self.url)
        return True

    def _failed(self, why: str) -> bool:
        # Said once per run of failures: an endpoint that is down would otherwise fill the
        # training log every 5 s.
        self.failures += 1
        if not self._failing:
            self._failing = True
            log.debug("gpureport: cannot report to %s: %s (said once until one goes through)", self.url, why)
        return False

    def _token(self) -> str | None:
        """The bearer token, re-read every ``token_ttl`` seconds (the kubelet rotates the file
        well before it expires; a 401 drops the cached one)."""
        if self.token_file is None or not self._sends_token:
            return None
        now = self._clock()
        if self._token_cache is not None and now - self._token_cache[0] < self.token_ttl:
            return self._token_cache[1]
        try:
            with open(self.token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except (OSError, ValueError) as exc:
            self._failed(f"cannot read the token at {self.token_file}: {exc}")
            return None
        self._token_cache = (now, token)
        return token


def _parts(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, port, path of the request); the host is "" when the URL cannot be used."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "", "", None, ""
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "", "", None, ""
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port, path


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
