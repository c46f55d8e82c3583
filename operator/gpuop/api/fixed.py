"""Fields fixed at creation: the record of the spec a job was made from, and what changed since.

A job carries the record (an annotation); the operator compares it with the spec now to say
which fixed fields changed after the job was made (the SpecNotApplied condition), in case the
change got past a CRD without its transition rules.
"""

import dataclasses
import json
from typing import Any

from gpuop._kits.schema import (
    SpecError,
    decode,
    encode,
    json_name,
)
from gpuop.api.spec import MUTABLE_SPEC_FIELDS, GpuTrainingSpec


def fixed_spec(spec: GpuTrainingSpec, mutable: tuple[str, ...] = MUTABLE_SPEC_FIELDS) -> dict[str, Any]:
    """The spec without what may change on a made job, as JSON: what the job is made of.

    ``mutable``: dotted field paths, each backend's own (a TrainJob's is narrower: of runPolicy
    only suspend, as its activeDeadlineSeconds is immutable and its backoffLimit is in the
    TrainingRuntime, made once).
    """
    document: dict[str, Any] = encode(spec)
    for path in mutable:
        *parents, leaf = path.split(".")
        node = document
        for parent in parents:
            node = node.get(parent) or {}
        node.pop(leaf, None)
    return document


def fixed_spec_record(spec: GpuTrainingSpec, mutable: tuple[str, ...] = MUTABLE_SPEC_FIELDS) -> str:
    """:func:`fixed_spec` as the compact JSON a job carries (read by :func:`fixed_spec_changes`)."""
    return json.dumps(fixed_spec(spec, mutable), separators=(",", ":"), sort_keys=True)


def fixed_spec_changes(record: str, spec: GpuTrainingSpec) -> tuple[str, ...]:
    """The fixed fields that differ between what a job was created from and ``spec`` now.

    The CRD's transition rules refuse such changes; this catches those that got past a CRD
    without them (applied before the CRD was upgraded). ``record`` (from
    :func:`fixed_spec_record`) is decoded with today's model, so a field added by an operator
    upgrade takes its default on both sides and is no change. One entry per leaf, e.g.
    ``spec.workers (2 -> 4)``; nothing when the record cannot be read (not JSON, or written by
    a newer operator).
    """
    try:
        created_from = json.loads(record)
        if not isinstance(created_from, dict):
            return ()
        before = decode(GpuTrainingSpec, created_from, "spec")
    except (ValueError, SpecError):
        return ()
    changes: list[str] = []
    for field in dataclasses.fields(GpuTrainingSpec):
        key = json_name(field.name)
        if key not in MUTABLE_SPEC_FIELDS:
            _diff(getattr(before, field.name), getattr(spec, field.name), f"spec.{key}", changes)
    if "runPolicy" in created_from:  # a TrainJob's record: of runPolicy, only suspend may change
        made = dataclasses.replace(before.run_policy, suspend=spec.run_policy.suspend)
        _diff(made, spec.run_policy, "spec.runPolicy", changes)
    return tuple(changes)


def _diff(before: Any, after: Any, path: str, out: list[str]) -> None:
    if before == after:
        return
    if dataclasses.is_dataclass(before) and type(before) is type(after):
        for field in dataclasses.fields(before):
            _diff(
                getattr(before, field.name),
                getattr(after, field.name),
                f"{path}.{json_name(field.name)}",
                out,
            )
        return
    show = all(isinstance(v, (int, float, str, bool, type(None))) for v in (before, after))
    out.append(f"{path} ({_shown(before)} -> {_shown(after)})" if show else path)


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)
