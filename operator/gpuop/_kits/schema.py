"""Typed API objects described once, read by two consumers.

A GpuTraining spec is a tree of frozen dataclasses. Each field carries its documentation,
bounds and default in :func:`api_field`; each class may carry cross-field :class:`Rule` s,
each written twice side by side: as CEL for the API server and as a Python check for
``parse``. From that one description:

* :func:`decode` turns a JSON-like mapping into typed objects, collecting *every* problem as
  a :class:`Problem` with the field path, the rule and the value it got;
* :func:`openapi_schema` produces the structural openAPIV3Schema for the CRD.

So the CRD and the spec model cannot drift apart: the CRD is generated from the model, and
``tests/unit/test_crd_agreement.py`` proves that the generated CEL and the Python checks
give the same verdicts.

Why not pydantic: its messages and JSON schema are its own (``anyOf`` for optionals,
``$defs`` references), and a structural Kubernetes schema needs neither.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, NewType, TypeVar, Union, get_args, get_origin

from gpuop._kits import k8svalidation
from gpuop._kits.quantity import MAX_QUANTITY, is_quantity, parse_quantity

Quantity = NewType("Quantity", str)
"""A Kubernetes resource quantity (``2Gi``, ``500m``), kept as the user wrote it."""

_META_KEY: Final = "gpuop"
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with an object: where, and what the rule says."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class SpecError(ValueError):
    """An object broke one or more rules; ``problems`` lists each, in document order."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(str(p) for p in problems))
        self.problems = tuple(problems)


class _Words(dict[str, object]):
    """Values for a message's ``{placeholders}``; one not given reads as nothing."""

    def __missing__(self, key: str) -> str:
        return ""


@dataclasses.dataclass(frozen=True)
class Rule:
    """A validation rule, as CEL for the API server and as Python for ``parse``, with its
    message written once.

    ``cel`` sees ``self`` as the JSON of the object the rule is attached to (after
    defaulting). ``check`` sees the same object typed, and returns ``None`` when the rule
    holds, else the values to put in the message's ``{placeholders}`` (what was given, e.g.
    ``{"got": " (got 5)"}``). The CRD's message cannot name values: it reads ``cel_words``
    there, and nothing for a placeholder they do not fill. ``field`` names the offending
    field relative to that object, both for the CRD's ``fieldPath`` and for the path in the
    Python message.
    """

    cel: str
    message: str
    check: Callable[[Any], Mapping[str, object] | None]
    field: str = ""
    cel_words: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def cel_message(self) -> str:
        """The message as the API server says it."""
        return self.message.format_map(_Words(self.cel_words))

    def violation(self, value: Any) -> str | None:
        """The message for ``value``, or None when the rule holds."""
        found = self.check(value)
        return None if found is None else self.message.format_map(_Words(found))


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """What a field means and which values it takes; see :func:`api_field`."""

    description: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    pattern_hint: str = ""
    max_items: int | None = None
    max_properties: int | None = None
    item_max_length: int | None = None  # of each string in a list, or each value of a map
    list_map_key: str | None = None
    date_time: bool = False
    rules: tuple[Rule, ...] = ()


def api_field(
    description: str,
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    min_length: int | None = None,
    max_length: int | None = None,
    pattern: str | None = None,
    pattern_hint: str = "",
    max_items: int | None = None,
    max_properties: int | None = None,
    item_max_length: int | None = None,
    list_map_key: str | None = None,
    date_time: bool = False,
    rules: tuple[Rule, ...] = (),
) -> Any:
    """A dataclass field with its API documentation and constraints.

    A field with neither default is required, unless its type admits ``None``.
    """
    doc = FieldDoc(
        description=description,
        minimum=minimum,
        maximum=maximum,
        exclusive_minimum=exclusive_minimum,
        min_length=min_length,
        max_length=max_length,
        pattern=pattern,
        pattern_hint=pattern_hint,
        max_items=max_items,
        max_properties=max_properties,
        item_max_length=item_max_length,
        list_map_key=list_map_key,
        date_time=date_time,
        rules=rules,
    )
    metadata = {_META_KEY: doc}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@typing.dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(api_field,))
def api_object(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a frozen, keyword-only dataclass (keyword-only because required and
    defaulted fields interleave in API order)."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


def json_name(field_name: str) -> str:
    """The API's camelCase name of a Python field (``gpus_per_worker`` -> ``gpusPerWorker``)."""
    head, *rest = field_name.split("_")
    return head + "".join(part.capitalize() for part in rest)


# --------------------------------------------------------------------------------------------
# Type introspection shared by decode and openapi_schema.


@dataclasses.dataclass(frozen=True)
class _Slot:
    name: str
    key: str
    hint: Any
    doc: FieldDoc
    optional: bool
    default: Any  # dataclasses.MISSING when required


def field_slots(cls: type) -> tuple[_Slot, ...]:
    cached: tuple[_Slot, ...] | None = cls.__dict__.get("_gpuop_slots")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    slots = []
    for f in dataclasses.fields(cls):
        doc = f.metadata.get(_META_KEY)
        if doc is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with api_field()")
        hint, optional = unwrap_optional(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        slots.append(_Slot(f.name, json_name(f.name), hint, doc, optional, default))
    result = tuple(slots)
    setattr(cls, "_gpuop_slots", result)  # noqa: B010 - a cache on the class itself
    return result


def unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(get_args(hint)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union {hint!r}")
    return hint, False


def class_rules(cls: type) -> tuple[Rule, ...]:
    rules: tuple[Rule, ...] = getattr(cls, "RULES", ())
    return rules


def is_tuple(hint: Any) -> bool:
    return get_origin(hint) is tuple


def is_mapping(hint: Any) -> bool:
    return get_origin(hint) in (Mapping, dict)


# --------------------------------------------------------------------------------------------
# Decoding: JSON-like data -> typed objects, with every problem reported.


def decode(cls: type[_T], data: Any, path: str) -> _T:
    """Build ``cls`` from ``data``, applying defaults; raises :class:`SpecError`."""
    problems: list[Problem] = []
    result = _decode_object(cls, data, path, problems)
    if problems or result is None:
        raise SpecError(problems)
    return result


def _decode_object(cls: type[_T], data: Any, path: str, problems: list[Problem]) -> _T | None:
    if not isinstance(data, Mapping):
        problems.append(Problem(path, f"must be an object (got {show(data)})"))
        return None
    slots = field_slots(cls)
    known = {s.key for s in slots}
    before = len(problems)
    for key in data:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            suggestion = f'; did you mean "{hint[0]}"?' if hint else ""
            problems.append(Problem(_join(path, str(key)), f"unknown field{suggestion}"))
    values: dict[str, Any] = {}
    for slot in slots:
        raw = data.get(slot.key)
        where = _join(path, slot.key)
        if raw is None:  # absent, or an explicit null, which the API server prunes too
            if slot.default is not dataclasses.MISSING:
                values[slot.name] = slot.default
            elif slot.optional:
                values[slot.name] = None
            else:
                problems.append(Problem(where, "required"))
            continue
        value = _decode_value(slot.hint, slot.doc, raw, where, problems)
        if value is not None:
            for rule in slot.doc.rules:
                message = rule.violation(value)
                if message is not None:
                    problems.append(Problem(_join(where, rule.field.lstrip(".")), message))
        values[slot.name] = value
    if len(problems) > before:
        return None
    obj = cls(**values)
    for rule in class_rules(cls):
        message = rule.violation(obj)
        if message is not None:
            problems.append(Problem(_join(path, rule.field.lstrip(".")), message))
    return None if len(problems) > before else obj


def _decode_value(hint: Any, doc: FieldDoc, raw: Any, path: str, problems: list[Problem]) -> Any:
    if dataclasses.is_dataclass(hint):
        return _decode_object(typing.cast(type, hint), raw, path, problems)
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        if raw not in choices:
            problems.append(Problem(path, f"must be one of {', '.join(choices)} (got {show(raw)})"))
            return None
        return raw
    if hint is Quantity:
        return _decode_quantity(raw, path, problems)
    if is_tuple(hint):
        return _decode_list(get_args(hint)[0], doc, raw, path, problems)
    if is_mapping(hint):
        return _decode_mapping(doc, raw, path, problems)
    if hint is bool:
        if not isinstance(raw, bool):
            problems.append(Problem(path, f"must be true or false (got {show(raw)})"))
            return None
        return raw
    if hint is int or hint is float:
        return _decode_number(hint, doc, raw, path, problems)
    if hint is str:
        return _decode_string(doc, raw, path, problems)
    raise TypeError(f"unsupported field type {hint!r} at {path}")


def _decode_quantity(raw: Any, path: str, problems: list[Problem]) -> Quantity | None:
    is_integer = isinstance(raw, int) and not isinstance(raw, bool)
    if not is_integer and not (isinstance(raw, str) and is_quantity(raw)):
        problems.append(
            Problem(path, f"must be a Kubernetes quantity such as 512Mi or 2Gi (got {show(raw)})")
        )
        return None
    try:
        value = parse_quantity(raw)  # bounded: a huge integer is refused before anything prints it
    except ValueError:
        problems.append(Problem(path, f"must be at most {MAX_QUANTITY}, Kubernetes' int64 (got {show(raw)})"))
        return None
    if value < 0:  # every quantity here is an amount: a negative one would render a negative sizeLimit
        problems.append(Problem(path, f"must not be negative (got {show(raw)})"))
        return None
    return Quantity(str(raw))


def _decode_list(
    item_hint: Any, doc: FieldDoc, raw: Any, path: str, problems: list[Problem]
) -> tuple[Any, ...] | None:
    if not isinstance(raw, list):
        problems.append(Problem(path, f"must be a list (got {show(raw)})"))
        return None
    if doc.max_items is not None and len(raw) > doc.max_items:
        problems.append(Problem(path, f"must have at most {doc.max_items} items (got {len(raw)})"))
        return None
    before = len(problems)
    items = []
    for index, item in enumerate(raw):
        items.append(_decode_value(item_hint, item_doc(doc), item, f"{path}[{index}]", problems))
    if doc.list_map_key is not None and len(problems) == before:
        seen: set[Any] = set()
        for index, item in enumerate(raw):
            key = item.get(doc.list_map_key)
            if key in seen:
                # The item, as the API server names a list-map duplicate ("spec.env[1]: Duplicate value").
                problems.append(Problem(f"{path}[{index}]", f"duplicate {doc.list_map_key} {show(key)}"))
            seen.add(key)
    return None if len(problems) > before else tuple(items)


_ITEM_DOC: Final = FieldDoc(description="")


def item_doc(doc: FieldDoc) -> FieldDoc:
    """What each item of a list field must be: bounded as the field says."""
    return (
        _ITEM_DOC if doc.item_max_length is None else FieldDoc(description="", max_length=doc.item_max_length)
    )


def _decode_mapping(doc: FieldDoc, raw: Any, path: str, problems: list[Problem]) -> Mapping[str, str] | None:
    if not isinstance(raw, Mapping):
        problems.append(Problem(path, f"must be a map of strings (got {show(raw)})"))
        return None
    if doc.max_properties is not None and len(raw) > doc.max_properties:
        problems.append(Problem(path, f"must have at most {doc.max_properties} entries (got {len(raw)})"))
        return None
    before = len(problems)
    for key, value in raw.items():
        if not isinstance(key, str):  # from YAML, where `1:` and `yes:` are an int and a bool
            problems.append(Problem(path, f"keys must be strings (got {show(key)})"))
        elif not isinstance(value, str):
            problems.append(Problem(_join(path, str(key)), f"must be a string (got {show(value)})"))
        elif doc.item_max_length is not None and len(value) > doc.item_max_length:
            problems.append(
                Problem(_join(path, key), f"must be at most {doc.item_max_length} characters long")
            )
    return None if len(problems) > before else types.MappingProxyType(dict(raw))


def _decode_number(
    hint: type, doc: FieldDoc, raw: Any, path: str, problems: list[Problem]
) -> int | float | None:
    # bool is an int in Python but not in JSON; a float field accepts integers as JSON does.
    ok = isinstance(raw, int) if hint is int else isinstance(raw, (int, float))
    if isinstance(raw, bool) or not ok:
        kind = "an integer" if hint is int else "a number"
        problems.append(Problem(path, f"must be {kind} (got {show(raw)})"))
        return None
    if not math.isfinite(raw):  # YAML's .nan and .inf; JSON has neither, so the API server never sends them
        problems.append(Problem(path, f"must be a finite number (got {show(raw)})"))
        return None
    if doc.minimum is not None:
        if doc.exclusive_minimum and raw <= doc.minimum:
            problems.append(Problem(path, f"must be > {_num(doc.minimum)} (got {show(raw)})"))
            return None
        if raw < doc.minimum:
            problems.append(Problem(path, f"must be >= {_num(doc.minimum)} (got {show(raw)})"))
            return None
    if doc.maximum is not None and raw > doc.maximum:
        problems.append(Problem(path, f"must be <= {_num(doc.maximum)} (got {show(raw)})"))
        return None
    return float(raw) if hint is float else raw


def _decode_string(doc: FieldDoc, raw: Any, path: str, problems: list[Problem]) -> str | None:
    if not isinstance(raw, str):
        problems.append(Problem(path, f"must be a string (got {show(raw)})"))
        return None
    if doc.min_length is not None and len(raw) < doc.min_length:
        problems.append(Problem(path, f"must not be empty (got {show(raw)})"))
        return None
    if doc.max_length is not None and len(raw) > doc.max_length:
        problems.append(Problem(path, f"must be at most {doc.max_length} characters long"))
        return None
    if doc.pattern is not None and not k8svalidation.fullmatch(doc.pattern, raw):
        what = doc.pattern_hint or f"match {doc.pattern}"
        problems.append(Problem(path, f"must be {what} (got {show(raw)})"))
        return None
    return raw


def _join(path: str, key: str) -> str:
    if not key:
        return path
    key = key if len(key) <= _SHOWN_CHARACTERS else f"{key[: _SHOWN_CHARACTERS - 3]}..."
    return f"{path}.{key}" if path else key


_SHOWN_CHARACTERS: Final = 80


def show(value: Any) -> str:
    """A value as a message quotes it: shortened, and with control characters escaped, so an
    error line stays one line of a readable length."""
    if isinstance(value, str):
        if len(value) > _SHOWN_CHARACTERS:
            head = json.dumps(value[: _SHOWN_CHARACTERS - 3] + "...", ensure_ascii=False)
            return f"{head} ({len(value)} characters)"
        return json.dumps(value, ensure_ascii=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value.bit_length() > 128:  # Python refuses to print huge ones
        return f"a {value.bit_length()}-bit integer"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# --------------------------------------------------------------------------------------------
# Encoding: typed objects -> the JSON the API server would hold after defaulting.


def encode(obj: Any) -> Any:
    """The JSON form of a decoded object: camelCase keys, absent optionals left out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, Any] = {}
        for slot in field_slots(type(obj)):
            value = getattr(obj, slot.name)
            # An absent collection means an empty one, as in Kubernetes: leave both out.
            if value is not None and not (isinstance(value, (tuple, Mapping)) and not value):
                out[slot.key] = encode(value)
        return out
    if isinstance(obj, tuple):
        return [encode(item) for item in obj]
    if isinstance(obj, Mapping):
        return {key: encode(value) for key, value in obj.items()}
    return obj
