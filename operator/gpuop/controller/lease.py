"""Which replica works: a ``coordination.k8s.io/v1`` Lease, held by one replica at a time.

The rule is the one kube-controller-manager, kube-scheduler and controller-runtime follow, so
``kubectl get lease -n <namespace>`` says who leads, as it does for them. The leader renews the
Lease every :data:`RETRY_SECONDS`. Another replica takes it once it has seen the same record,
unchanged, for the Lease's duration by its own clock (clocks of two machines are never
compared), or at once when the holder let it go on its way out. A leader that could not renew
for :data:`RENEW_DEADLINE_SECONDS` stops leading, and that is shorter than the duration, so it
has stopped before any other may take over: two replicas never act at once.

Why a Lease rather than Kopf's peering: a standby keeps its watches (Kopf's peering pauses
them, so a replica taking over would list every object again first), a killed leader is
replaced after :data:`LEASE_SECONDS` rather than Kopf's 60 s, and it is the object cluster
admins already read for every other controller.

While it leads, a replica in a pod labels that pod :data:`LEADER_LABEL` (and takes the label off
any other pod), so that a Service selecting the label, the chart's progress-report Service,
sends to the leader alone: reports reach the replica that writes status.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

from gpuop.api.identity import GROUP
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import LEASE_CALL_SECONDS, Kube

log = logging.getLogger(__name__)

# kube-controller-manager's own figures. A crashed leader is replaced after LEASE_SECONDS (plus
# up to one RETRY_SECONDS); a leader cut off from the API server stops after
# RENEW_DEADLINE_SECONDS; a held Lease costs one write every RETRY_SECONDS.
LEASE_SECONDS: Final = 15
RENEW_DEADLINE_SECONDS: Final = 10.0
RETRY_SECONDS: Final = 2.0
# A leader whose renewal failed tries again at once, this many times in all, and the next round
# comes this soon.
RENEW_TRIES: Final = 3
RETRY_FAILED_RENEWAL_SECONDS: Final = 0.5
# A leader's pod carries this label while it leads (the report Service selects it).
LEADER_LABEL: Final = f"{GROUP}/leader"
# Seconds between repeats of the WARNING that the Lease cannot be read or written.
WARN_EVERY_SECONDS: Final = 60.0


def _stamp(moment: datetime) -> str:
    """A Lease's MicroTime."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderLease:
    """This replica's side of the Lease: :meth:`run` in a thread of its own, :meth:`leading`
    from anywhere. ``on_lead`` is called once leadership is taken; ``on_lost`` once it is
    lost (not given up): the caller should stop, as a replica that lost its Lease may have
    been replaced already."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        *,
        pod: str | None = None,
        on_lead: Callable[[], None] = lambda: None,
        on_lost: Callable[[], None] = lambda: None,
        timer: Callable[[], float] = time.monotonic,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.pod = pod  # this replica's pod (labelled while it leads), None outside a pod
        self.on_lead, self.on_lost = on_lead, on_lost
        self.timer, self.clock = timer, clock
        self._renewed_at: float | None = None  # when this replica last wrote the Lease as holder
        self._observed: tuple[Any, ...] | None = None  # the last record seen of another holder
        self._written: dict[str, Any] | None = None  # the Lease as this replica last wrote it
        self._observed_at = 0.0
        self._labelled = False
        self._warned_at: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one writer of the Lease at a time: run() or release()

    def leading(self) -> bool:
        """Whether this replica may act now: it holds the Lease and renewed it within the
        renew deadline (a stalled renewing thread does not leave it acting)."""
        renewed = self._renewed_at
        return renewed is not None and self.timer() - renewed < RENEW_DEADLINE_SECONDS

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> None:
        """Take the Lease when it is free, keep it renewed, until :meth:`stop` or it is lost."""
        while not self._stop.is_set():
            was_leading = self._renewed_at is not None
            with self._lock:
                if self._stop.is_set():
                    return
                held = self.try_acquire_or_renew()
            if was_leading and not self.leading() and not self._stop.is_set():  # not given up (release)
                log.error(
                    "leadership lost: the Lease %s/%s was taken by another replica, or not renewed within "
                    "%gs; stopping, as another replica may lead by now", self.namespace, self.name,
                    RENEW_DEADLINE_SECONDS,
                )  # fmt: skip
                self._renewed_at = None
                self.on_lost()
                return
            if not was_leading and self.leading():
                log.info("leading: holding the Lease %s/%s as %s", self.namespace, self.name, self.identity)
                self.on_lead()
            if self.leading() and not self._labelled:
                self._label_leader()
            self._stop.wait(RETRY_SECONDS if held or not self.leading() else RETRY_FAILED_RENEWAL_SECONDS)

    def stop(self) -> None:
        self._stop.set()

    def release(self) -> None:
        """Give the Lease up on the way out, so that another replica takes it at once: first the
        pod's label (no report is sent here any more), then the Lease itself, as client-go's
        ReleaseOnCancel does (no holder, a duration of 1 s). Call after the workers stopped."""
        self.stop()
        with self._lock:
            if self._renewed_at is None:
                return
            self._renewed_at = None
            try:
                if self.pod is not None:
                    self.kube.label_pod(self.namespace, self.pod, LEADER_LABEL, None)
                lease = self.kube.get_lease(self.namespace, self.name)
                if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    return
                now = _stamp(self.clock())
                spec = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1,
                        "acquireTime": now, "renewTime": now}  # fmt: skip
                self.kube.replace_lease({**lease, "spec": spec}, timeout=LEASE_CALL_SECONDS)
                log.info("released the Lease %s/%s", self.namespace, self.name)
            except ApiError as exc:
                log.warning("releasing the Lease %s/%s: %s; another replica takes over in %ds",
                            self.namespace, self.name, exc, LEASE_SECONDS)  # fmt: skip

    # -- one round ------------------------------------------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """One round; whether this replica holds the Lease now. A leader whose renewal failed
        (a 5xx, a timeout, a lost reply) tries again at once, up to :data:`RENEW_TRIES` times:
        with one try a round, an operator behind a proxy failing a fifth of requests lost its
        Lease within a minute."""
        for _ in range(RENEW_TRIES if self._renewed_at is not None else 1):
            if self._try_once():
                return True
            if not self.leading():
                return False  # taken by another, or past the renew deadline
        return False

    def _try_once(self) -> bool:
        """A leader renews with one write of the Lease as it last wrote it (as
        client-go's leader does); otherwise, or when that write finds the Lease changed since, a
        read and at most one write. Whether this replica holds it now."""
        if self._renewed_at is not None and self._written is not None:
            try:
                return self._held(self.kube.replace_lease(
                    {**self._written, "spec": self._spec(self._written["spec"], self.clock())},
                    timeout=LEASE_CALL_SECONDS))  # fmt: skip
            except ApiError as exc:
                if exc.status != 409:  # not written, or written with its reply lost: tried again soon
                    log.debug("renewing the Lease %s/%s: %s", self.namespace, self.name, exc)
                    return False
                self._written = None  # changed since: read it, in this round
        try:
            lease = self.kube.get_lease(self.namespace, self.name)
            now = self.clock()
            if lease is None:
                return self._held(self.kube.create_lease(self.namespace, self.name, self._spec({}, now)))
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            if holder != self.identity:
                if self._renewed_at is not None:
                    self._renewed_at = self._written = None  # taken by another: this replica stops at once
                    return False
                record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"),
                          lease["metadata"].get("resourceVersion"))  # fmt: skip
                if record != self._observed:
                    self._observed, self._observed_at = record, self.timer()
                duration = float(spec.get("leaseDurationSeconds") or LEASE_SECONDS)
                if holder and self.timer() - self._observed_at < duration:
                    self._quiet()
                    return False  # another holds it, and renewed it within its duration
                log.info("taking the Lease %s/%s from %s", self.namespace, self.name, holder or "nobody")
            return self._held(self.kube.replace_lease({**lease, "spec": self._spec(spec, now)},
                                                      timeout=LEASE_CALL_SECONDS))  # fmt: skip
        except ApiError as exc:
            if exc.status != 409:  # 409: another replica wrote it first; read again next round
                self._warn(exc)
            return False

    def _spec(self, spec: dict[str, Any], now: datetime) -> dict[str, Any]:
        """The Lease's spec with this replica as its holder, renewed now."""
        ours = spec.get("holderIdentity") == self.identity
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": LEASE_SECONDS,
            "acquireTime": spec.get("acquireTime") if ours else _stamp(now),
            "renewTime": _stamp(now),
            "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if ours or not spec else 1),
        }

    def _held(self, written: dict[str, Any]) -> bool:
        self._written = written
        self._renewed_at = self.timer()
        self._quiet()
        return True

    def _quiet(self) -> None:
        if self._warned_at is not None:
            log.info("the Lease %s/%s is read and written again", self.namespace, self.name)
        self._warned_at = None

    def _warn(self, exc: ApiError) -> None:
        """A Lease that cannot be read or written: this replica cannot lead. Said at once and
        then every minute, with the fix, not at every round."""
        now = self.timer()
        if self._warned_at is not None and now - self._warned_at < WARN_EVERY_SECONDS:
            return
        self._warned_at = now
        if exc.status == 403:
            where = self.namespace
            fix = f"grant get, create and update on coordination.k8s.io leases in {where} (the chart does)"
        elif exc.status == 404:
            fix = f"create the namespace {self.namespace}, or name one that exists (--lease-namespace)"
        else:
            fix = f"it is asked again every {RETRY_SECONDS:g}s"
        log.warning(
            "the Lease %s/%s: %s; this replica cannot lead (it does nothing) until it can read and "
            "write it: %s, or run one replica with --standalone", self.namespace, self.name, exc, fix,
        )  # fmt: skip

    # -- the leader's label ---------------------------------------------------------------

    def _label_leader(self) -> None:
        """Label this pod, and take the label off any other (a leader that died without
        taking it off itself), so the Service selecting it sends to this replica alone."""
        if self.pod is None:
            self._labelled = True
            return
        try:
            for other in self.kube.list_pods(self.namespace, f"{LEADER_LABEL}=true"):
                name = other["metadata"]["name"]
                if name != self.pod:
                    self.kube.label_pod(self.namespace, name, LEADER_LABEL, None)  # 404: gone, fine
            self.kube.label_pod(self.namespace, self.pod, LEADER_LABEL, "true")
            self._labelled = True
        except ApiError as exc:
            log.warning("labelling pod %s as the leader: %s; progress reports do not reach this "
                        "replica until it is (tried again in %gs)", self.pod, exc, RETRY_SECONDS)  # fmt: skip
