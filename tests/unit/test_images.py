"""The trainer images agree with what the operator renders: uid, ports, pinned bases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuop.render import RUN_AS_USER
from gputrain.contract import METRICS_PORT, RENDEZVOUS_PORT
from support.crdschema import ROOT

TRAINER_IMAGES = sorted((ROOT / "images").glob("trainer*.Dockerfile"))


def test_there_is_a_gpu_and_a_cpu_trainer_image() -> None:
    assert [p.name for p in TRAINER_IMAGES] == ["trainer-cpu.Dockerfile", "trainer.Dockerfile"]


@pytest.mark.parametrize("dockerfile", TRAINER_IMAGES, ids=[p.name for p in TRAINER_IMAGES])
def test_trainer_image(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    bases = re.findall(r"^FROM\s+(\S+)", text, flags=re.MULTILINE)
    assert bases
    for base in bases:
        name, _, tag = base.rpartition(":")
        assert name, base
        assert tag, f"{base}: pin the base image by tag"
        assert tag != "latest", f"{base}: pin the base image by tag"
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.MULTILINE)
    assert users[-1] == str(RUN_AS_USER), "the image must run as the uid the pod securityContext sets"
    exposed = {
        int(p) for line in re.findall(r"^EXPOSE\s+(.+)$", text, flags=re.MULTILINE) for p in line.split()
    }
    assert {METRICS_PORT, RENDEZVOUS_PORT} <= exposed
    assert re.search(r'^ENTRYPOINT \["torchrun"\]', text, flags=re.MULTILINE)
    # The trainer only: never the operator's cluster client.
    assert "kopf" not in text
    assert "kubernetes" not in text
