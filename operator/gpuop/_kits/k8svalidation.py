"""Kubernetes' own rules for names, label keys and values, and paths, written once. Pure.

The same rules as apimachinery's ``validation`` package (IsQualifiedName, IsValidLabelValue,
IsDNS1123Subdomain) and core/v1's volume-mount path checks, so what ``gpuop validate`` passes
the API server does not refuse later, at the pod. Each returns None when the value is valid,
else what is wrong, for a message that names the field.

Patterns are matched with :func:`fullmatch`: Python's ``$`` also matches before a trailing
newline, Go's does not.
"""

from __future__ import annotations

import re
from typing import Final

_NAME_PART: Final = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SUBDOMAIN: Final = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def fullmatch(pattern: str, text: str) -> bool:
    """Whether ``text`` matches ``pattern`` (anchored with ^ and $) as Go's regexp would."""
    found = re.search(pattern, text)
    return found is not None and (not pattern.endswith("$") or found.end() == len(text))


def subdomain(name: str) -> str | None:
    """A DNS-1123 subdomain: Secret, ServiceAccount, PVC and most object names."""
    if len(name) > 253:
        return "must be at most 253 characters"
    if not _SUBDOMAIN.fullmatch(name):
        return "must be a lowercase DNS name (letters, digits, '-' and '.', starting and ending alphanumeric)"
    return None


def qualified_name(key: str) -> str | None:
    """A label or annotation key, a nodeSelector or toleration key: [prefix/]name."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or subdomain(prefix) is not None):
        return "must have a DNS subdomain prefix before its '/', such as example.com/name"
    if not name or len(name) > 63 or not _NAME_PART.fullmatch(name):
        return (
            "must be a name of at most 63 characters (letters, digits, '-', '_' and '.', starting and "
            "ending alphanumeric), with an optional DNS prefix and '/'"
        )
    return None


def label_value(value: str) -> str | None:
    if value and (len(value) > 63 or not _NAME_PART.fullmatch(value)):
        return (
            "must be empty or at most 63 characters (letters, digits, '-', '_' and '.', starting and "
            "ending alphanumeric)"
        )
    return None


def mount_path(path: str) -> str | None:
    """A container mount path: absolute, no '..' element."""
    if not path.startswith("/"):
        return "must be an absolute path"
    if ".." in path.split("/"):
        return "must not contain '..'"
    return None


def sub_path(path: str) -> str | None:
    """A volume subPath: relative, no '..' element."""
    if path.startswith("/"):
        return "must be a relative path inside the volume"
    if ".." in path.split("/"):
        return "must not contain '..'"
    return None
