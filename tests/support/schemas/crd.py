"""What the API server does with a CRD's structural schema, for tests without an API server.

* :func:`apply_defaults`: structural defaulting, as the API server does on create.
* :func:`validate`: the openAPIV3Schema checked with jsonschema (Draft 4, whose boolean
  ``exclusiveMinimum`` OpenAPI 3.0 shares), unknown fields refused (as ``kubectl apply``
  does with server-side strict field validation), ``x-kubernetes-list-map-keys`` unique,
  and every ``x-kubernetes-validations`` CEL rule evaluated with cel-python, including the
  Kubernetes quantity functions our rules use.

Transition rules (those reading ``oldSelf``) run on updates only (``old`` given), and, as in
the API server, only where the value exists in both the old and the new object.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

from gpuop._kits.quantity import parse_quantity


def load_schema(crd_path: Path, version: str | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of one served version of a CRD file."""
    crd = yaml.safe_load(crd_path.read_text())
    versions = crd["spec"]["versions"]
    chosen = next(v for v in versions if version is None or v["name"] == version)
    schema: dict[str, Any] = chosen["schema"]["openAPIV3Schema"]
    return schema


# --------------------------------------------------------------------------------------------
# Defaulting


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A copy of ``value`` with the schema's defaults applied, top down, like the API server."""
    value = copy.deepcopy(value)
    _default_into(schema, value)
    return value


def _default_into(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default_into(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in schema.get("properties", {}):
                    _default_into(extra, value[key])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_into(schema["items"], item)


# --------------------------------------------------------------------------------------------
# Validation


def _strict(schema: Any, root: bool = True) -> Any:
    """The schema with unknown fields refused wherever the schema lists the known ones, but
    in the root's metadata: the API server checks ObjectMeta itself, and the schema may only
    narrow its name (so the real server accepts a namespace there whatever the schema lists)."""
    if isinstance(schema, dict):
        out = {k: _strict(v, root=False) for k, v in schema.items()}
        if root and "metadata" in schema.get("properties", {}):
            out["properties"]["metadata"] = schema["properties"]["metadata"]
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v, root=False) for v in schema]
    return schema


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Quantity:
    def __init__(self, value: Fraction) -> None:
        self.value = value


def _cel_quantity(text: Any) -> _Quantity:
    return _Quantity(parse_quantity(str(text)))


def _cel_is_less_than(a: _Quantity, b: _Quantity) -> celpy.celtypes.BoolType:
    return celpy.celtypes.BoolType(a.value < b.value)


CEL_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": _cel_quantity,
    "isLessThan": _cel_is_less_than,
}
_CEL = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


_ABSENT: Any = object()


def evaluate_cel(rule: str, self_value: Any, old_value: Any = _ABSENT) -> bool:
    """One CEL rule with ``self`` (and ``oldSelf``) bound to JSON values, as the API server does."""
    program = _PROGRAMS.get(rule)
    if program is None:
        program = _PROGRAMS[rule] = _CEL.program(_CEL.compile(rule), functions=CEL_FUNCTIONS)
    bindings = {"self": celpy.json_to_cel(self_value)}
    if old_value is not _ABSENT:
        bindings["oldSelf"] = celpy.json_to_cel(old_value)
    result = program.evaluate(bindings)
    if isinstance(result, celpy.CELEvalError):
        raise result
    return bool(result)


def _cel_errors(schema: dict[str, Any], value: Any, path: str, old: Any = _ABSENT) -> Iterator[str]:
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            if old is _ABSENT:
                continue
            ok = evaluate_cel(rule["rule"], value, old)
        else:
            ok = evaluate_cel(rule["rule"], value)
        if not ok:
            where = path + rule.get("fieldPath", "") if "oldSelf" in rule["rule"] else path
            yield f"{where or '<root>'}: {rule['message']}"
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                old_sub = old.get(key, _ABSENT) if isinstance(old, dict) else _ABSENT
                yield from _cel_errors(sub, value[key], f"{path}.{key}" if path else key, old_sub)
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):  # list items are not correlated with old ones here
            yield from _cel_errors(schema["items"], item, f"{path}[{index}]")


def _list_map_errors(schema: dict[str, Any], value: Any, path: str) -> Iterator[str]:
    if isinstance(value, list):
        keys = schema.get("x-kubernetes-list-map-keys")
        if keys:
            seen: set[tuple[Any, ...]] = set()
            for index, item in enumerate(value):
                key = tuple(item.get(k) for k in keys)
                if key in seen:
                    yield f"{path}[{index}]: duplicate entry for key {key}"
                seen.add(key)
        for index, item in enumerate(value):
            yield from _list_map_errors(schema.get("items", {}), item, f"{path}[{index}]")
    elif isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                yield from _list_map_errors(sub, value[key], f"{path}.{key}" if path else key)


def validate(schema: dict[str, Any], obj: Any, *, defaults: bool = True, old: Any = None) -> list[str]:
    """Every way ``obj`` breaks the schema, one string each; empty when it is valid.

    ``old``: the object being updated, for the transition rules.
    """
    if defaults:
        obj = apply_defaults(schema, obj)
    validator = jsonschema.Draft4Validator(_strict(schema))
    errors = [f"{_path(e.absolute_path) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
    if errors:  # CEL assumes a schema-valid object, as in the API server
        return sorted(errors)
    previous = apply_defaults(schema, old) if old is not None else _ABSENT
    return sorted([*_list_map_errors(schema, obj, ""), *_cel_errors(schema, obj, "", previous)])
