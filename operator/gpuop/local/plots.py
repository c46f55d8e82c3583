"""A run's curves as a picture: ``gpuop run --plot curves.png``.

matplotlib is an optional extra (``pip install 'gpu-training-operator[plots]'``): it is
imported only here, only when asked for, and drawn off-screen (Agg), so a machine without a
display can write the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gputrain.contract import HistoryPoint

# Panels: (title, HistoryPoint field, y-axis label).
PANELS: tuple[tuple[str, str, str], ...] = (
    ("Training loss", "loss", "loss"),
    ("Evaluation accuracy", "accuracy", "accuracy"),
    ("Throughput", "samples_per_second", "samples/s"),
    ("GPU utilization", "gpu_utilization_percent", "%"),
)


class PlotError(Exception):
    """The picture cannot be made here; the message says why and what to install."""


def write_curves(points: Sequence[HistoryPoint], path: Path, title: str) -> Path:
    """Draw each figure the history has against the optimizer step, into ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'gpu-training-operator[plots]'") from None
    shown = [(t, f, u) for t, f, u in PANELS if any(getattr(p, f) is not None for p in points)]
    if not shown:
        raise PlotError("the run has no metric history to draw (did its first logging interval pass?)")
    figure, axes = pyplot.subplots(len(shown), 1, figsize=(8, 2.6 * len(shown)), sharex=True, squeeze=False)
    for axis, (panel_title, field, unit) in zip(axes[:, 0], shown, strict=True):
        steps = [p.step for p in points if getattr(p, field) is not None]
        values = [getattr(p, field) for p in points if getattr(p, field) is not None]
        axis.plot(steps, values, marker="o" if len(values) < 20 else None, linewidth=1.5)
        if field == "loss" and min(values) > 0:
            axis.set_yscale("log")  # a loss falls by orders of magnitude; linear shows one cliff
        axis.set_title(panel_title, fontsize=10)
        axis.set_ylabel(unit)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    figure.suptitle(title)
    figure.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
    except OSError as exc:  # the run is done and kept: say where the picture could not go
        raise PlotError(f"--plot {path}: cannot write it: {exc.strerror or exc}") from None
    finally:
        pyplot.close(figure)
    return path
