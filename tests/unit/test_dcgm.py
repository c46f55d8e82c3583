"""dcgm-exporter's text (and a Prometheus answer over its series) read into GPU figures per
pod: a realistic node, the values DCGM reports for unsupported fields, GPUs no pod holds, two
nodes' GPU 0, MIG and shared GPUs, the bounds, and hostile bodies that only ever raise
ValueError within a CPU bound. The exporter's endpoints into URLs, too."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuop.observing import dcgm
from gpuop.observing.scrape import GpuFigures
from support.cost import thread_seconds

MIB = 1024 * 1024
H100 = "NVIDIA H100 80GB HBM3"


def line(field: str, value: object, **labels: str) -> str:
    """One sample line in dcgm-exporter's label order (the reference's sample line)."""
    full = {
        "gpu": "0",
        "UUID": "GPU-8f1f0c2a-0000-4000-8000-000000000000",
        "pci_bus_id": "00000000:18:00.0",
        "device": "nvidia0",
        "modelName": H100,
        "Hostname": "node-a",
        "container": "trainer",
        "namespace": "team-a",
        "pod": "mnist-master-0",
    } | labels
    quoted = ",".join(f'{k}="{escape(v)}"' for k, v in full.items())
    return f"{field}{{{quoted}}} {value}"


def escape(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# A node of 4 H100s as dcgm-exporter serves it: GPUs 0 and 1 held by the master's trainer,
# 2 by a worker, 3 by no pod; GPU 3's memory temperature unsupported (DCGM's blank value).
NODE_A = """\
# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).
# TYPE DCGM_FI_DEV_SM_CLOCK gauge
DCGM_FI_DEV_SM_CLOCK{gpu="0",UUID="GPU-a0",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 1980
DCGM_FI_DEV_SM_CLOCK{gpu="1",UUID="GPU-a1",pci_bus_id="00000000:2A:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 1980
DCGM_FI_DEV_SM_CLOCK{gpu="2",UUID="GPU-a2",pci_bus_id="00000000:3A:00.0",device="nvidia2",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-worker-0"} 1980
DCGM_FI_DEV_SM_CLOCK{gpu="3",UUID="GPU-a3",pci_bus_id="00000000:5D:00.0",device="nvidia3",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="",namespace="",pod=""} 345
# HELP DCGM_FI_DEV_MEMORY_TEMP Memory temperature (in C).
# TYPE DCGM_FI_DEV_MEMORY_TEMP gauge
DCGM_FI_DEV_MEMORY_TEMP{gpu="3",UUID="GPU-a3",pci_bus_id="00000000:5D:00.0",device="nvidia3",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="",namespace="",pod=""} 9223372036854775794
# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).
# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu="0",UUID="GPU-a0",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 9876543210
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a0",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 87
DCGM_FI_DEV_GPU_UTIL{gpu="1",UUID="GPU-a1",pci_bus_id="00000000:2A:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 91
DCGM_FI_DEV_GPU_UTIL{gpu="2",UUID="GPU-a2",pci_bus_id="00000000:3A:00.0",device="nvidia2",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-worker-0"} 45
DCGM_FI_DEV_GPU_UTIL{gpu="3",UUID="GPU-a3",pci_bus_id="00000000:5D:00.0",device="nvidia3",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="",namespace="",pod=""} 0
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a0",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 41559
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-a1",pci_bus_id="00000000:2A:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 51559
DCGM_FI_DEV_FB_FREE{gpu="2",UUID="GPU-a2",pci_bus_id="00000000:3A:00.0",device="nvidia2",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-worker-0"} 71559
DCGM_FI_DEV_FB_FREE{gpu="3",UUID="GPU-a3",pci_bus_id="00000000:5D:00.0",device="nvidia3",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="",namespace="",pod=""} 81559
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a0",pci_bus_id="00000000:18:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 40000
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-a1",pci_bus_id="00000000:2A:00.0",device="nvidia1",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-master-0"} 30000
DCGM_FI_DEV_FB_USED{gpu="2",UUID="GPU-a2",pci_bus_id="00000000:3A:00.0",device="nvidia2",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="trainer",namespace="team-a",pod="mnist-worker-0"} 10000
DCGM_FI_DEV_FB_USED{gpu="3",UUID="GPU-a3",pci_bus_id="00000000:5D:00.0",device="nvidia3",modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",container="",namespace="",pod=""} 0
"""
PODS = {"mnist-master-0", "mnist-worker-0"}


def test_reads_a_multi_gpu_multi_pod_node() -> None:
    assert dcgm.gpus_by_pod(NODE_A, "team-a", PODS) == {
        "mnist-master-0": (
            GpuFigures("0", H100, 87.0, 40000 * MIB, 81559 * MIB),
            GpuFigures("1", H100, 91.0, 30000 * MIB, 81559 * MIB),
        ),
        "mnist-worker-0": (GpuFigures("2", H100, 45.0, 10000 * MIB, 81559 * MIB),),
    }


def test_only_the_asked_namespace_and_pods() -> None:
    assert dcgm.gpus_by_pod(NODE_A, "team-b", PODS) == {}
    assert set(dcgm.gpus_by_pod(NODE_A, "team-a", {"mnist-worker-0"})) == {"mnist-worker-0"}


def test_engine_activity_is_preferred_to_gpu_util() -> None:
    text = "\n".join([line("DCGM_FI_DEV_GPU_UTIL", 100), line("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.25)])
    (gpu,) = dcgm.gpus_by_pod(text, "team-a", {"mnist-master-0"})["mnist-master-0"]
    assert gpu.utilization_percent == 25.0


def test_fb_total_where_exported_else_used_plus_free() -> None:
    both = [line("DCGM_FI_DEV_FB_USED", 1000), line("DCGM_FI_DEV_FB_FREE", 2000)]
    (gpu,) = dcgm.gpus_by_pod("\n".join(both), "team-a", {"mnist-master-0"})["mnist-master-0"]
    assert (gpu.memory_used_bytes, gpu.memory_total_bytes) == (1000 * MIB, 3000 * MIB)
    (gpu,) = dcgm.gpus_by_pod(
        "\n".join([*both, line("DCGM_FI_DEV_FB_TOTAL", 3500)]), "team-a", {"mnist-master-0"}
    )["mnist-master-0"]
    assert gpu.memory_total_bytes == 3500 * MIB


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("DCGM_FI_DEV_GPU_UTIL", "9223372036854775794"),  # DCGM's "not supported"
        ("DCGM_FI_DEV_GPU_UTIL", "2147483632"),  # DCGM's 32-bit blank
        ("DCGM_FI_DEV_GPU_UTIL", "-1"),
        ("DCGM_FI_DEV_GPU_UTIL", "101"),
        ("DCGM_FI_DEV_GPU_UTIL", "NaN"),
        ("DCGM_FI_DEV_GPU_UTIL", "+Inf"),
        ("DCGM_FI_DEV_GPU_UTIL", "1" + "0" * 400),
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "1.5"),
        ("DCGM_FI_DEV_FB_USED", "9223372036854775794"),
        ("DCGM_FI_DEV_FB_USED", "-Inf"),
        ("DCGM_FI_DEV_FB_FREE", "-5"),
        ("DCGM_FI_DEV_FB_TOTAL", "1e300"),
    ],
)
def test_values_outside_their_range_are_absent(field: str, value: str) -> None:
    (sample,) = dcgm.parse_exposition(line(field, value))
    assert sample.values == {}
    (gpu,) = dcgm.figures_by_pod([sample], "team-a", {"mnist-master-0"})["mnist-master-0"]
    assert gpu == GpuFigures("0", H100, None, None, None)


def test_used_over_total_leaves_the_total_absent() -> None:
    text = "\n".join([line("DCGM_FI_DEV_FB_USED", 5000), line("DCGM_FI_DEV_FB_TOTAL", 4000)])
    (gpu,) = dcgm.gpus_by_pod(text, "team-a", {"mnist-master-0"})["mnist-master-0"]
    assert (gpu.memory_used_bytes, gpu.memory_total_bytes) == (5000 * MIB, None)


@pytest.mark.parametrize(
    "holder",
    [
        {"namespace": "", "pod": "", "container": ""},
        {"namespace": "team-a", "pod": ""},
        {"namespace": "", "pod": "mnist-master-0"},
    ],
)
def test_gpus_no_pod_holds_are_ignored(holder: dict[str, str]) -> None:
    assert dcgm.parse_exposition(line("DCGM_FI_DEV_GPU_UTIL", 50, **holder)) == ()


def test_two_nodes_gpu_0_are_kept_apart() -> None:
    by_uuid = [
        line("DCGM_FI_DEV_GPU_UTIL", 10, UUID="GPU-a", Hostname="node-a"),
        line("DCGM_FI_DEV_GPU_UTIL", 90, UUID="GPU-b", Hostname="node-b"),
    ]
    by_host = [  # no UUID: the host name keys them; both spellings of its label
        line("DCGM_FI_DEV_GPU_UTIL", 10, UUID="", Hostname="node-a"),
        line("DCGM_FI_DEV_GPU_UTIL", 90, UUID="", Hostname="", hostname="node-b"),
    ]
    for lines in (by_uuid, by_host):
        # Two exporters' answers, merged as the controller merges them.
        samples = [s for text in lines for s in dcgm.parse_exposition(text)]
        gpus = dcgm.figures_by_pod(samples, "team-a", {"mnist-master-0"})["mnist-master-0"]
        assert sorted(g.utilization_percent or 0 for g in gpus) == [10, 90]


def test_a_gpu_shared_by_two_pods_counts_for_each() -> None:
    text = "\n".join([line("DCGM_FI_DEV_GPU_UTIL", 70, pod="a"), line("DCGM_FI_DEV_GPU_UTIL", 70, pod="b")])
    assert dcgm.gpus_by_pod(text, "team-a", {"a", "b"}) == {
        "a": (GpuFigures("0", H100, 70.0, None, None),),
        "b": (GpuFigures("0", H100, 70.0, None, None),),
    }


def test_a_gpu_two_containers_of_a_pod_list_counts_once() -> None:
    text = "\n".join([line("DCGM_FI_DEV_GPU_UTIL", 70, container=c) for c in ("trainer", "sidecar")])
    assert len(dcgm.gpus_by_pod(text, "team-a", {"mnist-master-0"})["mnist-master-0"]) == 1


def test_mig_instances_are_gpus_of_their_own() -> None:
    text = "\n".join(
        line("DCGM_FI_PROF_GR_ENGINE_ACTIVE", ratio, GPU_I_PROFILE="3g.40gb", GPU_I_ID=instance)
        for instance, ratio in (("1", 0.5), ("2", 0.75))
    )
    gpus = dcgm.gpus_by_pod(text, "team-a", {"mnist-master-0"})["mnist-master-0"]
    assert [(g.index, g.name, g.utilization_percent) for g in gpus] == [
        ("0/1", f"{H100} MIG 3g.40gb", 50.0),
        ("0/2", f"{H100} MIG 3g.40gb", 75.0),
    ]


def test_gpus_sort_by_number_and_are_bounded_per_pod() -> None:
    text = "\n".join(
        line("DCGM_FI_DEV_GPU_UTIL", 1, gpu=str(i), UUID=f"GPU-{i}")
        for i in range(dcgm.MAX_GPUS_PER_POD + 10)
    )
    gpus = dcgm.gpus_by_pod(text, "team-a", {"mnist-master-0"})["mnist-master-0"]
    assert [g.index for g in gpus] == [str(i) for i in range(dcgm.MAX_GPUS_PER_POD)]


def test_odd_index_labels_sort_last_and_do_not_raise() -> None:
    text = "\n".join(line("DCGM_FI_DEV_GPU_UTIL", 1, gpu=g, UUID=f"GPU-{g}") for g in ("²", "1", "٣", "x"))
    gpus = dcgm.gpus_by_pod(text, "team-a", {"mnist-master-0"})["mnist-master-0"]
    assert [g.index for g in gpus] == ["1", "x", "²", "٣"]


def test_names_are_bounded_and_printable() -> None:
    text = line("DCGM_FI_DEV_GPU_UTIL", 1, modelName="H\x07\n" + "x" * 1000)
    (gpu,) = dcgm.gpus_by_pod(text, "team-a", {"mnist-master-0"})["mnist-master-0"]
    assert gpu.name is not None
    assert len(gpu.name) == 128
    assert gpu.name.isprintable()


def test_a_body_over_the_bound_raises_value_error() -> None:
    with pytest.raises(ValueError, match="over"):
        dcgm.parse_exposition("#" * (dcgm.MAX_SCRAPE_BYTES + 1))


def test_gpu_lines_over_their_bound_raise_value_error() -> None:
    one = line("DCGM_FI_DEV_GPU_UTIL", 1)
    with pytest.raises(ValueError, match="GPU lines"):
        dcgm.parse_exposition("\n".join([one] * (dcgm.MAX_READ_BYTES // len(one) + 1)))


def test_an_odd_line_costs_that_line_only() -> None:
    text = NODE_A.replace('DCGM_FI_DEV_GPU_UTIL{gpu="1"', 'DCGM_FI_DEV_GPU_UTIL{gpu="1""', 1)
    gpus = dcgm.gpus_by_pod(text, "team-a", PODS)["mnist-master-0"]
    assert [g.utilization_percent for g in gpus] == [87.0, None]


ONE = line("DCGM_FI_DEV_GPU_UTIL", 1)
HOSTILE = {
    "binary garbage": bytes(range(256)).decode("latin-1") * 1000,
    "100k lines of other metrics": "\n".join(f'other_metric{{gpu="{i}"}} {i}' for i in range(100_000)),
    "100k lines of a GPU field": "\n".join(
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="{i}",pod="p"}} 1' for i in range(100_000)
    ),
    "20k GPU lines within the bound": "\n".join(
        f'DCGM_FI_DEV_FB_USED{{gpu="{i}",namespace="n",pod="p"}} 1' for i in range(20_000)
    ),
    "one line of 4 MiB": ONE[:-2] + "x" * (dcgm.MAX_SCRAPE_BYTES - len(ONE)) + " 1",
    "huge label value": line("DCGM_FI_DEV_GPU_UTIL", 1, pod="p" * (dcgm.MAX_LINE_BYTES - 400)),
    "escaped quotes": "\n".join(['DCGM_FI_DEV_GPU_UTIL{gpu="' + '\\"' * 4000 + '"} 1'] * 120),
    "backslashes": "\n".join(['DCGM_FI_DEV_GPU_UTIL{gpu="' + "\\" * 8000 + '"} 1'] * 100),
    "labels without end": "DCGM_FI_DEV_GPU_UTIL{" + 'a="b",' * 2000,
    "many labels": "DCGM_FI_DEV_GPU_UTIL{" + ",".join(f'l{i}="v"' for i in range(2000)) + "} 1",
    "nul and unicode lines": 'DCGM_FI_DEV_GPU_UTIL\x00{gpu="0"} 1\n\u2028DCGM_FI_DEV_GPU_UTIL{gpu="\u0660"} 1',
    "value and timestamps": line("DCGM_FI_DEV_GPU_UTIL", "1 2 3 4 5 " * 300),
}


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_bodies_read_or_raise_value_error_in_bounded_time(text: str) -> None:
    def read() -> object:
        try:
            return dcgm.gpus_by_pod(text, "n", {"p"})
        except ValueError:
            return None

    _, seconds = thread_seconds(read)
    # Measured 0.55 s at most (escaped quotes filling the bound of GPU lines: the parser's
    # worst case); a regression (a quadratic parse, no bound) is far over.
    assert seconds < 3.0


LINE_PARTS = st.sampled_from(
    [*dcgm.FIELDS, "DCGM_FI_DEV_SM_CLOCK", "{", "}", ",", "=", '"', "\\", " ", "\t", "#", "# TYPE ", "# HELP ",
     'gpu="0"', 'gpu="1"', 'UUID="GPU-x"', 'Hostname="h"', 'hostname="h"', 'namespace="n"', 'pod="p"',
     'exported_pod="p"', 'GPU_I_ID="1"', 'modelName="M"', " 1", " 0.5", " NaN", " -Inf", " 9223372036854775794",
     " 1e999", " counter", " gauge", "_total", "\n", "\r", "\x00", "é", 'gpu="²"', 'GPU_I_ID="٣"']
)  # fmt: skip
TEXTS = st.one_of(st.text(max_size=400), st.lists(LINE_PARTS, max_size=80).map("".join))


@given(TEXTS)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_text_reads_or_raises_value_error(text: str) -> None:
    try:
        samples = dcgm.parse_exposition(text)
    except ValueError:
        return
    for sample in samples:
        assert sample.namespace
        assert sample.pod
        for name, value in sample.values.items():
            low, high = dcgm._RANGES[name]
            assert math.isfinite(value)
            assert low <= value <= high
    dcgm.figures_by_pod(samples, "n", {"p"})


def vector(*results: dict[str, object]) -> str:
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": list(results)}})


def result(name: str, value: object, **labels: str) -> dict[str, object]:
    return {"metric": {"__name__": name, "gpu": "0", "UUID": "GPU-a", "modelName": H100} | labels,
            "value": [1700000000.0, value]}  # fmt: skip


def test_a_prometheus_answer_reads_as_the_exporter_text() -> None:
    body = vector(
        result("DCGM_FI_DEV_GPU_UTIL", "87", namespace="team-a", pod="p"),
        result("DCGM_FI_DEV_FB_USED", "100", namespace="team-a", pod="p"),
        result("DCGM_FI_DEV_FB_FREE", "NaN", namespace="team-a", pod="p"),
        # A scrape config that does not honor the exporter's labels: they are exported_*.
        result("DCGM_FI_DEV_GPU_UTIL", "5", UUID="GPU-b", namespace="gpu-operator",
               pod="nvidia-dcgm-exporter-x", exported_namespace="team-a", exported_pod="q"),
    )  # fmt: skip
    assert dcgm.figures_by_pod(
        dcgm.parse_query_result(body), "team-a", {"p", "q", "nvidia-dcgm-exporter-x"}
    ) == {
        "p": (GpuFigures("0", H100, 87.0, 100 * MIB, None),),
        "q": (GpuFigures("0", H100, 5.0, None, None),),
    }


@pytest.mark.parametrize(
    "body",
    [
        "",
        "not json",
        "[" * 100_000 + "]" * 100_000,
        "1" * 5000,
        '{"status": "error", "error": "bad_data"}',
        '{"status": "success", "data": {"resultType": "matrix", "result": []}}',
        '{"status": "success", "data": {"resultType": "vector", "result": {}}}',
        '{"status": "success", "data": {"resultType": "vector", "result": []}}' + " " * dcgm.MAX_SCRAPE_BYTES,
    ],
)
def test_a_prometheus_answer_not_a_vector_raises_value_error(body: str) -> None:
    with pytest.raises(ValueError, match="query response"):
        dcgm.parse_query_result(body)


def test_odd_prometheus_results_are_skipped() -> None:
    odd: list[object] = [
        1, None, {"metric": []}, {"metric": {"gpu": 0}, "value": [0, "1"]}, {"metric": {}, "value": "1"},
        result("DCGM_FI_DEV_GPU_UTIL", 87, namespace="n", pod="p"),  # a number, not Prometheus's string
        result("DCGM_FI_DEV_GPU_UTIL", "1" * 100, namespace="n", pod="p"),
        result("DCGM_FI_DEV_GPU_UTIL", "x", namespace="n", pod="p"),
    ]  # fmt: skip
    body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": odd}})
    assert dcgm.parse_query_result(body) == ()


def test_prometheus_queries_select_both_label_spellings() -> None:
    plain, exported = dcgm.prometheus_queries('te"am\\')
    assert plain.endswith(',namespace="te\\"am\\\\"}')
    assert exported.endswith(',exported_namespace="te\\"am\\\\"}')
    assert all(name in plain for name in dcgm.FIELDS)


ENDPOINTS = {
    "kind": "Endpoints",
    "subsets": [
        {
            "addresses": [{"ip": "10.0.3.7", "nodeName": "node-a"}, {"ip": "10.0.4.9"}],
            "notReadyAddresses": [{"ip": "10.0.5.1"}],
            "ports": [{"name": "gpu-metrics", "port": 9400, "protocol": "TCP"}],
        },
        {"addresses": [{"ip": "fd00::7"}, {"ip": "not-an-ip"}], "ports": [{"port": 9500}]},
    ],
}
SLICE = {
    "kind": "EndpointSlice",
    "addressType": "IPv4",
    "endpoints": [
        {"addresses": ["10.0.3.7"], "conditions": {"ready": True}},
        {"addresses": ["10.0.4.9"]},
        {"addresses": ["10.0.5.1"], "conditions": {"ready": False}},
    ],
    "ports": [{"name": "gpu-metrics", "port": 9400}, {"name": "other", "port": 8080}],
}


def test_exporter_urls_from_endpoints_and_slices() -> None:
    assert dcgm.exporter_urls(ENDPOINTS) == (
        "http://10.0.3.7:9400",
        "http://10.0.4.9:9400",
        "http://[fd00::7]:9500",
    )
    assert dcgm.exporter_urls(SLICE) == ("http://10.0.3.7:9400", "http://10.0.4.9:9400")
    fqdn = SLICE | {"addressType": "FQDN", "endpoints": [{"addresses": ["x.example"]}]}
    listed = {"kind": "EndpointSliceList", "items": [SLICE, fqdn, "junk"]}
    assert dcgm.exporter_urls(listed) == ("http://10.0.3.7:9400", "http://10.0.4.9:9400")
    assert dcgm.exporter_urls({"subsets": "junk"}) == ()
    assert dcgm.exporter_urls({"items": [{"addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"]}],
                                          "ports": [{"port": 99999}]}]}) == ("http://10.0.0.1:9400",)  # fmt: skip
