"""Reading GpuTraining manifests from YAML files, with line numbers for every problem.

A user who typed ``workers: 0`` on line 12 should read ``gputraining.yaml:12: spec.workers:
must be >= 1 (got 0)``, the way a compiler points at a line, and never a traceback.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from typing import Any

import yaml


class DocumentError(Exception):
    """A file could not be read as YAML documents; the message is one line for people."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One YAML document of a file: its data and a way to find a field's line."""

    source: str
    index: int  # 1-based position in the file
    data: Any
    node: yaml.Node | None

    def line_of(self, path: str) -> int:
        """The 1-based line of ``path`` (``spec.env[0].name``) or of its nearest existing parent."""
        node = self.node
        if node is None:
            return 1
        line = node.start_mark.line
        for part in _path_parts(path):
            child: yaml.Node | None = None
            if isinstance(part, int) and isinstance(node, yaml.SequenceNode):
                child = node.value[part] if part < len(node.value) else None
            elif isinstance(part, str) and isinstance(node, yaml.MappingNode):
                for key, value in node.value:
                    if isinstance(key, yaml.ScalarNode) and key.value == part:
                        # The value's line, unless the value is a block on the lines below.
                        if isinstance(value, yaml.ScalarNode) or value.flow_style:
                            line = value.start_mark.line
                        else:
                            line = key.start_mark.line
                        child = value
                        break
            if child is None:
                break
            node = child
        return line + 1

    def where(self, path: str) -> str:
        """``file:line`` for a field."""
        return f"{self.source}:{self.line_of(path)}"


def _path_parts(path: str) -> Iterator[str | int]:
    for part in path.split("."):
        match = re.fullmatch(r"([^\[]*)((?:\[\d+\])*)", part)
        if match is None:
            yield part
            continue
        if match.group(1):
            yield match.group(1)
        for index in re.findall(r"\[(\d+)\]", match.group(2)):
            yield int(index)


def read_documents(path: str) -> list[Document]:
    """Every non-empty YAML document of ``path`` (``-`` reads standard input)."""
    source = "<stdin>" if path == "-" else path
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
    except FileNotFoundError:
        raise DocumentError(f"{source}: no such file") from None
    except IsADirectoryError:
        raise DocumentError(f"{source}: is a directory; give a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DocumentError(f"{source}: cannot read: {exc}") from None

    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        datas = list(yaml.safe_load_all(text))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise DocumentError(f"{source}{line}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise DocumentError(f"{source}: YAML error: {exc}") from None

    documents = [
        Document(source, index, data, node)
        for index, (data, node) in enumerate(zip(datas, nodes, strict=True), start=1)
        if data is not None
    ]
    if not documents:
        raise DocumentError(f"{source}: no YAML documents in the file")
    return documents
