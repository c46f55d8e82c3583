"""The chain's :class:`support.chain.Timeline` on the real API server: it sees every status the
operator writes, in order, however close together, from a watch started before the training
exists, and leaves no kubectl behind once closed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import chain
from support.node.process import processes_naming
from support.plane.controlplane import ControlPlane
from support.waiting import wait_for

pytestmark = pytest.mark.controlplane

PHASES = ["Pending", "Running", "Restarting", "Running", "Succeeded"]


def test_the_timeline_sees_every_status_in_order_and_leaves_no_watch(
    plane: ControlPlane, crd_warnings: str, tmp_path: Path
) -> None:
    name = "timeline"
    plane.kubectl("create", "namespace", chain.NAMESPACE, check=False)
    timeline = chain.Timeline(plane, name)  # before the training: the watch waits for it
    try:
        plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(chain.variant(tmp_path, name)))
        wait_for("the watch to print the training", lambda: timeline.seen, timeout=30)
        # Back to back, each a fraction of a second after the last: a read every half second
        # would miss most of them.
        for phase in PHASES:
            plane.kubectl("patch", "gtr", name, "-n", chain.NAMESPACE, "--subresource=status", "--type=merge",
                          "-p", json.dumps({"status": {"phase": phase}}))  # fmt: skip
        assert timeline.caught_up("Succeeded") == PHASES
        assert processes_naming(f"metadata.name={name}") != {}
    finally:
        timeline.close()
        plane.kubectl("delete", "gtr", name, "-n", chain.NAMESPACE, "--ignore-not-found")
    assert processes_naming(f"metadata.name={name}") == {}
