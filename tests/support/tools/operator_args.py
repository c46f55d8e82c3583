"""The settings ``gpuop operator ARGS`` runs with under an environment, for tests: the chart's
(the Deployment's args and env, parsed the operator's way) and the settings' own."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from gpuop.cli.commands import operator as operator_command
from gpuop.controller.settings import OperatorSettings, from_options


def parse_operator_args(args: Sequence[str], env: Mapping[str, str]) -> OperatorSettings:
    """What the real command's options make of ``args`` with exactly ``env`` as the process's
    environment (click reads the GPUOP_* variables from os.environ, so it is swapped for the
    call: tests only, never beside other threads reading it)."""
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        with operator_command.make_context("operator", list(args)) as context:
            return from_options(context.params)
    finally:
        os.environ.clear()
        os.environ.update(saved)
