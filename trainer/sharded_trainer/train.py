"""The training loop: load the newest checkpoint, then step, log and save until done or told to stop."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_trainer.checkpoint import CheckpointManager, Fenced, Incompatible
from sharded_trainer.config import TrainerConfig, accumulation_for, describe_batch, with_kept_batch
from sharded_trainer.contract import STOPPING, ExitCode, PodEnv, TrainerEventType
from sharded_trainer.data import ShardedLoader, TokenSource
from sharded_trainer.metrics import Meter, emit
from sharded_trainer.model import build_model
from sharded_trainer.parallel import mean_over_ranks
from sharded_trainer.process_group import DistEnv, any_true
from sharded_trainer.reporting import ProgressReporter, ReportTarget
from sharded_trainer.strategies import build_strategy
from sharded_trainer.tensorboard import EventWriter

# How long ranks stopped by torchrun (not by the launcher) may take to agree on a final checkpoint: the
# vote is a tiny all-reduce after the iteration in progress, which only a peer that does not answer holds up
# for longer. Twice the slowest iteration so far (a save included) and a second, within these bounds: the
# upper one before any iteration is timed, and below torchrun's own 30 s kill.
STOP_AGREE_SECONDS = (2.0, 25.0)


class StopRequest:
    """Set by SIGTERM/SIGINT; the loop turns it into one agreed step at which every rank stops.

    A stop the launcher sends (the pod is being stopped) has the pod's whole grace for the final checkpoint.
    Under the launcher, any other SIGTERM is torchrun's: it restarts the workers (a peer failed, or the
    membership changed) and kills them 30 s later whatever they do. When a peer is frozen or cut off, every
    collective waits for it and the stop can never be agreed: the worker then exits after `agree_seconds()`
    without a checkpoint (the newest one is resumed), so the next rendezvous round starts then, not at
    torchrun's kill."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.agreed = threading.Event()  # every rank voted for the stop: the final checkpoint goes ahead
        self.slowest: float | None = None  # the slowest iteration (step, vote, save) so far, in seconds
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.requested.set())
        if os.environ.get(PodEnv.EXIT_DIR):
            # A Python handler runs only when the main thread returns to Python, never while it waits in a
            # collective: the signal's arrival is read from the interpreter's wakeup fd on a thread instead.
            r, w = os.pipe()
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(r,), name="stop-watch", daemon=True).start()

    def _watch(self, fd: int) -> None:
        while not {signal.SIGTERM, signal.SIGINT} & set(os.read(fd, 64)):
            pass
        self.requested.set()
        if not Path(os.environ[PodEnv.EXIT_DIR], STOPPING).exists():
            self._deadline()

    def timed(self, seconds: float) -> None:
        self.slowest = max(self.slowest or 0.0, seconds)

    def agree_seconds(self) -> float:
        low, high = STOP_AGREE_SECONDS
        return high if self.slowest is None else min(high, max(low, 2 * self.slowest + 1))

    def _deadline(self) -> None:
        wait = self.agree_seconds()
        if not self.agreed.wait(wait):
            print(
                f"[trainer] torchrun stopped the workers and the ranks did not agree on a final checkpoint within "
                f"{wait:.0f}s (a peer is unreachable): exiting without one",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            os._exit(1)  # threads blocked in a collective would hold a normal exit


def fingerprint(cfg: TrainerConfig, model) -> dict:
    """What a checkpoint of this run can be resumed by: the strategy and the model's shape. Not the world
    size: both strategies reshard on load. The sequence length is left out: RoPE tables are not saved."""
    shape = {k: v for k, v in dataclasses.asdict(model.args).items() if k != "max_seq_len"}
    return {"strategy": cfg.strategy.type, "model": shape}


def train(cfg: TrainerConfig, env: DistEnv, target: ReportTarget | None = None) -> int:
    """Train until cfg.steps or SIGTERM. Rank 0 reports progress and events to `target` (the operator)."""
    stop = StopRequest()
    if env.is_main:  # the process group is up: the rendezvous is over
        emit({"event": "started", "world": env.world})
    # The world that rendezvoused decides the accumulation when the batch is global (an elastic job).
    cfg = with_kept_batch(cfg, env.local_world)
    accum, global_batch = accumulation_for(cfg, env.world)
    cfg = cfg.model_copy(update={"grad_accum_steps": accum})
    model = build_model(cfg)
    args = model.args
    strategy = build_strategy(model, cfg, env)
    loader = ShardedLoader(
        TokenSource(cfg.data, args.vocab_size, cfg.seq_len), micro_batch=cfg.micro_batch_size, rank=env.rank,
        world=env.world,
    )  # fmt: skip
    report = ProgressReporter(
        target if env.is_main else None, total_steps=cfg.steps, path=cfg.progress_file if env.is_main else None
    )
    report.progress["global_batch_size"] = global_batch  # sent with the first report
    def set_aside(info: dict) -> None:  # rank 0: a checkpoint that failed its checks or its load
        emit({"event": "set_aside", **info})
        report.event(
            TrainerEventType.CHECKPOINT_SET_ASIDE, f"checkpoint at step {info['step']} set aside: {info['reason']}",
            step=info["step"], checkpoint={"step": info["step"], "path": info["path"]},
        )  # fmt: skip

    if env.is_main:
        emit({"event": "layout", "strategy": cfg.strategy.type, "layout": strategy.layout})
    ckpt = CheckpointManager(
        cfg.checkpoint, env, cfg.steps, on_commit=report.checkpoint_committed, on_set_aside=set_aside,
        fingerprint=fingerprint(cfg, model),
    )  # fmt: skip
    # What the run settled on (backend `auto` resolved here outside a pod; the world size torchrun made).
    if env.is_main:
        emit({"event": "batch", "global_batch": global_batch, "grad_accum_steps": accum, "world": env.world,
              **({"requested": cfg.global_batch_size} if cfg.global_batch_size not in (None, global_batch) else {})})
    report.event(
        TrainerEventType.SETTING_CHOSEN,
        f"{cfg.strategy.type} on {env.world} processes ({strategy.layout}), backend {env.backend} "
        f"on {env.device.type}, {describe_batch(cfg, env.world)}",
    )

    step = 0
    try:
        resumed = ckpt.load_latest(strategy)
    except Incompatible as e:  # a permanent failure that names the difference, never a crash loop
        if env.is_main:
            emit({"event": "incompatible", "reason": str(e)})
        report.event(TrainerEventType.INCOMPATIBLE_CHECKPOINT, str(e))
        report.update(step=0)
        report.flush()
        return ExitCode.INCOMPATIBLE_CHECKPOINT
    if resumed:
        step = resumed["step"]
        loader.load_state_dict(resumed["data"])
        if env.is_main:
            emit({"event": "resumed", "step": step, "from_world": resumed["world"], "world": env.world})
        report.event(
            TrainerEventType.RESUMED, f"resumed at step {step} (world {resumed['world']} -> {env.world})",
            step=step, checkpoint=ckpt.last_committed,
        )  # fmt: skip
    report.update(step=step, last_checkpoint=ckpt.last_committed)
    meter = Meter(args, cfg.seq_len, env.device, env.world)
    board = EventWriter(Path(cfg.checkpoint.dir) / "tensorboard") if cfg.tensorboard and env.is_main else None
    tokens_per_step = cfg.micro_batch_size * cfg.grad_accum_steps * cfg.seq_len

    # The stop vote travels over a CPU group so that it never waits for the GPU: steps stay queued.
    stop_group = dist.new_group(backend="gloo")
    last_loss, preempted = None, False
    try:
        while step < cfg.steps and not preempted:
            began = time.monotonic()
            loss, grad_norm = strategy.train_step([loader.next_batch() for _ in range(cfg.grad_accum_steps)])
            step += 1
            meter.add(tokens_per_step)
            if step % cfg.log_every == 0 or step == cfg.steps:
                last_loss = mean_over_ranks(loss, env)  # the only per-log synchronization
                norm = None if grad_norm is None else float(grad_norm)
                rec = meter.flush(step, last_loss, strategy.current_lr(), norm)
                if cfg.precision == "fp16" and hasattr(strategy, "skipped_steps"):  # overflows under loss scaling
                    rec["skipped_steps"] = strategy.skipped_steps
                if env.is_main:
                    emit(rec)
                if board is not None:
                    board.scalars(step, {k: rec.get(k) for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu")})
                report.update(step=step, loss=rec["loss"], tokens_per_second=rec["tokens_per_s"], mfu=rec["mfu"])
            preempted = any_true(stop.requested.is_set(), torch.device("cpu"), group=stop_group)
            if preempted:
                stop.agreed.set()
            state = {"data": loader.state_dict(), "loss": last_loss}
            ckpt.save(step, strategy, state, force=preempted)
            stop.timed(time.monotonic() - began)
        ckpt.wait()
    except Fenced as e:  # a newer attempt started on the claim: this one is a zombie and must stop
        if env.is_main:
            emit({"event": "fenced", "step": step, "reason": str(e)})
        return ExitCode.FENCED
    finally:
        if board is not None:
            board.close()
    report.update(step=step, last_checkpoint=ckpt.last_committed)
    if env.is_main:
        emit({"event": "preempted" if preempted else "finished", "step": step, "checkpoint": ckpt.last_committed})
    report.flush()
    if preempted:
        return ExitCode.PREEMPTED if stop.requested.is_set() else ExitCode.PEER_STOPPED
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
    return ExitCode.OK

