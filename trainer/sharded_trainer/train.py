"""The training loop: load the newest checkpoint, then step, log and save until done or told to stop."""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from sharded_trainer import exitcodes
from sharded_trainer.checkpoint import CheckpointManager
from sharded_trainer.config import TrainerConfig
from sharded_trainer.data import ShardedLoader, TokenSource
from sharded_trainer.dist import DistEnv, any_true
from sharded_trainer.metrics import Meter, ProgressFile, emit
from sharded_trainer.model import Transformer, model_args
from sharded_trainer.parallel import build_strategy, mean_over_ranks


class StopRequest:
    """Set by SIGTERM/SIGINT; the loop turns it into one agreed step at which every rank stops."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.requested.set())


def build_model(cfg: TrainerConfig) -> Transformer:
    args = model_args(cfg.model.preset, cfg.model.vocab_size, cfg.seq_len)
    model = Transformer(args)
    model.init_weights(cfg.seed)  # same weights on every rank before sharding
    return model


def train(cfg: TrainerConfig, env: DistEnv, report: dict | None = None) -> int:
    """Train until cfg.steps or SIGTERM. `report` ({url, identity}) posts rank 0's progress to the operator."""
    stop = StopRequest()
    model = build_model(cfg)
    args = model.args
    strategy = build_strategy(model, cfg, env)
    loader = ShardedLoader(
        TokenSource(cfg.data, args.vocab_size, cfg.seq_len), micro_batch=cfg.micro_batch_size, rank=env.rank,
        world=env.world,
    )  # fmt: skip
    ckpt = CheckpointManager(cfg.checkpoint, env, cfg.steps)
    report = report or {}
    progress = ProgressFile(
        cfg.progress_file if env.is_main else None, cfg.steps,
        url=report.get("url") if env.is_main else None, identity=report.get("identity"),
    )  # fmt: skip

    step = 0
    resumed = ckpt.load_latest(strategy)
    if resumed:
        step = resumed["step"]
        loader.load_state_dict(resumed["data"])
        if env.is_main:
            emit({"event": "resumed", "step": step, "from_world": resumed["world"], "world": env.world})
    progress.update(step=step, lastCheckpoint=ckpt.last_committed)
    meter = Meter(args, cfg.seq_len, env.device, env.world)
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum_steps * cfg.seq_len

    # The stop vote travels over a CPU group so that it never waits for the GPU: steps stay queued.
    stop_group = dist.new_group(backend="gloo")
    last_loss, preempted = None, False
    while step < cfg.steps and not preempted:
        loss, grad_norm = strategy.train_step([loader.next_batch() for _ in range(cfg.grad_accum_steps)])
        step += 1
        meter.add(tokens_per_step)
        if step % cfg.log_every == 0 or step == cfg.steps:
            last_loss = mean_over_ranks(loss, env)  # the only per-log synchronization
            norm = None if grad_norm is None else float(grad_norm)
            rec = meter.flush(step, last_loss, strategy.current_lr(), norm)
            if env.is_main:
                emit(rec)
            progress.update(step=step, loss=rec["loss"], tokensPerSecond=rec["tokens_per_s"], mfu=rec["mfu"])
        preempted = any_true(stop.requested.is_set(), torch.device("cpu"), group=stop_group)
        state = {"data": loader.state_dict(), "loss": last_loss}
        if ckpt.save(step, strategy, state, force=preempted):
            progress.update(lastCheckpoint=ckpt.last_committed)  # an async save shows once committed
    ckpt.wait()
    progress.update(step=step, lastCheckpoint=ckpt.last_committed)
    if env.is_main:
        emit({"event": "preempted" if preempted else "finished", "step": step, "checkpoint": ckpt.last_committed})
    progress.flush()
    if preempted:
        return exitcodes.PREEMPTED
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    return 0
