"""A Hugging Face `TrainerCallback` that gives a plain `Trainer` script the operator's features: progress
(loss, eval loss, steps) in the job's status, and on SIGTERM a checkpoint at the next step that every rank
agrees on, after which the script calls `sharded_trainer.exit_stopped()`.

    trainer = Trainer(..., callbacks=[ShardedCallback()])
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))
    if sharded_trainer.stop_requested():
        sharded_trainer.exit_stopped()
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from sharded_trainer.helper import flush, report, stop_requested


def agreed_stop() -> bool:
    """Whether any rank was asked to stop: a one-element all-reduce, so every rank stops at the same step
    (a rank that saved alone would wait in the checkpoint's collectives for the others)."""
    asked = stop_requested()
    if not (dist.is_available() and dist.is_initialized()):
        return asked
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if asked else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class ShardedCallback(TrainerCallback):
    def __init__(self) -> None:
        self.stopped = False

    def on_train_begin(self, args, state, control, **kwargs):
        stop_requested()  # install the signal handlers before the first step

    def on_step_end(self, args, state, control, **kwargs):
        if agreed_stop():
            self.stopped = control.should_save = control.should_training_stop = True
        report(state.global_step, total_steps=state.max_steps)  # a heartbeat: hang detection counts from it

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        report(state.global_step, total_steps=state.max_steps, loss=logs.get("loss"), eval_loss=logs.get("eval_loss"))

    def on_train_end(self, args, state, control, **kwargs):
        report(state.global_step, total_steps=state.max_steps)
        flush()  # the final step reaches the job's status before the process exits
        if dist.is_available() and dist.is_initialized():
            # No rank leaves while another is still in the last step's collectives or the final save: a
            # gloo peer whose connection closes mid-operation aborts, and the job would count a failure.
            dist.barrier()

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        report(state.global_step, total_steps=state.max_steps, checkpoint={"step": state.global_step, "path": path})
