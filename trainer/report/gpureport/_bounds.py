"""Values into the bounds of Kubeflow Trainer's ``trainerStatus`` (its TrainJob CRD): whatever a
caller passes comes out as a number the protocol takes, a metric string of 1..64 characters,
or nothing. Pure; never raises for any value."""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable
from typing import Any

# Kubeflow's API bounds (TrainJob status.trainerStatus): at most 256 metrics, each name and
# value a string of 1 to 64 characters; the ETA is an int32.
MAX_METRICS = 256
MAX_CHARS = 64
MAX_ETA_SECONDS = 2**31 - 1
# A checkpoint's URI goes in pieces of 64 characters, under CHECKPOINT_URI then "_2", "_3", ...:
# an s3:// key is often longer than one value may be. 16 pieces hold 1,024 characters; a longer
# URI is not sent (a cut one would name another object).
CHECKPOINT_STEP = "checkpoint_step"
CHECKPOINT_TIME = "checkpoint_time"
CHECKPOINT_URI = "checkpoint_uri"
MAX_URI_PIECES = 16
MAX_URI_CHARS = MAX_URI_PIECES * MAX_CHARS


def uri_piece_names() -> list[str]:
    """The metric names of a URI's pieces, in order."""
    return [CHECKPOINT_URI] + [f"{CHECKPOINT_URI}_{n}" for n in range(2, MAX_URI_PIECES + 1)]


class Verbatim(str):
    """A metric value sent as it is, not trimmed: a piece of a URI whose cut may fall on a space."""

    __slots__ = ()


def finite(value: Any) -> float | None:
    """``value`` as a finite float (a tensor or numpy scalar too); None for anything else."""
    if value is None or isinstance(value, (bool, str)):
        return None
    try:
        number = float(value)
    except Exception:  # a tensor of many elements, an object without __float__, ...
        return None
    return number if math.isfinite(number) else None


def fraction_done(step: Any, total_steps: Any, percent: Any) -> float | None:
    """0..1: ``percent`` when it is a number, else ``step / total_steps``."""
    given = finite(percent)
    if given is not None:
        return min(max(given / 100.0, 0.0), 1.0)
    done, total = finite(step), finite(total_steps)
    if done is None or total is None or total <= 0:
        return None
    return min(max(done / total, 0.0), 1.0)


def whole_seconds(value: Any) -> int | None:
    seconds = finite(value)
    if seconds is None or seconds < 0:
        return None
    return min(round(seconds), MAX_ETA_SECONDS)


def metric_text(value: Any) -> str | None:
    """A metric's value as the protocol's string of 1..64 characters, or None to drop it.

    Text is cut to 64 characters; numbers are written as Python reads them back (integral
    ones without ".0"); a number that is not finite is sent as "nan", "inf" or "-inf" (a
    diverged loss is worth seeing); what is not a number or text is dropped.
    """
    if value is None:
        return None
    if isinstance(value, Verbatim):
        return str(value)[:MAX_CHARS] or None
    if isinstance(value, str):
        return value.strip()[:MAX_CHARS] or None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        text = str(value)  # raises past 4300 digits (sys.int_info): caught by the caller
        return text if len(text) <= MAX_CHARS else None
    try:
        number = float(value)
    except Exception:
        return None
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    if number.is_integer() and abs(number) < 2**53:
        return str(int(number))
    return repr(number)  # the shortest text that reads back the same: at most 24 characters


def metric_list(items: Iterable[tuple[Any, Any]]) -> list[dict[str, str]]:
    """The first 256 usable (name, value) pairs, the first of each name winning; a name that
    is not 1..64 characters is dropped, not cut (a cut name would claim to be another)."""
    out: list[dict[str, str]] = []
    seen: set[str] = set()
    for name, value in items:
        if len(out) >= MAX_METRICS:
            break
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_CHARS or name in seen:
            continue
        try:
            text = metric_text(value)
        except Exception:
            continue
        if text is not None:
            seen.add(name)
            out.append({"name": name, "value": text})
    return out


def progress_status(
    fraction: float | None, eta: int | None, final: bool, metrics: Iterable[tuple[Any, Any]]
) -> dict[str, Any]:
    """A report's trainerStatus: how far (``fraction`` done, or 100 when ``final``), the ETA, and
    the metrics within their bounds (:func:`metric_list`)."""
    status: dict[str, Any] = {}
    if final:
        status["progressPercentage"] = 100
    elif fraction is not None:
        # Floored, and 99 at most: 100 says "done", which only the final report may say.
        status["progressPercentage"] = min(int(fraction * 100), 99)
    if eta is not None:
        status["estimatedRemainingSeconds"] = eta
    status["metrics"] = metric_list(metrics)
    return status


def checkpoint_metrics(step: Any, uri: Any, moment: Any) -> list[tuple[str, str]] | None:
    """The metrics that say the checkpoint of ``step`` is complete: its step, when (RFC 3339,
    UTC; a datetime, or text sent as given), and where, in pieces (see CHECKPOINT_URI). None
    when ``step`` is not a count."""
    number = finite(step)
    if number is None or number < 0 or not number.is_integer() or number > 2**53:
        return None
    out = [(CHECKPOINT_STEP, str(int(number)))]
    if isinstance(moment, datetime.datetime):
        # A naive time is local, as datetime.now() gives it. Not datetime.UTC: Python 3.9 has none.
        moment = moment.astimezone(datetime.timezone.utc)
        out.append((CHECKPOINT_TIME, moment.strftime("%Y-%m-%dT%H:%M:%SZ")))
    elif isinstance(moment, str) and moment.strip():
        out.append((CHECKPOINT_TIME, moment.strip()[:MAX_CHARS]))
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if isinstance(uri, str) and 0 < len(uri) <= MAX_URI_CHARS:
        pieces = [Verbatim(uri[i : i + MAX_CHARS]) for i in range(0, len(uri), MAX_CHARS)]
        out += list(zip(uri_piece_names(), pieces))  # noqa: B905 (no strict= before Python 3.10)
    return out
