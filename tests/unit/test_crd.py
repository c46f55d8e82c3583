"""The CRD file: current, a valid CustomResourceDefinition, structural, useful to kubectl."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpuop.api.apidoc import api_reference
from gpuop.api.crd import build_crd, crd_yaml
from gpuop.backends.registry import all_gaps, summaries
from support.paths import REFERENCE, ROOT
from support.schemas.crd import load_schema, validate
from support.schemas.kubeflow import KUBERNETES_VERSIONS
from support.specs import EXAMPLES, load_example

CRD_FILE = ROOT / "crds" / "gputraining.yaml"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CRD_FILE.read_text())
    return loaded


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return load_schema(CRD_FILE)


def test_crd_file_is_what_the_model_generates() -> None:
    assert CRD_FILE.read_text() == crd_yaml(summaries(), all_gaps()), (
        "crds/gputraining.yaml is stale: run `make crds`"
    )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_crd_is_a_valid_custom_resource_definition(crd: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(crd, version, strict=True)


def _schemas(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _schemas(sub, f"{path}.{key}")
    if "items" in node:
        yield from _schemas(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _schemas(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    """Every node has a type (or is int-or-string); no preserve-unknown-fields escape hatch."""
    for path, node in _schemas(schema, ""):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not node.get("x-kubernetes-preserve-unknown-fields"), path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path


def test_every_field_has_a_description(schema: dict[str, Any]) -> None:
    for section in ("spec", "status"):
        for path, node in _schemas(schema["properties"][section], section):
            if not path.endswith(("[]", "{}")):
                assert node.get("description"), f"{path} has no description for kubectl explain"


def test_strings_lists_and_maps_are_bounded(schema: dict[str, Any]) -> None:
    """The API server estimates CEL cost from these bounds and refuses unbounded rules; and what
    a hostile object can make it store is bounded: every string (list items and map values
    too), list and map."""
    for path, node in _schemas(schema["properties"]["spec"], "spec"):
        if node.get("type") == "array":
            assert "maxItems" in node, path
        if node.get("type") == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, path
            assert "maxLength" in node["additionalProperties"], f"{path}: its values"
        if node.get("type") == "string" and "enum" not in node:
            assert "maxLength" in node, path


def test_defaults_are_valid_values(schema: dict[str, Any]) -> None:
    """The API server refuses a CRD whose defaults break their own schema."""
    for path, node in _schemas(schema, ""):
        if "default" in node:
            assert validate(node, node["default"]) == [], path


def test_status_is_a_subresource_and_printer_columns_resolve(
    crd: dict[str, Any], schema: dict[str, Any]
) -> None:
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns if not c.get("priority")] == [
        "Phase",
        "Workers",
        "GPUs",
        "Progress",
        "Loss",
        "GPU-Util",
        "ETA",
        "Age",
    ]
    # `kubectl get -o wide` adds these.
    assert [c["name"] for c in columns if c.get("priority") == 1] == [
        "Backend",
        "Queue",
        "GPU-Model",
        "Samples/s",
        "Checkpoint",
    ]
    for column in version["additionalPrinterColumns"]:
        node = schema
        for part in column["jsonPath"].lstrip(".").split("."):
            if (
                part in ("metadata", "creationTimestamp")
                and node.get("type") == "object"
                and part not in node.get("properties", {})
            ):
                break
            node = node["properties"][part]
        else:
            expected = {"string": "string", "integer": "integer", "number": "number", "date": "string"}[
                column["type"]
            ]
            assert node["type"] == expected, column


def test_names(crd: dict[str, Any]) -> None:
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["kind"], names["plural"], crd["spec"]["scope"]) == (
        "gpuop.io",
        "GpuTraining",
        "gputrainings",
        "Namespaced",
    )
    assert names["shortNames"] == ["gtr"]
    assert crd["metadata"]["name"] == "gputrainings.gpuop.io"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_valid_gputrainings(schema: dict[str, Any], example: Path) -> None:
    assert validate(schema, load_example(example)) == []


def test_vendored_kubeflow_crd_is_the_reference_one() -> None:
    """tests/reference holds a verbatim copy; where the shared reference is beside us, they agree."""
    vendored = REFERENCE / "kubeflow.org_pytorchjobs.yaml"
    digest = hashlib.sha256(vendored.read_bytes()).hexdigest()
    assert digest == "8b8a8a719cc94173169290251e817f7ac2bb425c20b6c2fa813397bcf4e932ed"
    shared = ROOT.parent / "shared" / "reference" / vendored.name
    if shared.exists():
        assert shared.read_bytes() == vendored.read_bytes()


def test_the_api_reference_documents_every_field_and_rule() -> None:
    """docs/api.md comes from the CRD (`make crd` checks it is current); here: it is complete."""
    crd = build_crd(summaries(), all_gaps())
    text = api_reference(crd)
    assert (ROOT / "docs" / "api.md").read_text() == text, "run `make crds`"
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]

    def walk(path: str, schema: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
        target = schema.get("items", schema) if schema.get("type") == "array" else schema
        for name, sub in target.get("properties", {}).items():
            yield path, name, sub
            yield from walk(f"{path}.{name}" + ("[]" if sub.get("type") == "array" else ""), sub)
        for rule in target.get("x-kubernetes-validations", []):
            assert rule["message"] in text

    for section in ("spec", "status"):
        for path, name, sub in walk(section, root[section]):
            section_start = text.index(f"### `{path}`\n")
            section_text = text[section_start : text.find("\n### ", section_start + 1)]
            assert f"| `{name}`" in section_text, f"{path}.{name} missing from its table"
            for rule in sub.get("x-kubernetes-validations", []):
                assert rule["message"] in section_text, f"{path}.{name}: rule missing"
