"""Progress reports from any training code, over Kubeflow Trainer's ``trainerStatus`` protocol
(KEP-2779), with nothing but the Python standard library.

    import gpureport
    for step in range(1, total + 1):
        loss = train_one_step()
        gpureport.report(step=step, total_steps=total, loss=loss)
    gpureport.finish(step=total, total_steps=total, loss=loss)

Where reports go: ``KUBEFLOW_TRAINER_SERVER_URL`` (https in a cluster; http for a local run),
the server verified against the CA in the file ``KUBEFLOW_TRAINER_SERVER_CA_CERT`` names, with
the bearer token in the file ``KUBEFLOW_TRAINER_SERVER_TOKEN`` names. Without the URL, or in a
process whose ``RANK`` is set and is not 0, every call is a no-op that returns False.

What the training loop can rely on:

- Nothing here raises into the caller, whatever it is given. What would break the protocol's
  bounds is dropped or cut: at most 256 metrics, names and values of 1 to 64 characters,
  percent an int of 0..100, the ETA an int of 0..2**31-1 seconds.
- ``report()`` never waits on the network. A daemon thread POSTs; a report that comes while
  another is in flight replaces the one still waiting (latest wins), so a slow or hung
  endpoint costs the loop nothing but staler status.
- At most one report per ``min_interval`` (5 s) is sent, besides the first and the final. A
  throttled call costs a clock read and a lock, and returns False.
- Percent is capped at 99 until the final report, which sends 100 and an ETA of 0 and waits
  (up to ``final_timeout``, 5 s) for its POST to be answered.
- ``with gpureport.pause("evaluating"):`` (or "saving", "loading", "compiling") says the code
  is doing something other than optimizer steps for as long as the block lasts, so a long
  evaluation is not taken for a stall. Its start and its end are sent at once, past the
  throttle: two pauses back to back (a save, then an evaluation) are both said, while a loop
  that pauses more than once a second is paused for the operator only as often as that.
- ``gpureport.checkpointed(step, uri)`` says a checkpoint is complete (call it once the last
  byte is written: the operator shows it as status.checkpoint, with its age). It is sent at
  once, as a pause is (or, past the pauses' bucket, by the sender within about a second), and
  repeated in every later report, so a report that replaces it in the queue still says it.
- A report the server refuses for now (429, a 5xx, no connection) is tried again 1, 2, 4 and
  5 s later, unless a newer one, which says all it says, replaces it.

Metric names are the ones Hugging Face's ``KubeflowCallback`` sends (``current_step``,
``total_steps``, ``current_epoch``, ``loss``, ...), so a reader reads every client alike.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from gpureport._bounds import CHECKPOINT_STEP, CHECKPOINT_TIME, MAX_CHARS, MAX_METRICS, uri_piece_names
from gpureport._reporter import CA_ENV, TOKEN_ENV, URL_ENV, Reporter

__all__ = [
    "CA_ENV",
    "CHECKPOINT_STEP",
    "CHECKPOINT_TIME",
    "MAX_CHARS",
    "MAX_METRICS",
    "TOKEN_ENV",
    "URL_ENV",
    "Reporter",
    "checkpointed",
    "default_reporter",
    "finish",
    "pause",
    "report",
    "uri_piece_names",
]
__version__ = "0.1.0"

# -----------------------------------------------------------------------------------------
# The module's functions: one Reporter per process, made from the environment on first use

_default: Reporter | None = None
_default_lock = threading.Lock()


def default_reporter() -> Reporter:
    """The process's Reporter, made from ``os.environ`` on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Reporter()
        return _default


def report(
    step: Any = None,
    total_steps: Any = None,
    loss: Any = None,
    *,
    epoch: Any = None,
    total_epochs: Any = None,
    percent: Any = None,
    eta_seconds: Any = None,
    samples_per_second: Any = None,
    final: bool = False,
    **metrics: Any,
) -> bool:
    """:meth:`Reporter.report` on the process's Reporter."""
    try:
        reporter = default_reporter()
    except Exception:
        return False
    return reporter.report(
        step,
        total_steps,
        loss,
        epoch=epoch,
        total_epochs=total_epochs,
        percent=percent,
        eta_seconds=eta_seconds,
        samples_per_second=samples_per_second,
        final=final,
        **metrics,
    )


def finish(step: Any = None, total_steps: Any = None, loss: Any = None, **figures: Any) -> bool:
    """:meth:`Reporter.finish` on the process's Reporter: 100 %, ETA 0, waits for the answer."""
    try:
        reporter = default_reporter()
    except Exception:
        return False
    return reporter.finish(step, total_steps, loss, **figures)


def checkpointed(step: Any, uri: Any = None, *, time: Any = None) -> bool:
    """:meth:`Reporter.checkpointed` on the process's Reporter."""
    try:
        reporter = default_reporter()
    except Exception:
        return False
    return reporter.checkpointed(step, uri, time=time)


def pause(activity: str) -> contextlib.AbstractContextManager[None]:
    """:meth:`Reporter.pause` on the process's Reporter."""
    try:
        return default_reporter().pause(activity)
    except Exception:
        return contextlib.nullcontext()
