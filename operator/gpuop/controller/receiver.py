"""Who may report a training's progress, in a cluster: the API server says whose token it is.

A token is accepted for a training when a TokenReview with that training's audience
(:func:`gpuop.api.identity.report_audience`) says it is a ServiceAccount token of the training's
namespace, bound to a pod, and that pod, by name and uid, carries the training's label. Blocking
calls, through :mod:`gpuop.controller.kube`; the endpoint itself is
:mod:`gpuop.observing.endpoint`.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from gpuop.api.identity import TRAINING_LABEL, report_audience
from gpuop.controller.kube import ApiError, Kube
from gpuop.observing.endpoint import Key, Limits, RefusalError

# The projected token's claims the API server returns for a token bound to a pod.
_POD_NAME: Final = "authentication.kubernetes.io/pod-name"
_POD_UID: Final = "authentication.kubernetes.io/pod-uid"


@dataclass(frozen=True)
class _Review:
    namespace: str | None  # the ServiceAccount's
    pod: str | None
    pod_uid: str | None
    error: str | None  # why not authenticated


@dataclass(frozen=True)
class _Verdict:
    """A token's authentication for one training, kept for the review TTL."""

    pod: str | None
    refusal: RefusalError | None
    expires: float


class ClusterGate:
    """The operator's :class:`gpuop.observing.endpoint.Gate`. Thread-safe."""

    def __init__(self, kube: Kube, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.limits = limits
        self.clock = clock
        self._lock = threading.Lock()
        # (token hash, audience) -> verdict: a client reports every few seconds with the same
        # token (kubelet renews it hourly), so the API server reviews each token about once a
        # minute, not once a report. A pod deleted meanwhile has its token revoked; for up to
        # the TTL its reports still count, for the training it was part of.
        self._verdicts: OrderedDict[tuple[str, str], _Verdict] = OrderedDict()

    def authenticate(self, key: Key, token: str) -> str:
        """The pod the token speaks for, once the API server and the pod say it is this training's."""
        wanted = report_audience(*key)
        digest = hashlib.sha256(token.encode()).hexdigest()
        cache_key = (digest, wanted)
        now = self.clock()
        with self._lock:
            verdict = self._verdicts.get(cache_key)
        if verdict is None or now >= verdict.expires:
            # Each token's verdict lives between 1 and 1.5 TTLs, by its hash: the tokens of a
            # thousand trainings first reviewed within one report interval (an operator's start)
            # would otherwise all expire in the same seconds, every TTL, and their thousand
            # reviews queue the reports behind them (seconds of p99 at N=1000, bench/report_scale.py).
            expires = now + self.limits.review_ttl_seconds * (1 + int(digest[:4], 16) / 0x1FFFE)
            try:
                verdict = _Verdict(self._bound_pod(key, token, wanted), None, expires)
            except RefusalError as refusal:
                if refusal.status == 503:
                    raise  # the API server could not say: ask again next time
                verdict = _Verdict(None, refusal, expires)
            with self._lock:
                self._verdicts[cache_key] = verdict
                while len(self._verdicts) > self.limits.remembered_tokens:
                    self._verdicts.popitem(last=False)
        if verdict.refusal is not None:
            raise verdict.refusal
        assert verdict.pod is not None
        return verdict.pod

    def _bound_pod(self, key: Key, token: str, wanted: str) -> str:
        namespace, name = key
        try:
            review = _reviewed(self.kube.review_token(token, wanted, self.limits.review_seconds), wanted)
            if review.error is not None:
                raise RefusalError(401, "unauthenticated", f"token not accepted: {review.error}")
            if review.namespace != namespace:
                raise RefusalError(403, "forbidden", "the token is of another namespace's ServiceAccount")
            if review.pod is None:
                raise RefusalError(
                    403, "forbidden", "the token is not bound to a pod (use a projected token)"
                )
            pod = self.kube.get_pod(namespace, review.pod)
        except ApiError as exc:
            raise RefusalError(503, "review_failed", f"cannot check the token now ({exc.reason})") from None
        meta = (pod or {}).get("metadata") or {}
        ours = (meta.get("labels") or {}).get(TRAINING_LABEL) == name
        if not ours or (review.pod_uid is not None and meta.get("uid") != review.pod_uid):
            raise RefusalError(403, "forbidden", f"pod {review.pod} is not a pod of gputraining {name}")
        return review.pod


def _reviewed(status: dict[str, Any], wanted: str) -> _Review:
    if not status.get("authenticated"):
        return _Review(None, None, None, str(status.get("error") or "not authenticated")[:200])
    if wanted not in (status.get("audiences") or [wanted]):
        return _Review(None, None, None, "wrong audience")
    user = status.get("user") or {}
    parts = str(user.get("username") or "").split(":")
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"]:
        return _Review(None, None, None, "not a ServiceAccount's token")
    extra = user.get("extra") or {}

    def first(values: Any) -> str | None:
        return str(values[0]) if isinstance(values, list) and values else None

    return _Review(parts[2], first(extra.get(_POD_NAME)), first(extra.get(_POD_UID)), None)
