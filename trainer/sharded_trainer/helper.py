"""The operator's features for a script of your own (`spec.command`): progress reports (and with them hang
detection and status), a stop that ends in a checkpoint (suspend, drain, preemption), and the job's trainer
section as a config. Import it as `sharded_trainer`:

    import sharded_trainer

    cfg = sharded_trainer.job_config()              # spec.trainer, checkpoint.dir where the claim is mounted
    for step in range(start, cfg.steps):
        ...
        sharded_trainer.report(step + 1, loss=loss, total_steps=cfg.steps)
        if sharded_trainer.stop_requested():        # SIGTERM: the pod is stopping
            save_checkpoint(...)
            sharded_trainer.report(step + 1, checkpoint={"step": step + 1, "path": path})
            sharded_trainer.exit_stopped()          # 75: the operator resumes the job, no failure counted
    sharded_trainer.flush()                         # the last report, before the process exits

`sharded_trainer.hf_callback.ShardedCallback` does all of it for a Hugging Face `Trainer`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import NoReturn

from sharded_api.config import TrainerConfig
from sharded_api.contract import DEFAULT_CONFIG_PATH, ExitCode, UserEnv, WorkerEnv, iso
from sharded_api.loading import load_config
from sharded_trainer.launch import record_exit
from sharded_trainer.reporting.progress import ProgressReporter, target_from_env

_reporter: ProgressReporter | None = None
_stop = threading.Event()
_handlers_installed = False


def job_config(path: str | None = None) -> TrainerConfig:
    """The job's trainer config (model, data, steps, optimizer, checkpoint directory), validated."""
    return load_config(path or os.environ.get(UserEnv.TRAINER_CONFIG, DEFAULT_CONFIG_PATH))


def is_main() -> bool:
    return os.environ.get(WorkerEnv.RANK, "0") == "0"


def report(
    step: int,
    *,
    total_steps: int | None = None,
    loss: float | None = None,
    eval_loss: float | None = None,
    tokens_per_second: float | None = None,
    checkpoint: dict | None = None,
) -> None:
    """Rank 0 tells the operator where training stands (other ranks return at once). Cheap to call every
    step: posts go out at most once a second, on a background thread. `checkpoint` ({step, path}) reports
    a checkpoint that is complete on the claim."""
    global _reporter
    if not is_main():
        return
    if _reporter is None:
        _reporter = ProgressReporter(
            target_from_env(), total_steps=total_steps, path=os.environ.get(UserEnv.PROGRESS_FILE)
        )
    if checkpoint is not None:
        committed = {"step": int(checkpoint["step"]), "path": str(checkpoint["path"]), "time": iso()}
        _reporter.checkpoint_committed(committed)
    _reporter.update(
        step=step, total_steps=total_steps, loss=loss, eval_loss=eval_loss, tokens_per_second=tokens_per_second
    )


def flush() -> None:
    """Send the newest report now (reports go out at most once a second): call it when training ends."""
    if _reporter is not None:
        _reporter.flush()


def stop_requested() -> bool:
    """True once the pod is being stopped (SIGTERM or SIGINT). The first call installs the handlers: call it
    once before training. Ranks can see the signal a step apart: agree (e.g. an all-reduce of the flag)
    before saving, as ShardedCallback does."""
    global _handlers_installed
    if not _handlers_installed:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: _stop.set())
        _handlers_installed = True
    return _stop.is_set()


def exit_stopped() -> NoReturn:
    """Exit as a worker that stopped after its final checkpoint: exit code 75, which the operator treats as a
    stop to resume from, not a failure. Sends the last report first."""
    flush()
    sys.exit(record_exit(ExitCode.PREEMPTED))
