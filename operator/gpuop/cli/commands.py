"""The ``gpuop`` command line: render, validate, run and print the CRD without a cluster, and
run the operator.

Every option also reads a ``GPUOP_*`` variable, named in its --help; shell completion comes
from ``gpuop completion SHELL``. Exit codes: 0 success, 2 bad input (each problem one line on
stderr, naming the file, line, field and rule), 1 a check that found a difference (``crd
--check``) or a failed local run, 130/143 a local run stopped by SIGINT/SIGTERM (resumable).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import click
import yaml
from click.core import ParameterSource

from gpuop._kits.schema import SpecError
from gpuop.api.apidoc import api_reference
from gpuop.api.crd import build_crd, crd_yaml
from gpuop.api.identity import DEFAULT_TRAINER_IMAGE, PACKAGE_VERSION
from gpuop.api.spec import GpuTraining, warnings
from gpuop.backends.registry import APIS, all_gaps, parse_training, rbac_rules_yaml, render_job, summaries
from gpuop.cli.documents import Document, DocumentError, read_documents
from gpuop.controller.settings import ENV_PREFIX, SettingsError, from_options, operator_options
from gputrain.contract import EXIT_INTERRUPTED, EXIT_PREEMPTED

if TYPE_CHECKING:
    from gpuop.local.runner import LocalRun

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2
# What kubectl reads from a directory given to -f.
MANIFEST_SUFFIXES: Final = (".yaml", ".yml", ".json")
SHELLS: Final = ("bash", "zsh", "fish")

F = TypeVar("F", bound=Callable[..., Any])


class _BadInputError(Exception):
    """Problems with the user's input, already formatted one per line."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


# --------------------------------------------------------------------------------------------
# Reading manifests


def _expand(paths: Sequence[str]) -> tuple[list[str], list[str]]:
    """Files to read, with each directory replaced by its manifests (not recursive, in name
    order, as kubectl does); and the problems, a line each."""
    files: list[str] = []
    lines: list[str] = []
    for path in paths:
        if path == "-" or not Path(path).is_dir():
            files.append(path)
            continue
        found = sorted(str(f) for f in Path(path).iterdir() if f.suffix in MANIFEST_SUFFIXES and f.is_file())
        if not found:
            lines.append(f"{path}: a directory with no {', '.join(MANIFEST_SUFFIXES)} files")
        files += found
    return files, lines


def _load(paths: Sequence[str]) -> list[tuple[Document, GpuTraining]]:
    """Parse every document of every file; report all problems of all of them together."""
    parsed: list[tuple[Document, GpuTraining]] = []
    files, lines = _expand(paths)
    for path in files:
        try:
            documents = read_documents(path)
        except DocumentError as exc:
            lines.append(str(exc))
            continue
        for document in documents:
            try:
                parsed.append((document, parse_training(document.data)))
            except SpecError as exc:
                # In the order of the file, the way people read and fix it.
                located = sorted(
                    ((document.line_of(p.path), str(p)) for p in exc.problems), key=lambda x: x[0]
                )
                lines.extend(f"{document.source}:{line}: {problem}" for line, problem in located)
    if lines:
        raise _BadInputError(lines)
    return parsed


def _warn(parsed: list[tuple[Document, GpuTraining]]) -> None:
    """Valid but likely unwanted, for a cluster (`gpuop run` keeps its outputs in its workdir)."""
    for document, training in parsed:
        for warning in warnings(training.spec):
            print(f"warning: {document.where(warning.path)}: {warning}", file=sys.stderr)


def _dump(objects: list[dict[str, Any]], output: str) -> str:
    if output == "json":
        if len(objects) == 1:
            return json.dumps(objects[0], indent=2) + "\n"
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2) + "\n"
    return yaml.safe_dump_all(objects, sort_keys=False, explicit_start=len(objects) > 1)


# --------------------------------------------------------------------------------------------
# Options: one spelling each, every one with its GPUOP_* variable shown in --help


def _option(*declarations: str, **kwargs: Any) -> Callable[[F], F]:
    return click.option(*declarations, show_envvar=True, **kwargs)


def _files(*, single: bool = False) -> Callable[[F], F]:
    if single:
        return _option("-f", "--filename", required=True, metavar="FILE",
                       help="GpuTraining manifest (YAML or JSON; - for stdin).")  # fmt: skip
    return _option(
        "-f", "--filename", "filenames", multiple=True, required=True, metavar="FILE|DIR",
        help="GpuTraining manifest (YAML or JSON, several documents allowed; - for stdin), or a directory "
        "of them (its .yaml, .yml and .json files, not its subdirectories); repeatable.",
    )  # fmt: skip


def _output(*formats: str) -> Callable[[F], F]:
    return _option("-o", "--output", type=click.Choice(formats), default=formats[0], show_default=True,
                   help="Output format.")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Commands


# Click puts the "_" between its prefix and an option's name itself: GPUOP_ + NAME, as the
# operator's own options (gpuop.controller.settings) spell theirs.
@click.group(context_settings={"help_option_names": ["-h", "--help"],
                               "auto_envvar_prefix": ENV_PREFIX.removesuffix("_"),
                               "max_content_width": 100})  # fmt: skip
@click.version_option(PACKAGE_VERSION, "--version", prog_name="gpuop", message="%(prog)s %(version)s")
def cli() -> None:
    """GPU training operator: render, validate and run GpuTraining resources, and run the operator."""


@cli.command()
@_files()
@_output("yaml", "json")
@_option("--backend", type=click.Choice(tuple(APIS)),
         help="The Kubeflow API to render for. Default: spec.backend; pytorchjob for auto, as on a cluster "
         "that serves both.")  # fmt: skip
@_option("--image", default=DEFAULT_TRAINER_IMAGE, show_default=True,
         help="Trainer image for specs without spec.image.")  # fmt: skip
def render(filenames: tuple[str, ...], output: str, backend: str | None, image: str) -> int:
    """Print the Kubeflow job of each GpuTraining: a PyTorchJob, or a TrainingRuntime and TrainJob."""
    objects: list[dict[str, Any]] = []
    lines: list[str] = []
    parsed = _load(filenames)
    for document, training in parsed:
        # Without a cluster there is nothing to discover: auto renders what it prefers.
        requested = training.spec.backend
        chosen = backend or (requested if requested != "auto" else next(iter(APIS)))
        try:
            objects += render_job(training, chosen, default_image=image)
        except SpecError as exc:
            lines.extend(f"{document.where(p.path)}: {p} (--backend {chosen})" for p in exc.problems)
    if lines:
        raise _BadInputError(lines)
    _warn(parsed)
    sys.stdout.write(_dump(objects, output))
    return EXIT_OK


@cli.command()
@_files()
def validate(filenames: tuple[str, ...]) -> int:
    """Check GpuTraining manifests against the API's rules."""
    parsed = _load(filenames)
    _warn(parsed)
    for document, training in parsed:
        print(f"{document.source}: gputraining/{training.name} is valid")
    return EXIT_OK


@cli.command()
@_files(single=True)
@_option("--workers", type=click.IntRange(min=1), help="Processes to start instead of spec.workers "
         "(x GPUs per worker).")  # fmt: skip
@_output("yaml", "json")
@_option("--fresh", is_flag=True, help="Start over: move this run's checkpoints and outputs aside (to "
         "WORKDIR/NAME/previous-TIME/) instead of resuming from them.")  # fmt: skip
@_option("--workdir", default=".gpuop-runs", show_default=True, type=click.Path(file_okay=False),
         help="Checkpoints, outputs, the metric history and the trainer log go under "
         "WORKDIR/NAME.")  # fmt: skip
@_option("--plot", type=click.Path(dir_okay=False, writable=True), metavar="FILE.png",
         help="Also draw the run's curves (loss, accuracy, samples/s, GPU utilization) into this PNG "
         "(needs the plots extra: matplotlib).")  # fmt: skip
def run(filename: str, workers: int | None, output: str, fresh: bool, workdir: str, plot: str | None) -> int:
    """Train a GpuTraining on this machine (torchrun; gloo on CPU) and print its status."""
    from gpuop.local import figures, progress, runner

    loaded = _load([filename])
    if len(loaded) != 1:
        raise _BadInputError([f"{filename}: run takes one GpuTraining; the file has {len(loaded)}"])
    document, training = loaded[0]
    plan = runner.plan(training, workers, Path(workdir))
    shortfall = runner.gpu_shortfall(plan, runner.visible_gpus())
    if shortfall is not None:
        raise _BadInputError([f"{document.where('spec.gpusPerWorker')}: {shortfall}"])
    try:
        with runner.hold_run_directory(plan):
            _ready_run_directory(document, training, plan, fresh)
            log_path = runner.new_log(plan)
            print(
                f"training {training.name}: {plan.processes} process(es), "
                f"backend {training.spec.distributed_backend}; trainer log: {log_path}",
                file=sys.stderr,
            )
            with log_path.open("w") as log, progress.Display(training.name) as display:
                status = runner.execute(plan, display.show, log, lock=False)
                display.finish(status)
    except (runner.RunDirectoryBusyError, runner.CommandNotFoundError, runner.DatasetFetchError) as exc:
        raise _BadInputError([str(exc)]) from None
    written = runner.status_document(status)
    if output == "json":
        sys.stdout.write(json.dumps(written, indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump({"status": written}, sort_keys=False))
    points = runner.history(plan)
    print("\n".join(figures.summary(plan, status, points)), file=sys.stderr)
    if plot is not None:
        from gpuop.local import plots

        try:
            drawn = plots.write_curves(points, Path(plot), f"{training.name}: {status.phase}")
        except plots.PlotError as exc:
            raise _BadInputError([str(exc)]) from None
        print(f"  curves: {drawn}", file=sys.stderr)
    if status.phase != "Succeeded":
        lines = log_path.read_text(errors="replace").splitlines()
        # The trainer's own warnings and errors say why; torchrun's failure dump says little.
        own = [line for line in lines if re.search(r" rank \d+ (ERROR|WARNING) ", line)]
        print("\n".join(["trainer log:", *(own or lines)[-15:]]), file=sys.stderr)
        stopped = next(
            (c.reason for c in status.conditions if c.type == "Suspended" and c.status == "True"), None
        )
        # A signal's own exit code, as a shell reports it: the run is paused, not failed.
        return {"Interrupted": EXIT_INTERRUPTED, "Preempted": EXIT_PREEMPTED}.get(
            stopped or "", EXIT_DIFFERENT
        )
    return EXIT_OK


def _ready_run_directory(document: Document, training: GpuTraining, plan: LocalRun, fresh: bool) -> None:
    """The run directory made ready for this run: an earlier run's files moved aside for
    ``--fresh``; refused when that cannot be done, or when the run there already finished."""
    from gpuop.local import runner

    if fresh and training.spec.checkpoint.uri is not None:
        raise _BadInputError([
            f"{document.where('spec.checkpoint.uri')}: spec.checkpoint.uri: --fresh moves this "
            "machine's checkpoints aside and leaves a bucket's alone; point uri at a new prefix "
            "to start over"
        ])  # fmt: skip
    if fresh:
        moved = runner.move_aside(plan)
        if moved is not None:
            print(f"the earlier run's checkpoints and outputs are in {moved}", file=sys.stderr)
    else:
        finished = runner.finished_result(plan)
        if finished is not None:
            raise _BadInputError([
                f"{training.name} already finished in {plan.workdir / training.name} ({finished}); "
                "add --fresh to train it again from the start"
            ])  # fmt: skip


@cli.command(
    epilog="Runs against the cluster kubectl would use: in a pod its ServiceAccount, else KUBECONFIG or "
    "~/.kube/config."
)
@operator_options
def operator(**values: Any) -> int:
    """Run the operator: reconcile GpuTrainings into Kubeflow jobs and report their status."""
    # Kopf imports the kubernetes client whenever it is installed, for a login through it that
    # the operator does not use (gpuop.controller.credentials reads the credentials): 20 MB of
    # resident memory. The operator's image does not install it; where another tool did, the
    # operator runs as light as in the image.
    sys.modules.setdefault("kubernetes", None)  # type: ignore[arg-type]
    from gpuop.controller import app as controller  # kopf: only for this command
    from gpuop.controller.apiclient import LoginError

    try:
        settings = from_options(values)
    except SettingsError as exc:
        raise _BadInputError([str(exc)]) from None
    try:
        return controller.run_operator(settings)
    except (LoginError, SettingsError) as exc:
        raise _BadInputError([str(exc)]) from None


@cli.command()
@_output("yaml", "markdown", "rbac")
@_option("--check", metavar="FILE", help="Instead, fail when FILE differs from it.")
def crd(output: str, check: str | None) -> int:
    """Print the GpuTraining CRD generated from the spec model and the backends (markdown: the API
    reference; rbac: the chart's RBAC rules for the backends' jobs)."""
    if output == "rbac":
        expected = rbac_rules_yaml()
    elif output == "yaml":
        expected = crd_yaml(summaries(), all_gaps())
    else:
        expected = api_reference(build_crd(summaries(), all_gaps()))
    if check is None:
        sys.stdout.write(expected)
        return EXIT_OK
    try:
        with open(check, encoding="utf-8") as handle:
            actual = handle.read()
    except OSError as exc:
        raise _BadInputError([f"{check}: cannot read: {exc.strerror}"]) from None
    if actual == expected:
        print(f"{check} is up to date")
        return EXIT_OK
    diff = difflib.unified_diff(actual.splitlines(keepends=True), expected.splitlines(keepends=True), check,
                                "generated")  # fmt: skip
    sys.stdout.writelines(diff)
    print(f"{check} is stale: run `make crds` and commit it", file=sys.stderr)
    return EXIT_DIFFERENT


@cli.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> int:
    """Print the shell completion script, e.g. `source <(gpuop completion bash)` in ~/.bashrc."""
    from click.shell_completion import get_completion_class

    completer = get_completion_class(shell)
    assert completer is not None  # one of SHELLS, all of which click knows
    sys.stdout.write(completer(cli, {}, "gpuop", "_GPUOP_COMPLETE").source() + "\n")
    return EXIT_OK


def _from_variable(error: click.UsageError) -> str:
    """Where a bad value came from, when it was the environment rather than the command line."""
    context, param = error.ctx, getattr(error, "param", None)
    if context is None or not isinstance(param, click.Option) or param.name is None:
        return ""
    if context.get_parameter_source(param.name) is not ParameterSource.ENVIRONMENT:
        return ""
    names = param.envvar or f"{context.auto_envvar_prefix}_{param.name.upper()}"
    set_ = [n for n in ([names] if isinstance(names, str) else names) if n in os.environ]
    return f", from {set_[0]}" if set_ else ""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = cli.main(
            args=list(argv) if argv is not None else None, prog_name="gpuop", standalone_mode=False
        )
    except _BadInputError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except click.exceptions.NoArgsIsHelpError as exc:  # `gpuop` alone: the help, as kubectl does
        print(exc.format_message())
        return EXIT_OK
    except click.UsageError as exc:
        # One line, naming the option (and its variable when the value came from there).
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        print(f"error: {exc.format_message().rstrip('.')}{_from_variable(exc)}{hint}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except click.ClickException as exc:
        print(f"error: {exc.format_message()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `gpuop render ... | head`
        sys.stderr.close()
        return EXIT_OK
    except (KeyboardInterrupt, click.exceptions.Abort):
        return EXIT_INTERRUPTED
    return code if isinstance(code, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
