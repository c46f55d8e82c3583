"""The ``gpuop`` command line: render, validate and print the CRD, without a cluster.

Exit codes: 0 success, 2 bad input (each problem one line on stderr, naming the file, line,
field and rule), 1 a check that found a difference (``crd --check``) or a failed local run.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gpuop.apidoc import api_reference
from gpuop.backends import render_job
from gpuop.crd import build_crd, crd_yaml
from gpuop.documents import Document, DocumentError, read_documents
from gpuop.identity import DEFAULT_TRAINER_IMAGE
from gpuop.schema import SpecError
from gpuop.scrape import TrainerMetrics
from gpuop.settings import SettingsError, add_arguments, from_arguments
from gpuop.spec import GpuTraining, parse
from gputrain.contract import EXIT_INTERRUPTED, EXIT_PREEMPTED

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2


class _BadInputError(Exception):
    """Problems with the user's input, already formatted one per line."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


def _first(pair: tuple[int, str]) -> int:
    return pair[0]


def _load(files: Sequence[str]) -> list[tuple[Document, GpuTraining]]:
    """Parse every document of every file; report all problems of all of them together."""
    parsed: list[tuple[Document, GpuTraining]] = []
    lines: list[str] = []
    for path in files:
        try:
            documents = read_documents(path)
        except DocumentError as exc:
            lines.append(str(exc))
            continue
        for document in documents:
            try:
                parsed.append((document, parse(document.data)))
            except SpecError as exc:
                # In the order of the file, the way people read and fix it.
                located = sorted(
                    ((document.line_of(p.path), str(p)) for p in exc.problems), key=lambda x: x[0]
                )
                lines.extend(f"{document.source}:{line}: {problem}" for line, problem in located)
    if lines:
        raise _BadInputError(lines)
    return parsed


def _dump(objects: list[dict[str, Any]], output: str) -> str:
    if output == "json":
        if len(objects) == 1:
            return json.dumps(objects[0], indent=2) + "\n"
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2) + "\n"
    return yaml.safe_dump_all(objects, sort_keys=False, explicit_start=len(objects) > 1)


def _cmd_render(args: argparse.Namespace) -> int:
    objects: list[dict[str, Any]] = []
    lines: list[str] = []
    for document, training in _load(args.filename):
        # Without a cluster there is nothing to discover: auto renders what it prefers.
        requested = training.spec.backend
        backend = args.backend or (requested if requested != "auto" else "pytorchjob")
        try:
            objects += render_job(training, backend, default_image=args.image)
        except SpecError as exc:
            lines.extend(f"{document.where(p.path)}: {p} (--backend {backend})" for p in exc.problems)
    if lines:
        raise _BadInputError(lines)
    sys.stdout.write(_dump(objects, args.output))
    return EXIT_OK


def _cmd_validate(args: argparse.Namespace) -> int:
    for document, training in _load(args.filename):
        print(f"{document.source}: gputraining/{training.name} is valid")
    return EXIT_OK


class _Progress:
    """Progress on stderr: redrawn in place on a terminal, a line per 10% otherwise (CI logs)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def __call__(self, metrics: TrainerMetrics) -> None:
        from gpuop.local import progress_line

        line = progress_line(metrics)
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
            sys.stderr.flush()
            return
        decile = int((metrics.percent or 0.0) // 10)
        if decile != self.shown:
            self.shown = decile
            print(line, file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _cmd_run(args: argparse.Namespace) -> int:
    from gpuop import local

    loaded = _load([args.filename])
    if len(loaded) != 1:
        raise _BadInputError([f"{args.filename}: run takes one GpuTraining; the file has {len(loaded)}"])
    if args.workers is not None and args.workers < 1:
        raise _BadInputError([f"--workers: must be >= 1 (got {args.workers})"])
    document, training = loaded[0]
    run = local.plan(training, args.workers, Path(args.workdir))
    shortfall = local.gpu_shortfall(run, local.visible_gpus())
    if shortfall is not None:
        raise _BadInputError([f"{document.where('spec.gpusPerWorker')}: {shortfall}"])
    try:
        with local.hold_run_directory(run):
            if args.fresh:
                moved = local.move_aside(run)
                if moved is not None:
                    print(f"the earlier run's checkpoints and outputs are in {moved}", file=sys.stderr)
            else:
                finished = local.finished_result(run)
                if finished is not None:
                    raise _BadInputError([
                        f"{training.name} already finished in {run.workdir / training.name} ({finished}); "
                        "add --fresh to train it again from the start"
                    ])  # fmt: skip
            log_path = local.new_log(run)
            print(
                f"training {training.name}: {run.processes} process(es), "
                f"backend {training.spec.distributed_backend}; "
                f"trainer log: {log_path}",
                file=sys.stderr,
            )
            progress = _Progress()
            with log_path.open("w") as log:
                status = local.execute(run, progress, log, lock=False)
            progress.done()
    except local.RunDirectoryBusyError as exc:
        raise _BadInputError([str(exc)]) from None
    written = local.status_document(status)
    if args.json:
        sys.stdout.write(json.dumps(written, indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump({"status": written}, sort_keys=False))
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


def _cmd_operator(args: argparse.Namespace) -> int:
    from gpuop import controller  # kopf and the kubernetes client: only for this command
    from gpuop.kube import LoginError

    try:
        settings = from_arguments(args)
    except SettingsError as exc:
        raise _BadInputError([str(exc)]) from None
    try:
        return controller.run(settings)
    except LoginError as exc:
        raise _BadInputError([str(exc)]) from None


def _cmd_crd(args: argparse.Namespace) -> int:
    expected = crd_yaml() if args.format == "yaml" else api_reference(build_crd())
    if args.check is None:
        sys.stdout.write(expected)
        return EXIT_OK
    try:
        with open(args.check, encoding="utf-8") as handle:
            actual = handle.read()
    except OSError as exc:
        raise _BadInputError([f"{args.check}: cannot read: {exc.strerror}"]) from None
    if actual == expected:
        print(f"{args.check} is up to date")
        return EXIT_OK
    diff = difflib.unified_diff(
        actual.splitlines(keepends=True), expected.splitlines(keepends=True), args.check, "generated"
    )
    sys.stdout.writelines(diff)
    print(f"{args.check} is stale: run `make crds` and commit it", file=sys.stderr)
    return EXIT_DIFFERENT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuop",
        description="GPU training operator: render, validate and run GpuTraining resources.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_files(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "-f",
            "--filename",
            action="append",
            required=True,
            metavar="FILE",
            help="GpuTraining manifest (YAML, several documents allowed; - for stdin); repeatable",
        )

    render = commands.add_parser(
        "render",
        help="print the Kubeflow job for each GpuTraining: a PyTorchJob, or a TrainingRuntime and TrainJob",
    )
    add_files(render)
    render.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml", help="output format")
    render.add_argument(
        "--backend",
        choices=("pytorchjob", "trainjob"),
        help="the Kubeflow API to render for (default: spec.backend; pytorchjob for auto, as on a "
        "cluster that serves both)",
    )
    render.add_argument(
        "--image",
        default=DEFAULT_TRAINER_IMAGE,
        help="trainer image for specs without spec.image (default: %(default)s)",
    )
    render.set_defaults(handler=_cmd_render)

    validate = commands.add_parser("validate", help="check GpuTraining manifests against the API rules")
    add_files(validate)
    validate.set_defaults(handler=_cmd_validate)

    run = commands.add_parser(
        "run", help="train a GpuTraining on this machine (torchrun; gloo on CPU) and print its status"
    )
    run.add_argument(
        "-f", "--filename", required=True, metavar="FILE", help="GpuTraining manifest (- for stdin)"
    )
    run.add_argument(
        "--workers", type=int, help="processes to start instead of spec.workers (x GPUs per worker)"
    )
    run.add_argument("--json", action="store_true", help="print the final status as JSON")
    run.add_argument(
        "--fresh",
        action="store_true",
        help="start over: move this run's checkpoints and outputs aside (to WORKDIR/NAME/previous-TIME/) "
        "instead of resuming from them",
    )
    run.add_argument(
        "--workdir",
        default=".gpuop-runs",
        help="checkpoints, outputs and the trainer log go under WORKDIR/NAME (default: %(default)s)",
    )
    run.set_defaults(handler=_cmd_run)

    operator = commands.add_parser(
        "operator",
        help="run the operator: reconcile GpuTrainings into PyTorchJobs and report their status",
        description="Run the operator against the cluster kubectl would use (in a pod: its "
        "ServiceAccount; else KUBECONFIG or ~/.kube/config). Every flag defaults to its GPUOP_* "
        "environment variable.",
    )
    add_arguments(operator)
    operator.set_defaults(handler=_cmd_operator)

    crd = commands.add_parser("crd", help="print the GpuTraining CRD generated from the spec model")
    crd.add_argument(
        "--format",
        choices=("yaml", "markdown"),
        default="yaml",
        help="yaml: the CRD; markdown: the API reference (docs/api.md) [%(default)s]",
    )
    crd.add_argument("--check", metavar="FILE", help="instead, fail when FILE differs from it")
    crd.set_defaults(handler=_cmd_crd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except _BadInputError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `gpuop render ... | head`
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
