"""A dataclass model as a structural openAPIV3Schema: what the CRD says of each field
(type, description, default, bounds, patterns, list maps) and its CEL rules.

The model's fields and rules are declared with :mod:`gpuop._kits.schema`; the CRD generator
(:mod:`gpuop.api.crd`) calls :func:`openapi_schema` on the spec and status.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, get_args, get_origin

from gpuop._kits.quantity import AMOUNT_PATTERN
from gpuop._kits.schema import (
    FieldDoc,
    Quantity,
    Rule,
    class_rules,
    encode,
    field_slots,
    is_mapping,
    is_tuple,
    item_doc,
)


def openapi_schema(cls: type, description: str) -> dict[str, Any]:
    """The structural schema of a dataclass, with descriptions, defaults, bounds and CEL."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for slot in field_slots(cls):
        schema = _value_schema(slot.hint, slot.doc, slot.doc.description)
        if slot.default is not dataclasses.MISSING and slot.default is not None:
            default = encode(slot.default)
            if default not in ([], {}) or dataclasses.is_dataclass(slot.hint):
                # An object default of {} lets the API server default its fields; an empty
                # list or map needs no default, absent already means empty.
                schema["default"] = default
        elif slot.default is dataclasses.MISSING and not slot.optional:
            required.append(slot.key)
        rules = [cel_rule(rule) for rule in slot.doc.rules]
        if rules:
            schema["x-kubernetes-validations"] = rules
        properties[slot.key] = schema
    # No empty description: the API server drops it (list items carry theirs on the list).
    schema = {
        "type": "object",
        **({"description": description} if description else {}),
        "properties": properties,
    }
    if required:
        schema["required"] = required
    rules = [cel_rule(rule) for rule in class_rules(cls)]
    if rules:
        schema["x-kubernetes-validations"] = rules
    return schema


def _value_schema(hint: Any, doc: FieldDoc, description: str) -> dict[str, Any]:
    if dataclasses.is_dataclass(hint):
        return openapi_schema(typing.cast(type, hint), description)
    schema: dict[str, Any] = {"description": description} if description else {}
    if get_origin(hint) is Literal:
        schema.update(type="string", enum=list(get_args(hint)))
    elif hint is Quantity:
        schema.update(
            {
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "pattern": AMOUNT_PATTERN,
                "x-kubernetes-int-or-string": True,
            }
        )
    elif is_tuple(hint):
        schema.update(type="array", items=_value_schema(get_args(hint)[0], item_doc(doc), ""))
        if doc.max_items is not None:
            schema["maxItems"] = doc.max_items
        if doc.list_map_key is not None:
            schema["x-kubernetes-list-type"] = "map"
            schema["x-kubernetes-list-map-keys"] = [doc.list_map_key]
    elif is_mapping(hint):
        values: dict[str, Any] = {"type": "string"}
        if doc.item_max_length is not None:
            values["maxLength"] = doc.item_max_length
        schema.update(type="object", additionalProperties=values)
        if doc.max_properties is not None:
            schema["maxProperties"] = doc.max_properties
    elif hint is bool:
        schema["type"] = "boolean"
    elif hint is int or hint is float:
        schema["type"] = "integer" if hint is int else "number"
        if doc.minimum is not None:
            schema["minimum"] = doc.minimum
            if doc.exclusive_minimum:
                schema["exclusiveMinimum"] = True
        if doc.maximum is not None:
            schema["maximum"] = doc.maximum
    elif hint is str:
        schema["type"] = "string"
        if doc.min_length is not None:
            schema["minLength"] = doc.min_length
        if doc.max_length is not None:
            schema["maxLength"] = doc.max_length
        if doc.pattern is not None:
            schema["pattern"] = doc.pattern
        if doc.date_time:
            schema["format"] = "date-time"
    else:
        raise TypeError(f"unsupported field type {hint!r}")
    return schema


def cel_rule(rule: Rule) -> dict[str, str]:
    """A rule as the CRD says it: x-kubernetes-validations' entry."""
    out = {"rule": rule.cel, "message": rule.cel_message}
    if rule.field:
        out["fieldPath"] = rule.field
    return out
