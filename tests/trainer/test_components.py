"""The trainer's parts, in one process: checkpoints, data, models, metrics."""

from __future__ import annotations

import gzip
import logging
import pickle
import re
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gpuop.api.status import GpuUsage, format_eta
from gpuop.local.figures import progress_line
from gpuop.local.runner import scrape
from gpuop.observing.figures import gpu_usage
from gpuop.observing.scrape import parse_metrics
from gputrain.checkpoint import CheckpointManager
from gputrain.contract import Metric, Progress, Result, TrainerSettings
from gputrain.data import (
    DatasetMissingError,
    TensorData,
    load_cifar10_arrays,
    load_digits_arrays,
    load_mnist_arrays,
    shard_indices,
)
from gputrain.metrics import MetricsServer
from gputrain.models import build_model
from gputrain.schedule import resume_at, warmup_cosine
from gputrain.state import Figures, Position, RngState, Stateful, checkpoint_of, load_checkpoint
from gputrain.vision import import_torchvision
from support.paths import ROOT

# --- checkpoints ----------------------------------------------------------------------------


def test_checkpoints_keep_the_newest_k_and_leave_no_temporary_files(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path / "ck", keep=2)
    written = [manager.save({"step": step, "w": torch.full((3,), float(step))}, step) for step in (5, 10, 15)]
    assert [s.step for s in manager.checkpoints()] == [10, 15]
    assert re.fullmatch(r"step-00000015-[0-9a-f]{8}\.pt", written[-1].name)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted(
        ["step-00000010.json", written[1].name, "step-00000015.json", written[2].name]
    )  # nothing of step 5, and no temporary file
    found = manager.load_latest()
    assert found is not None
    state, saved = found
    assert (state["step"], saved.uri) == (15, f"{tmp_path}/ck/{written[-1].name}")


def test_two_writers_of_one_step_never_mix_a_state_with_the_others_manifest(tmp_path: Path) -> None:
    """Every pod's first rank saves at a preemption, to one bucket or ReadWriteMany volume, and
    a periodic save and an end-of-epoch save can be of one step: each write's state is an object
    of its own, and the manifest written last says which one is the checkpoint."""
    first, second = CheckpointManager(tmp_path, keep=1), CheckpointManager(tmp_path, keep=1)
    first.save({"by": "first", "pad": torch.zeros(100)}, 7)
    second.save({"by": "second", "pad": torch.ones(1000)}, 7)  # other bytes, other size
    found = first.load_latest()
    assert found is not None
    assert found[0]["by"] == "second"
    first.save({"step": 8}, 8)  # and the state the lost writer left goes with the next save
    assert sorted(p.name for p in tmp_path.iterdir() if "00000007" in p.name) == []


def test_a_checkpoint_from_before_manifests_still_resumes(tmp_path: Path) -> None:
    torch.save({"step": 3}, tmp_path / "step-00000003.pt")  # as versions before manifests wrote it
    found = CheckpointManager(tmp_path, keep=1).load_latest()
    assert found is not None
    assert (found[0]["step"], found[1].manifest) == (3, None)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save({"step": 1}, 1)
    newest = manager.save({"step": 2, "w": torch.randn(1000)}, 2)
    file = tmp_path / newest.name
    file.write_bytes(file.read_bytes()[:100])  # truncated, as by a full disk
    with caplog.at_level(logging.WARNING):
        found = manager.load_latest()
    assert found is not None
    assert found[0]["step"] == 1
    assert f"checkpoint {newest.uri} is unreadable" in caplog.text
    assert "bytes where its manifest says" in caplog.text  # the manifest caught it before torch did
    assert {p.name for p in tmp_path.iterdir() if p.name.endswith(".unreadable")} == {
        newest.name + ".unreadable",
        "step-00000002.json.unreadable",
    }


def test_with_keep_1_a_corrupt_newest_checkpoint_never_pushes_out_the_new_ones(tmp_path: Path) -> None:
    """Before: the corrupt step-99 stayed newest and each new checkpoint was pruned at once, so
    every restart began at step 0 while the logs said it would resume."""
    manager = CheckpointManager(tmp_path, keep=1)
    (tmp_path / "step-00000099.pt").write_bytes(b"truncated")
    assert manager.load_latest() is None
    assert (tmp_path / "step-00000099.pt.unreadable").is_file()  # kept to look at, out of the set
    manager.save({"step": 10}, 10)
    found = manager.load_latest()
    assert found is not None
    assert found[0]["step"] == 10
    manager.save({"step": 20}, 20)
    assert [s.step for s in manager.checkpoints()] == [20]
    # Even a newer-numbered file that cannot be moved aside never takes the place of the one
    # just written.
    (tmp_path / "step-00000500.pt").write_bytes(b"someone else's")
    manager.save({"step": 30}, 30)
    assert [s.step for s in manager.checkpoints()] == [30, 500]


def test_no_checkpoint_means_a_fresh_start(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "missing", keep=1).load_latest() is None
    (tmp_path / "step-00000001.pt").write_bytes(b"not a checkpoint")
    assert CheckpointManager(tmp_path, keep=1).load_latest() is None


def test_checkpoints_refuse_to_run_code(tmp_path: Path) -> None:
    """weights_only loading: a pickled object that would run code is refused, not run."""

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    path = tmp_path / "step-00000001.pt"
    torch.save({"x": Boom()}, path)
    assert CheckpointManager(tmp_path, keep=1).load_latest() is None


# --- the trainer's checkpointed state: components that save and load themselves -------------


def test_each_components_state_round_trips_through_a_checkpoint_file(tmp_path: Path) -> None:
    """What a component saves, a fresh one loads back, through a file read as the trainer reads
    it (weights_only: plain values and tensors only)."""
    torch.manual_seed(3)
    saved: dict[str, Stateful] = {
        "position": Position(epoch=1, next_batch=10, step=33, batches=23),
        "figures": Figures(loss=0.5, accuracy=None, test_loss=0.4, samples_trained=96.0, seconds_trained=2.0),
        "rng": RngState(torch.device("cpu")),
    }
    written = CheckpointManager(tmp_path, keep=1).save(checkpoint_of(saved, "cnn"), 33)
    draw = torch.rand(4)  # what the generator gives next from the saved state
    state = torch.load(tmp_path / written.name, map_location="cpu", weights_only=True)
    loaded: dict[str, Stateful] = {
        "position": Position(),
        "figures": Figures(),
        "rng": RngState(torch.device("cpu")),
    }
    load_checkpoint(loaded, state)
    assert state["model_name"] == "cnn"
    assert loaded["position"] == saved["position"]
    assert loaded["figures"] == saved["figures"]
    assert torch.equal(torch.rand(4), draw)


def test_a_checkpoint_in_the_format_before_the_components_loads_into_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Users' volumes hold checkpoints that the trainer built key by key; the components load
    them, and write the same keys back."""
    from gpuop.api.spec import parse
    from gpuop.backends.pod import trainer_settings
    from gputrain.distributed import Cluster
    from gputrain.train import Trainer
    from support.specs import minimal

    training = parse(
        minimal(
            dataset={"name": "digits", "loaderWorkers": 0},
            training={"epochs": 3, "batchSize": 32},
            checkpoint={"path": str(tmp_path / "ck"), "keep": 2},
            output={"path": str(tmp_path / "out")},
        )
    )
    settings = trainer_settings(training.name, training.spec)
    cluster = Cluster(rank=0, local_rank=0, world=1, device=torch.device("cpu"), backend=settings.backend)
    trainer = Trainer(settings, cluster, termination_log=None)
    try:
        weights = {k: torch.full_like(v, 0.25) if v.is_floating_point() else v
                   for k, v in trainer.model.state_dict().items()}  # fmt: skip
        optimizer = trainer.optimizer.state_dict()
        optimizer["param_groups"][0]["lr"] = 0.0123
        rng = torch.manual_seed(7).get_state()
        draw = torch.rand(3)
        old = {
            "model": weights,
            "optimizer": optimizer,
            "scaler": trainer.scaler.state_dict(),
            "position": {"epoch": 1, "next_batch": 10, "step": 33, "batches": trainer.batches},
            "model_name": settings.model,
            "figures": {"loss": 0.5, "accuracy": 0.9, "test_loss": 0.4, "samples_trained": 1437.0,
                        "seconds_trained": 2.0},
            "rng": {"torch": rng, "cuda": []},
        }  # fmt: skip
        manager = CheckpointManager(settings.checkpoint_dir, keep=2)
        manager.save(old, 33)
        with caplog.at_level(logging.INFO, logger="gputrain"):
            trainer.resume()
        assert "at epoch 2, step 33" in caplog.text
        assert all(torch.equal(v, weights[k]) for k, v in trainer.model.state_dict().items())
        assert trainer.optimizer.param_groups[0]["lr"] == 0.0123
        assert trainer.position == Position(1, 10, 33, trainer.batches)
        assert trainer.figures == Figures(0.5, 0.9, 0.4, 1437.0, 2.0)
        assert torch.equal(torch.rand(3), draw)  # the generator continues from the saved state

        trainer.position.step = 34
        trainer.save_checkpoint()
        found = manager.load_latest()
        assert found is not None
        new, saved = found
        assert saved.step == 34
        assert new.keys() == old.keys()
        assert new["model"].keys() == weights.keys()
        assert new["optimizer"].keys() == optimizer.keys()
        assert new["position"] == old["position"] | {"step": 34}
        assert new["figures"] == old["figures"]
        assert new["rng"].keys() == {"torch", "cuda"}
        assert new["rng"]["cuda"] == []
    finally:
        trainer.close()


# --- data ------------------------------------------------------------------------------------


def test_shards_cover_every_sample_and_are_equal_in_size() -> None:
    for n, world in ((10, 3), (1437, 2), (7, 7), (5, 8)):
        shards = [shard_indices(n, epoch=1, seed=0, rank=r, world=world) for r in range(world)]
        assert len({len(s) for s in shards}) == 1
        assert set(torch.cat(shards).tolist()) == set(range(n))
    assert not torch.equal(shard_indices(100, 0, 0, 0, 2), shard_indices(100, 1, 0, 0, 2))  # set_epoch
    assert torch.equal(shard_indices(100, 3, 7, 1, 2), shard_indices(100, 3, 7, 1, 2))


def _idx(path: Path, array: np.ndarray, compress: bool) -> None:
    header = struct.pack(">I", 0x0800 | array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_reader(tmp_path: Path, compress: bool) -> None:
    rng = np.random.default_rng(0)
    suffix = ".gz" if compress else ""
    images = rng.integers(0, 256, (20, 28, 28))
    _idx(tmp_path / f"train-images-idx3-ubyte{suffix}", images, compress)
    _idx(tmp_path / f"train-labels-idx1-ubyte{suffix}", rng.integers(0, 10, 20), compress)
    _idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", rng.integers(0, 256, (5, 28, 28)), compress)
    _idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", rng.integers(0, 10, 5), compress)
    x_train, y_train, x_test, _ = load_mnist_arrays(tmp_path)
    assert x_train.shape == (20, 1, 28, 28)
    assert x_test.shape == (5, 1, 28, 28)
    assert np.allclose(x_train[3, 0], images[3] / 255)
    assert y_train.shape == (20,)


def _on_the_claim(pod: dict[str, Any], container_path: str, claims: Path) -> Path:
    """Where a path inside the trainer container lands on its claim, by the pod's own volumes
    and mounts (mountPath, subPath): what the kubelet would give the reader."""
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"])):
        inside = Path(container_path)
        if inside == Path(mount["mountPath"]) or Path(mount["mountPath"]) in inside.parents:
            claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
            return claims / claim / mount.get("subPath", "") / inside.relative_to(mount["mountPath"])
    raise AssertionError(f"{container_path} is on no volume")


def test_the_mnist_examples_stated_layout_is_what_its_mount_and_the_reader_find(tmp_path: Path) -> None:
    """examples/mnist.yaml says: the standard files on the `datasets` claim under mnist/. Put
    them there, follow the rendered pod's mount, and the reader finds them."""
    from gpuop.api.spec import parse
    from gpuop.backends.pytorchjob import render_pytorchjob
    from support.specs import load_example

    training = parse(load_example(ROOT / "examples" / "mnist.yaml"))
    master = render_pytorchjob(training)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    stated = tmp_path / "datasets" / "mnist"  # as the example's comment puts them
    stated.mkdir(parents=True)
    rng = np.random.default_rng(0)
    _idx(stated / "train-images-idx3-ubyte", rng.integers(0, 256, (4, 28, 28)), False)
    _idx(stated / "train-labels-idx1-ubyte", rng.integers(0, 10, 4), False)
    _idx(stated / "t10k-images-idx3-ubyte", rng.integers(0, 256, (2, 28, 28)), False)
    _idx(stated / "t10k-labels-idx1-ubyte", rng.integers(0, 10, 2), False)
    assert training.spec.dataset is not None
    root = _on_the_claim(master, training.spec.dataset.path, tmp_path)
    assert root == stated
    assert load_mnist_arrays(root)[0].shape == (4, 1, 28, 28)


def test_cifar10_reader(tmp_path: Path) -> None:
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": list(range(4))}
        (root / name).write_bytes(pickle.dumps(batch))
    x_train, y_train, x_test, _ = load_cifar10_arrays(tmp_path)
    assert (x_train.shape, x_test.shape, len(y_train)) == ((20, 3, 32, 32), (4, 3, 32, 32), 20)


def test_a_cifar_file_that_would_run_code_is_refused_unrun(tmp_path: Path) -> None:
    """The reader admits what the format needs (numpy arrays), nothing that runs code."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (Path.touch, (str(marker),))  # type: ignore[return-value]

    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    good = {b"data": np.zeros((4, 3072), dtype=np.uint8), b"labels": list(range(4))}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (root / name).write_bytes(pickle.dumps(good, protocol=2))  # as the release's Python 2 files
    load_cifar10_arrays(tmp_path)  # the real format loads
    (root / "data_batch_3").write_bytes(pickle.dumps({b"data": Payload(), b"labels": []}))
    with pytest.raises(
        DatasetMissingError, match=r"data_batch_3 is not a CIFAR-10 batch: it refers to pathlib"
    ):
        load_cifar10_arrays(tmp_path)
    assert not marker.exists()


def test_missing_files_name_what_is_expected(tmp_path: Path) -> None:
    with pytest.raises(
        DatasetMissingError, match=r"expected cifar-10-batches-py/data_batch_1\.\.5 and test_batch"
    ):
        load_cifar10_arrays(tmp_path)


def test_digits_ship_with_scikit_learn() -> None:
    x_train, y_train, x_test, _ = load_digits_arrays()
    assert (len(x_train) + len(x_test), x_train.shape[1:]) == (1797, (1, 8, 8))
    assert set(y_train.tolist()) == set(range(10))


def _tensor_data(rank: int, crop: int = 4) -> TensorData:
    generator = torch.Generator().manual_seed(0)
    return TensorData(
        x_train=torch.randn(50, 3, 8, 8, generator=generator),
        y_train=torch.arange(50) % 10,
        x_test=torch.randn(9, 3, 8, 8, generator=generator),
        y_test=torch.arange(9),
        num_classes=10,
        batch_size=8,
        rank=rank,
        world=2,
        seed=1,
        crop_padding=crop,
    )


def test_batched_augmentation_is_random_but_reproducible_by_position() -> None:
    data = _tensor_data(rank=0)
    first = list(data.train_batches(epoch=2))
    again = list(data.train_batches(epoch=2))
    resumed = list(data.train_batches(epoch=2, start=2))
    assert len(first) == data.batches_per_epoch() == 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    assert torch.equal(first[2][0], resumed[0][0])  # a resumed epoch sees the same batches
    plain = list(_tensor_data(rank=0, crop=0).train_batches(epoch=2))
    assert not torch.equal(first[0][0], plain[0][0])
    assert torch.equal(first[0][1], plain[0][1])  # labels are not augmented


def test_evaluation_shards_have_no_duplicates() -> None:
    seen = [y for rank in (0, 1) for _, ys in _tensor_data(rank).eval_batches() for y in ys.tolist()]
    assert sorted(seen) == list(range(9))


# --- models and torchvision ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "channels", "size"),
    [
        ("cnn", 1, 8),
        ("cnn", 1, 28),
        ("cnn", 3, 32),
        ("resnet18", 1, 28),
        ("resnet18", 3, 32),
        ("resnet50", 3, 64),
    ],
)
def test_models_classify_their_inputs(name: str, channels: int, size: int) -> None:
    model = build_model(name, channels, 10, size)  # type: ignore[arg-type]
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, channels, size, size)).shape == (2, 10)


def test_the_cnns_blocks_pool_before_relu_as_the_usual_order_would_compute() -> None:
    """The CNN's blocks end in pool-then-ReLU, which costs a quarter of the ReLU; the usual
    ReLU-then-pool is the same function, gradients included, so checkpoints of either load."""
    torch.manual_seed(0)
    block = build_model("cnn", 1, 10, 28).features[0]  # type: ignore[index]
    *front, pool, relu = block
    assert (type(pool), type(relu)) == (nn.MaxPool2d, nn.ReLU)
    usual = nn.Sequential(*front, nn.ReLU(), nn.MaxPool2d(2))
    x = torch.randn(4, 1, 28, 28, requires_grad=True)
    ours_out = block(x)
    (ours_grad,) = torch.autograd.grad(ours_out.square().sum(), x)
    usual_out = usual(x)
    (usual_grad,) = torch.autograd.grad(usual_out.square().sum(), x)
    assert torch.equal(ours_out, usual_out)
    assert torch.equal(ours_grad, usual_grad)


def test_torchvision_imports_here() -> None:
    torchvision = import_torchvision()
    assert hasattr(torchvision.models, "resnet50")
    assert "torchvision" in sys.modules


# --- metrics: served by the trainer, read by gpuop --------------------------------------------


def test_metrics_endpoint_round_trip() -> None:
    server = MetricsServer(port=0)
    try:
        assert server.port
        server.update(Progress(epoch=2, total_epochs=5, step=30, total_steps=120, loss=0.5, accuracy=0.75,
                               samples_per_second=1234.0, estimated_remaining_seconds=61.0))  # fmt: skip
        metrics = scrape(server.port)
    finally:
        server.close()
    assert metrics is not None
    assert (metrics.epoch, metrics.total_epochs, metrics.step, metrics.total_steps) == (2, 5, 30, 120)
    assert metrics.percent == 25.0
    assert (metrics.loss, metrics.accuracy, metrics.samples_per_second) == (0.5, 0.75, 1234.0)
    assert metrics.gpus == ()  # no NVIDIA driver here: no GPU figures, and no error
    assert (
        "25.0%  epoch 2/5  step 30/120  loss 0.5000  acc 0.750  1,234 samples/s  eta 1m01s"
        in progress_line(metrics)
    )


def test_a_metrics_port_another_process_holds_costs_the_endpoint_not_the_training(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`gpuop run` picks a free port and the trainer binds it a moment later: on a busy machine
    another process may take it between the two. The trainer trains on without its endpoint."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="gputrain.metrics"):
            server = MetricsServer(port=port, addr="127.0.0.1")
    assert server.port is None
    server.update(Progress(step=1, total_steps=2))  # the figures still update, unserved
    server.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"metrics endpoint not served: port {port}: Address already in use; training goes on"
    ]


def test_gpu_figures_per_pod_and_mean() -> None:
    text = "\n".join(
        f'{name}{{gpu="{i}"}} {value}'
        for i, (util, used) in enumerate([(0.9, 10), (0.7, 30)])
        for name, value in (
            (Metric.GPU_UTILIZATION_RATIO, util),
            (Metric.GPU_MEMORY_USED_BYTES, used),
            (Metric.GPU_MEMORY_TOTAL_BYTES, 100),
        )
    )
    one = parse_metrics(text + "\n")
    other = parse_metrics(f'{Metric.GPU_UTILIZATION_RATIO}{{gpu="0"}} 0.2\n')
    usage = gpu_usage({"job-worker-0": other.gpus, "job-master-0": one.gpus}, count=3)
    assert isinstance(usage, GpuUsage)
    assert usage.utilization_percent == 60.0  # mean over the three GPUs, not over pods
    assert (usage.memory_used_bytes, usage.memory_total_bytes) == (40, 200)
    assert [(w.pod, w.utilization_percent) for w in usage.per_worker] == [
        ("job-master-0", 80.0),
        ("job-worker-0", 20.0),
    ]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, None), (0, "0s"), (42.4, "42s"), (61, "1m01s"), (3600 + 12 * 60 + 5, "1h12m")],
)
def test_format_eta(seconds: float | None, text: str | None) -> None:
    assert format_eta(seconds) == text


def test_termination_messages() -> None:
    assert Result.from_json('{"phase": "Succeeded", "accuracy": 0.9, "extra": 1}') == Result(
        "Succeeded", accuracy=0.9
    )
    failed = Result.from_json('{"phase": "Failed", "reason": "DatasetMissing", "message": "m"}')
    assert failed == Result("Failed", reason="DatasetMissing", message="m")
    assert Result.from_json(failed.to_json()) == failed  # what the trainer writes, the operator reads
    assert Result.from_json("Traceback (most recent call last): ...") is None  # FallbackToLogsOnError
    assert Result.from_json('{"phase": "Running"}') is None
    # A custom image's record: values of the wrong type are dropped at the edge.
    assert Result.from_json(
        '{"phase": "Succeeded", "loss": "nan", "step": true, "accuracy": 1e999}'
    ) == Result("Succeeded")


def test_imagefolder_goes_through_dataloader_workers(tmp_path: Path) -> None:
    from PIL import Image

    from gpuop.api.spec import parse
    from gpuop.backends.pod import trainer_settings
    from gputrain.data import FolderData
    from support.specs import minimal

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for label in ("cat", "dog"):
            folder = tmp_path / split / label
            folder.mkdir(parents=True)
            for i in range(3):
                Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    training = parse(
        minimal(
            model={"name": "resnet18"},
            dataset={"name": "imagefolder", "path": str(tmp_path), "loaderWorkers": 1},
            training={"batchSize": 2, "channelsLast": True},
        )
    )
    settings = trainer_settings(training.name, training.spec)
    data = FolderData(settings, rank=1, world=2, device=torch.device("cpu"))
    assert (data.num_classes, data.batches_per_epoch()) == (2, 2)
    batches = list(data.train_batches(epoch=0))
    assert len(batches) == 2
    x, y = batches[0]
    assert x.shape == (2, 3, 224, 224)
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert y.dtype == torch.int64
    assert sum(len(y) for _, y in data.eval_batches()) == 3  # rank 1's half of 6 images


# --- fp16 loss scaling ----------------------------------------------------------------------


def test_fp16_loss_scaling_steps_once_per_optimizer_step(tmp_path: Path) -> None:
    """The fp16 path (autocast, scaled backward, unscale before clipping, scaler step and
    update), driven on the CPU in one process.

    Users get fp16 only with GPUs (the spec and the contract refuse it on CPU, where it ran
    digits at 146 samples/s against bf16's 1,634 here), but the loop's handling of the
    GradScaler is the same on both devices, so it is checked here as well as by the GPU tests.
    """
    from gpuop.api.spec import parse
    from gpuop.backends.pod import trainer_settings
    from gputrain.distributed import Cluster
    from gputrain.train import Trainer
    from support.specs import minimal

    training = parse(
        minimal(
            gpusPerWorker=1,
            dataset={"name": "digits", "loaderWorkers": 0},
            training={"epochs": 1, "batchSize": 32, "learningRate": 0.003, "precision": "fp16"}
            | {"gradientAccumulationSteps": 2, "maxGradNorm": 1.0},
            checkpoint={"path": str(tmp_path / "ck"), "everySteps": 1000, "keep": 1},
            output={"path": str(tmp_path / "out")},
        )
    )
    settings = trainer_settings(training.name, training.spec).replace(metrics_port=0)
    cluster = Cluster(rank=0, local_rank=0, world=1, device=torch.device("cpu"), backend=settings.backend)
    trainer = Trainer(settings, cluster, termination_log=None)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert trainer.scaler.is_enabled()
    assert result.step == result.total_steps == 23  # 45 micro-batches of 32, 2 per step
    assert result.accuracy is not None
    assert result.accuracy >= 0.8, result
    scaler = trainer.scaler.state_dict()
    # update() runs once per optimizer step: the count of clean steps since the last change of
    # scale is the number of steps, unless an overflow halved the scale (and reset the count).
    if scaler["scale"] == 2.0**16:
        assert scaler["_growth_tracker"] == 23
    else:
        assert scaler["scale"] < 2.0**16
        assert scaler["_growth_tracker"] < 23
    saved, _path = CheckpointManager(tmp_path / "ck" / "demo", keep=1).load_latest()  # type: ignore[misc]
    assert saved["scaler"] == scaler


# --- bf16 on CPUs: only where the CPU computes it ------------------------------------------


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "asked", "device", "runs"),
    [
        (False, False, "bf16", "cpu", "fp32"),  # emulated bf16: 12.8x slower here (docs/benchmarks.md)
        (True, False, "bf16", "cpu", "bf16"),
        (False, True, "bf16", "cpu", "bf16"),
        (False, False, "bf16", "cuda", "bf16"),  # a GPU's bf16 is not the CPU's business
        (False, False, "fp32", "cpu", "fp32"),
        (False, False, "fp16", "cuda", "fp16"),
    ],
)
def test_bf16_runs_on_a_cpu_only_where_the_cpu_has_bf16_arithmetic(
    monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool, asked: str, device: str, runs: str
) -> None:
    from gputrain.train import effective_precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    settings = _digits_settings().replace(precision=asked)
    assert effective_precision(settings, torch.device(device)) == runs


def test_a_torch_that_cannot_tell_the_cpus_bf16_keeps_what_the_spec_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gputrain.train import effective_precision

    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    settings = _digits_settings().replace(precision="bf16")
    assert effective_precision(settings, torch.device("cpu")) == "bf16"


def _digits_settings() -> TrainerSettings:
    """The settings the operator renders for a digits training with the spec's defaults."""
    from gpuop.api.spec import parse
    from gpuop.backends.pod import trainer_settings
    from support.specs import minimal

    training = parse(minimal(dataset={"name": "digits"}))
    return trainer_settings(training.name, training.spec)


# --- progress and the LR schedule by the run's data, whatever the world size -----------------


@pytest.mark.parametrize(
    ("fraction", "multiplier"),
    [(0.0, 0.0), (0.025, 0.5), (0.05, 1.0), (0.525, 0.5), (1.0, 0.0), (1.5, 0.0)],
)
def test_the_lr_schedule_is_a_function_of_the_data_done(fraction: float, multiplier: float) -> None:
    assert warmup_cosine(fraction) == pytest.approx(multiplier, abs=1e-12)


@pytest.mark.parametrize(
    ("written", "batches", "accum", "expected"),
    [
        # Same world: where it stopped, exactly.
        (Position(1, 10, 33, 23), 23, 1, Position(1, 10, 33, 23)),
        # A checkpoint from before the field: taken as written at this world size.
        (Position(1, 10, 33, 0), 23, 1, Position(1, 10, 33, 23)),
        # 2 workers -> 1: each rank has twice the batches; the same share of the epoch.
        (Position(1, 10, 33, 23), 45, 1, Position(1, 20, 33, 45)),
        # 1 -> 2, rounded up (never back) to the next batch ...
        (Position(0, 7, 7, 45), 23, 1, Position(0, 4, 7, 23)),
        # ... and to the next accumulation group.
        (Position(0, 8, 2, 45), 23, 4, Position(0, 8, 2, 23)),
        (Position(1, 44, 99, 45), 23, 4, Position(1, 23, 99, 23)),  # never past the epoch's end
    ],
)  # fmt: skip
def test_a_resume_with_another_world_size_keeps_the_share_of_the_epoch(
    written: Position, batches: int, accum: int, expected: Position
) -> None:
    resumed = resume_at(written, batches, accum)
    assert resumed == expected
    if written.batches:
        assert (
            resumed.next_batch / batches >= written.next_batch / written.batches
        )  # progress never goes back
