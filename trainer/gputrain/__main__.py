"""``python -m gputrain``: the process torchrun starts in every training pod.

Settings come from the GPUTRAIN_* environment the operator renders; flags override them
(``--epochs 3``). Exit codes (gputrain.contract): 0 done, 2 bad settings, 3 dataset
missing, 4 the checkpoint store refused at the start, 143 preempted by SIGTERM after writing a
checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from gputrain.contract import (
    EXIT_BAD_CONFIG,
    EXIT_DATA_MISSING,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OUTPUT_STORAGE,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    FAILURE_REASONS,
    TERMINATION_LOG,
    ContractError,
    Result,
    TrainerSettings,
    env_name,
)

if TYPE_CHECKING:
    from gputrain.train import Trainer


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gputrain", description=__doc__.splitlines()[0])
    for field in dataclasses.fields(TrainerSettings):
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, dest=field.name, metavar="VALUE", help=f"overrides {env_name(field.name)}")
    parser.add_argument(
        "--termination-log",
        default=TERMINATION_LOG,
        help="where the final result goes for the pod's termination message (default: %(default)s)",
    )
    return parser


def settings_from(argv: Sequence[str] | None, environ: dict[str, str]) -> tuple[TrainerSettings, str]:
    """The settings: environment first, then flags."""
    args = _parser().parse_args(argv)
    merged = dict(environ)
    for field in dataclasses.fields(TrainerSettings):
        value = getattr(args, field.name)
        if value is not None:
            merged[env_name(field.name)] = value
    return TrainerSettings.from_env(merged), args.termination_log


def _report_failure(path: str, code: int, message: str, *, permanent: bool = False) -> int:
    """Leave the reason in the termination message (one writer per pod), and return ``code``.
    ``permanent``: a restart would fail the same way (Result.permanent)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        record = Result(phase="Failed", reason=FAILURE_REASONS[code], message=message[:3000],
                        permanent=permanent)  # fmt: skip
        # Outside a pod there may be no termination log; the log line already says it all.
        with contextlib.suppress(OSError):
            Path(path).write_text(record.to_json())
    return code


def _stopped(trainer: Trainer | None, *, saved: bool) -> tuple[int, str]:
    """The exit code and the one line of a run stopped by a signal: Ctrl-C, or the SIGTERM of a
    pod's deletion (a preemption, a suspend), which the next start resumes from."""
    step = trainer.position.step if trainer else 0
    interrupted = trainer is not None and trainer.stop_signal == signal.SIGINT
    name = "SIGINT (Ctrl-C)" if interrupted else "SIGTERM"
    message = f"stopped by {name} at step {step}; the next start resumes from its checkpoint"
    if not saved:
        message = (f"stopped by {name} at step {step}; its checkpoint could not be saved (see the log): "
                   "the next start resumes from the last complete one")  # fmt: skip
    return (EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED), message


def main(argv: Sequence[str] | None = None, after: Callable[[Trainer], None] | None = None) -> int:
    """Train; ``after`` sees the trainer of a successful run (tests use it to inspect ranks)."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s",
        stream=sys.stdout,
    )
    log = logging.getLogger("gputrain")
    try:
        settings, termination_log = settings_from(argv, dict(os.environ))
    except ContractError as exc:
        for line in str(exc).splitlines():
            log.error("bad setting: %s", line)
        return _report_failure(
            _parser().parse_args(argv).termination_log, EXIT_BAD_CONFIG, str(exc), permanent=True
        )

    # Heavy imports after the settings are known to be good: a typo fails in milliseconds.
    from gputrain.data import DatasetMissingError
    from gputrain.distributed import join, leave
    from gputrain.storage import StorageError
    from gputrain.train import OutputUploadError, PreemptedError, Trainer

    try:
        cluster = join(settings.backend)
    except ContractError as exc:  # the node's devices (nccl with no GPU visible): another may have them
        log.error("bad setting: %s", exc)
        return _report_failure(termination_log, EXIT_BAD_CONFIG, str(exc))
    trainer: Trainer | None = None
    try:
        trainer = Trainer(settings, cluster, termination_log=termination_log)
        trainer.run()
        if after is not None:
            after(trainer)
    except ContractError as exc:
        log.error("bad setting: %s", exc)
        return _report_failure(termination_log, EXIT_BAD_CONFIG, str(exc), permanent=True)
    except DatasetMissingError as exc:
        log.error("%s", exc)
        return _report_failure(termination_log, EXIT_DATA_MISSING, str(exc), permanent=True)
    except OutputUploadError as exc:  # trained, but the model is not where the spec said
        log.error("%s", exc)
        return _report_failure(termination_log, EXIT_OUTPUT_STORAGE, str(exc), permanent=exc.refused)
    except StorageError as exc:  # reading the checkpoints at the start: nothing to train from
        log.error("%s", exc)
        return _report_failure(termination_log, EXIT_STORAGE, str(exc), permanent=exc.refused)
    except PreemptedError as stopped:
        code, message = _stopped(trainer, saved=stopped.saved)
        log.warning("%s", message)
        return _report_failure(termination_log, code, message)
    finally:
        if trainer is not None:
            trainer.close()
    # DDP holds the process group: let both go before leaving it.
    del trainer
    gc.collect()
    leave(cluster)
    return EXIT_OK


def run_and_exit(
    argv: Sequence[str] | None = None, after: Callable[[Trainer], None] | None = None
) -> NoReturn:
    """``main``, then exit without interpreter teardown.

    Everything that matters (checkpoints, result, termination message) is written and
    fsynced by then. Tearing down torch.distributed's C++ objects in the interpreter's
    order occasionally aborts a rank ("terminate called without an active exception",
    seen in about 1 in 30 CPU runs here), which would turn a finished run into a failed
    pod; skipping the teardown cannot lose anything.
    """
    code = main(argv, after)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
