"""Reading GpuTraining manifests from YAML files, with line numbers for every problem.

A user who typed ``workers: 0`` on line 12 should read ``gputraining.yaml:12: spec.workers:
must be >= 1 (got 0)``, the way a compiler points at a line, and never a traceback.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import sys
from collections.abc import Iterator
from typing import Any, Final

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


# What one manifest file may be. A GpuTraining is a few KiB; these bound what a careless or
# hostile file can cost (`gpuop validate` in CI, the operator's CLI users) to well under a
# second and a few tens of MB, whatever it holds.
MAX_FILE_BYTES: Final = 1024 * 1024
MAX_DEPTH: Final = 64  # nesting of mappings and sequences; a GpuTraining needs 6
# What aliases may add to a document, in scalar characters (a "billion laughs" file expands a
# few KiB into GiB through aliases of aliases).
MAX_ALIAS_EXPANSION: Final = MAX_FILE_BYTES


class _RefusedError(Exception):
    """A YAML construct refused while loading: its line (0-based) and what to say."""

    def __init__(self, mark: yaml.Mark | None, message: str) -> None:
        super().__init__(message)
        self.line = mark.line if mark is not None else None
        self.message = message


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded and strict as the API server's decoding is: no duplicate
    keys (kubectl refuses them; PyYAML would keep the last one silently), string keys only
    (``1:`` or ``yes:`` as a key is an int or a bool in YAML), bounded nesting and aliases."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._expanded = 0
        self._weights: dict[int, int] = {}

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            anchored = self.anchors.get(event.anchor)
            if anchored is not None:
                self._expanded += self._weight(anchored)
                if self._expanded > MAX_ALIAS_EXPANSION:
                    message = f"aliases expand past {MAX_ALIAS_EXPANSION} characters; write the values out"
                    raise _RefusedError(event.start_mark, message)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise _RefusedError(mark, f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _weight(self, node: yaml.Node) -> int:
        """Scalar characters under ``node``, each alias counted again (memoised per node)."""
        known = self._weights.get(id(node))
        if known is not None:
            return known
        if isinstance(node, yaml.ScalarNode):
            weight = len(node.value) + 1
        elif isinstance(node, yaml.SequenceNode):
            weight = 1 + sum(self._weight(item) for item in node.value)
        else:
            weight = 1 + sum(self._weight(k) + self._weight(v) for k, v in node.value)
        self._weights[id(node)] = weight
        return weight

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                found = f"{_short(str(key_node.value))} as {type(key).__name__}"
                raise _RefusedError(
                    key_node.start_mark, f"a mapping key must be a string; YAML reads {found}: quote it"
                )
            if key in seen:
                raise _RefusedError(key_node.start_mark, f"duplicate key {_short(key)}; give it once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _read_text(path: str, source: str) -> str:
    """The file's text, refused when it is not a regular file or is over MAX_FILE_BYTES (a FIFO
    would block at open, /dev/zero would be read until memory runs out)."""
    if path == "-":
        data = sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
    else:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise DocumentError(f"{source}: no such file") from None
        except OSError as exc:
            raise DocumentError(f"{source}: cannot read: {exc.strerror or exc}") from None
        if stat.S_ISDIR(info.st_mode):
            raise DocumentError(f"{source}: is a directory; give a YAML file")
        if not stat.S_ISREG(info.st_mode):
            raise DocumentError(f"{source}: not a regular file (a device, FIFO or socket); give a YAML file")
        if info.st_size > MAX_FILE_BYTES:
            raise DocumentError(f"{source}: {info.st_size} bytes; a manifest may be at most {MAX_FILE_BYTES}")
        try:
            with open(path, "rb") as handle:
                data = handle.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise DocumentError(f"{source}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise DocumentError(f"{source}: over {MAX_FILE_BYTES} bytes; a manifest may be at most that")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{source}: not UTF-8 text (byte {exc.start})") from None


def read_documents(path: str) -> list[Document]:
    """Every non-empty YAML document of ``path`` (``-`` reads standard input)."""
    source = "<stdin>" if path == "-" else path
    text = _read_text(path, source)
    loaded: list[tuple[Any, yaml.Node]] = []
    loader: _StrictLoader | None = None
    try:
        loader = _StrictLoader(text)  # reads ahead: a control character is refused here already
        while loader.check_node():
            node = loader.get_node()
            if node is not None:
                loaded.append((loader.construct_document(node), node))
    except _RefusedError as exc:
        line = f":{exc.line + 1}" if exc.line is not None else ""
        raise DocumentError(f"{source}{line}: {exc.message}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise DocumentError(f"{source}{line}: YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise DocumentError(f"{source}: YAML error: {_short(str(exc), 200)}") from None
    finally:
        if loader is not None:
            loader.dispose()

    documents = [
        Document(source, index, data, node)
        for index, (data, node) in enumerate(loaded, start=1)
        if data is not None
    ]
    if not documents:
        raise DocumentError(f"{source}: no YAML documents in the file")
    return documents
