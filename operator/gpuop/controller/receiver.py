"""Who may report a training's progress, in a cluster: the API server says whose token it is.

A token is accepted for a training when a TokenReview with that training's audience
(:func:`gpuop.api.identity.report_audience`) says it is a ServiceAccount token of the training's
namespace, bound to a pod, and that pod, by name and uid, carries the training's label. Blocking
calls, through :mod:`gpuop.controller.kube`; the endpoint itself is
:mod:`gpuop.observing.endpoint`.

A token is reviewed again after 1 to 1.5 review TTLs (by its hash), as before, but in the
background: the first report past that point starts the review and is answered from the kept
verdict, so a client that keeps reporting waits for the API server on its first report only.
With the review on the request path, one report in fifteen at 1,000 trainings waited for two
calls to a loaded API server (bench/report_scale.py). A verdict is never used past half as long
again (a reporter back from a silence, or an API server that cannot answer, waits for a fresh
review then); a refusal is never reviewed ahead.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

from gpuop.api.identity import TRAINING_LABEL, TrainingKey, report_audience
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import Kube
from gpuop.observing.endpoint import Limits, RefusalError

log = logging.getLogger(__name__)

# The projected token's claims the API server returns for a token bound to a pod.
_POD_NAME: Final = "authentication.kubernetes.io/pod-name"
_POD_UID: Final = "authentication.kubernetes.io/pod-uid"
# Reviews in the background at once: each is two calls to the API server (the review and the
# pod), 10 to 100 ms on a loaded one, and 1,000 trainings need about 13 a second.
_REFRESHERS: Final = 4

Refresher = Callable[[Callable[[], None]], object]  # runs a review later, off the request's thread


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
    refresh_at: float  # from here on, a report that uses it starts the next review
    expires: float  # never used from here on: 1.5x its life to refresh_at (accepted ones)


class ClusterGate:
    """The operator's :class:`gpuop.observing.endpoint.Gate`. Thread-safe; :meth:`close` stops
    its background reviews.

    ``refresher`` runs a background review; by default a pool of :data:`_REFRESHERS` threads,
    started with the first one. Tests give one that keeps the reviews until they say.
    """

    def __init__(
        self,
        kube: Kube,
        limits: Limits,
        clock: Callable[[], float] = time.monotonic,
        refresher: Refresher | None = None,
    ) -> None:
        self.kube = kube
        self.limits = limits
        self.clock = clock
        self._lock = threading.Lock()
        # (token hash, audience) -> verdict: a client reports every few seconds with the same
        # token (kubelet renews it hourly), so the API server reviews each token about once a
        # minute, not once a report. A pod deleted meanwhile has its token revoked; for up to
        # the verdict's life its reports still count, for the training it was part of.
        self._verdicts: OrderedDict[tuple[str, str], _Verdict] = OrderedDict()
        self._refreshing: set[tuple[str, str]] = set()  # reviews started and not yet done
        self._refresher = refresher
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def authenticate(self, key: TrainingKey, token: str) -> str:
        """The pod the token speaks for, once the API server and the pod say it is this training's."""
        wanted = report_audience(*key)
        digest = hashlib.sha256(token.encode()).hexdigest()
        cache_key = (digest, wanted)
        now = self.clock()
        with self._lock:
            verdict = self._verdicts.get(cache_key)
            refresh = (
                verdict is not None
                and verdict.pod is not None
                and verdict.refresh_at <= now < verdict.expires
                and cache_key not in self._refreshing
                and not self._closed
            )
            if refresh:
                self._refreshing.add(cache_key)
        if verdict is None or now >= verdict.expires:
            verdict = self._review(key, token, digest, wanted)  # 503 raises: ask again next time
        elif refresh:
            try:
                self._submit(lambda: self._refresh(key, token, digest, wanted))
            except RuntimeError:  # closing: the verdict serves until it expires
                with self._lock:
                    self._refreshing.discard(cache_key)
        if verdict.refusal is not None:
            raise verdict.refusal
        assert verdict.pod is not None
        return verdict.pod

    def close(self) -> None:
        """Start no more background reviews, and wait for those under way."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, job: Callable[[], None]) -> None:
        if self._refresher is not None:
            self._refresher(job)
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_REFRESHERS, thread_name_prefix="token-review")
            pool = self._pool
        pool.submit(job)

    def _refresh(self, key: TrainingKey, token: str, digest: str, wanted: str) -> None:
        """A background review: its verdict replaces the kept one; an API server that cannot say
        leaves the kept one to serve out its life (the next report asks again)."""
        try:
            self._review(key, token, digest, wanted)
        except RefusalError:
            pass  # 503; logged by the API client's own counters
        except Exception:  # a bug here must not end the pool's thread or hold the key
            log.exception("background token review failed")
        finally:
            with self._lock:
                self._refreshing.discard((digest, wanted))

    def _review(self, key: TrainingKey, token: str, digest: str, wanted: str) -> _Verdict:
        """Ask the API server, and keep its verdict; a 503 (it could not say) raises, kept nowhere."""
        now = self.clock()
        # Each token is reviewed again after 1 to 1.5 TTLs, by its hash: the tokens of a
        # thousand trainings first reviewed within one report interval (an operator's start)
        # would otherwise come due in the same seconds, every TTL, all together (seconds of p99
        # at N=1000, bench/report_scale.py).
        life = self.limits.review_ttl_seconds * (1 + int(digest[:4], 16) / 0x1FFFE)
        try:
            verdict = _Verdict(self._bound_pod(key, token, wanted), None, now + life, now + life * 1.5)
        except RefusalError as refusal:
            if refusal.status == 503:
                raise
            verdict = _Verdict(None, refusal, now + life, now + life)
        with self._lock:
            self._verdicts[(digest, wanted)] = verdict
            self._verdicts.move_to_end((digest, wanted))
            while len(self._verdicts) > self.limits.remembered_tokens:
                self._verdicts.popitem(last=False)
        return verdict

    def _bound_pod(self, key: TrainingKey, token: str, wanted: str) -> str:
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
