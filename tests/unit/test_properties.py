"""Properties over generated input: whatever a file or an API object holds, `parse` returns a
spec or refuses it with the project's own error, a parsed spec always renders, the manifest
reader returns documents or one DocumentError, and each within a time bound.

Bodies are drawn around a valid spec (its real field names, with values of any JSON type, any
size of string, nested anything), where a crash would hide; hypothesis shrinks any failure to
the smallest body that shows it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuop._kits.schema import SpecError
from gpuop.api.spec import parse
from gpuop.backends.registry import render_job
from gpuop.cli.documents import DocumentError, read_documents
from support.cost import thread_seconds
from support.specs import minimal

# One second per example, as the issue asks of every bad file; the shrinking phase excluded.
BOUND_SECONDS = 1.0
SETTINGS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=300),
    st.sampled_from(
        ["1e999999999", "9e99999", "1E", "1Ei", "-1Gi", "0", "/dev/shm", "..", "a/b/c", "Exists"]
    ),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=20), inner, max_size=6)
    ),
    max_leaves=40,
)
# The spec's own field names (and some of their children's), so values land where they are read.
FIELDS = st.sampled_from([
    "image", "command", "args", "workers", "gpusPerWorker", "gpuType", "resources", "shmSize", "model",
    "dataset", "training", "checkpoint", "output", "elastic", "runPolicy", "scheduling", "nccl", "env",
    "serviceAccountName", "imagePullSecrets", "podMetadata", "terminationGracePeriodSeconds", "backend",
    "stallTimeoutSeconds",
])  # fmt: skip
CHILDREN = st.dictionaries(
    st.sampled_from(["name", "path", "volume", "claimName", "subPath", "cpu", "memory", "labels", "nodeSelector",
                     "tolerations", "key", "operator", "value", "env", "epochs", "learningRate", "suspend",
                     "backoffLimit", "minWorkers", "maxWorkers", "queueName", "profile"]),
    JSON,
    max_size=4,
)  # fmt: skip


# The spec's maps of strings, with keys and values of any type.
ODD_MAP = st.dictionaries(
    st.one_of(st.text(max_size=12), st.integers(), st.booleans()),
    st.one_of(st.text(max_size=12), SCALARS),
    max_size=3,
)
MAP_FIELDS = st.sampled_from([("nccl", "env"), ("scheduling", "nodeSelector"), ("podMetadata", "labels"),
                              ("podMetadata", "annotations")])  # fmt: skip


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = minimal()
    for field in draw(st.lists(FIELDS, max_size=4, unique=True)):
        body["spec"][field] = draw(st.one_of(JSON, CHILDREN))
    if draw(st.booleans()):
        parent, child = draw(MAP_FIELDS)
        body["spec"][parent] = {child: draw(ODD_MAP)}
    if draw(st.booleans()):
        body["metadata"]["name"] = draw(st.one_of(st.text(max_size=70), JSON))
    return body


def _timed(call: Any, *args: Any) -> Any:
    result, seconds = thread_seconds(lambda: call(*args))
    assert seconds < BOUND_SECONDS
    return result


@SETTINGS
@given(bodies())
def test_any_body_parses_or_is_refused_and_what_parses_renders(body: dict[str, Any]) -> None:
    refused: SpecError | None = None
    try:
        training = _timed(parse, body)
    except SpecError as exc:
        refused = exc
    if refused is not None:
        assert refused.problems
        assert all(len(str(p)) < 300 for p in refused.problems), refused.problems  # long values shortened
        return
    for backend in ("pytorchjob", "trainjob"):
        try:
            _timed(lambda t, b: render_job(t, b, default_image="example.com/t:1"), training, backend)
        except SpecError:
            assert backend == "trainjob"  # what Trainer v2 cannot express, said as a SpecError


@SETTINGS
@given(st.one_of(st.text(max_size=2000), st.binary(max_size=2000).map(lambda b: b.decode("latin-1"))))
def test_any_file_is_read_into_documents_or_one_error(tmp_path_factory: Any, text: str) -> None:
    path = Path(tmp_path_factory.mktemp("doc")) / "f.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    message = ""
    try:
        _timed(read_documents, str(path))
    except DocumentError as exc:
        message = str(exc)
    assert "\n" not in message
