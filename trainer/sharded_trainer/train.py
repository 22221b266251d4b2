"""The training loop: load the newest checkpoint, then step, log and save until done or told to stop."""

from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from sharded_api.batch import accumulation_for, describe_batch, with_kept_batch
from sharded_api.config import RECORD_SOURCES, TrainerConfig
from sharded_api.contract import STOPPING, ExitCode, PodEnv, TrainerEventType, UserEnv
from sharded_api.loading import ConfigError
from sharded_api.quantity import memory_bytes
from sharded_trainer import autoplan
from sharded_trainer.checkpoint.manager import CheckpointManager, Fenced, Incompatible, newest_committed, saved_strategy
from sharded_trainer.data import preference, records
from sharded_trainer.data.sources import IGNORE, ShardedLoader, TokenSource, collate
from sharded_trainer.modeling.build import build_network
from sharded_trainer.modeling.decoder import Network
from sharded_trainer.objective import DPO_METRICS, precompute_reference, reference_key
from sharded_trainer.process_group import DistEnv, any_true
from sharded_trainer.reporting.metrics import Meter, emit
from sharded_trainer.reporting.progress import ProgressReporter, ReportTarget
from sharded_trainer.reporting.tensorboard import EventWriter
from sharded_trainer.strategies.parallel import mean_over_ranks
from sharded_trainer.strategies.pick import build_strategy

# How long ranks stopped by torchrun (not by the launcher) may take to agree on a final checkpoint: the
# vote is a tiny all-reduce after the iteration in progress, which only a peer that does not answer holds up
# for longer. Twice the slowest iteration so far (a save included) and a second, within these bounds: the
# upper one before any iteration is timed, and below torchrun's own 30 s kill.
STOP_AGREE_SECONDS = (2.0, 25.0)
# What rank 0 writes to TensorBoard every logEvery steps, when the record has it (DPO's rewards).
BOARD_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mfu_6n", *DPO_METRICS)
# How long ranks wait for the one that tokenizes the records.
TOKENIZE_WAIT_SECONDS = 6 * 3600


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


def fingerprint(cfg: TrainerConfig, net: Network) -> dict:
    """What a checkpoint of this run can be resumed by: the strategy and the model's shape (and adapters).
    Not the world size: both strategies reshard on load."""
    return {"strategy": cfg.strategy.type, "model": net.fingerprint}


def token_source(cfg: TrainerConfig, env: DistEnv, vocab_size: int):
    """The configured source; records are tokenized once, by one rank, into a cache every rank then reads."""
    if cfg.data.source not in RECORD_SOURCES:
        return TokenSource(cfg.data, vocab_size, cfg.seq_len), None
    tokenizer = cfg.data.tokenizer or cfg.model.huggingface.path
    shared = cfg.data.cache_dir or (cfg.checkpoint.dir and str(Path(cfg.checkpoint.dir) / "tokenized"))
    root = Path(shared or Path(tempfile.gettempdir()) / "sharded-tokenized")
    kind = preference if cfg.objective.type == "dpo" else records
    directory = root / kind.cache_key(cfg.data, tokenizer)
    # On the claim one rank of the job builds it; in a node's temporary directory, one rank per node.
    builder = env.rank == 0 if shared else env.local_rank == 0
    if builder and not records.is_ready(directory):
        began = time.monotonic()
        meta = kind.build_cache(cfg.data, tokenizer, directory)
        emit({"event": "tokenized", "cache": str(directory), **meta, "seconds": round(time.monotonic() - began, 1)})
    deadline = time.monotonic() + TOKENIZE_WAIT_SECONDS
    while not records.is_ready(directory):  # a file wait, not a collective: tokenizing may take long
        if time.monotonic() > deadline:
            raise TimeoutError(f"the tokenized data did not appear in {directory} in {TOKENIZE_WAIT_SECONDS}s")
        time.sleep(0.5)
    source = preference.PreferenceSource if kind is preference else records.RecordSource
    train_rows = source(cfg.data, directory, cfg.seq_len, vocab_size)
    held = None
    if cfg.data.eval_fraction > 0:
        held = source(cfg.data, directory, cfg.seq_len, vocab_size, eval_split=True)
    return train_rows, held


def prepare_reference(cfg: TrainerConfig, env: DistEnv, net: Network, strategy, sources: list) -> None:
    """DPO with a precomputed reference: every record's reference log-probabilities, from the claim or from a
    pass of the model as built (before any checkpoint is loaded into it: the starting weights)."""
    objective = strategy.objective
    if getattr(objective, "reference", None) != "precomputed":
        return
    train_rows = sources[0]
    root = Path(cfg.checkpoint.dir or tempfile.gettempdir()) / "reference"
    directory = root / reference_key(cfg, net, train_rows.directory)
    began = time.monotonic()

    def set_aside(path: Path, reason: str) -> None:  # rank 0
        emit({"event": "reference_set_aside", "path": str(path), "reason": reason})

    logps = precompute_reference(
        objective, strategy.forward_module, train_rows, directory, env, cfg.micro_batch_size, set_aside
    )
    if env.is_main:
        emit({"event": "reference", "records": len(logps), "path": str(directory),
              "seconds": round(time.monotonic() - began, 1)})  # fmt: skip
    for source in sources:
        if source is not None:
            source.reference = logps


def settle_garbage_collector() -> None:
    """Collect once, then move every object alive into the collector's permanent generation.

    Compiled graphs, guards and caches are hundreds of thousands of Python objects that live for the whole
    run; while they sit in the oldest generation, every full collection walks them all and stalls a step
    for 0.4-0.5 s at random (measured on a compiled 1B model: one 10-step window in three lost a fifth of
    its throughput). Frozen, they are never scanned again; objects made later are collected as usual.
    """
    gc.collect()
    gc.freeze()


def evaluate(strategy, source, cfg: TrainerConfig, env: DistEnv) -> dict[str, float]:
    """Over the held-out rows or pairs (at most data.evalSamples), split over the ranks: the mean loss
    (`eval_loss`, weighted by the tokens, or pairs, with a loss) and the objective's own means (DPO's
    `eval_reward_accuracy`, ...). Every rank runs as many forward passes (FSDP gathers parameters
    collectively); a rank past the end runs one whose targets are all ignored."""
    count, micro = min(len(source), cfg.data.eval_samples), cfg.micro_batch_size
    keys, total = None, None
    for first in range(0, count, env.world * micro):
        indices = [first + env.rank * micro + j for j in range(micro)]
        rows = [source.sample(i if i < count else 0) for i in indices]
        batch = collate(rows)
        if all(i >= count for i in indices):
            batch = batch._replace(targets=torch.full_like(batch.targets, IGNORE))
        sums = strategy.eval_loss(batch)
        keys = keys or list(sums)
        part = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        total = part if total is None else total + part
    assert keys is not None and total is not None
    total = total.to(env.device)
    dist.all_reduce(total)
    weight = float(total[keys.index("weight")].clamp(min=1))
    out = {("eval_loss" if k == "loss" else k): float(v) / weight for k, v in zip(keys, total.tolist(), strict=True)}
    out.pop("weight")
    return out


def gpu_memory(env: DistEnv) -> float | None:
    """Bytes of GPU memory this process may use: the device's, or less under SHARDED_UserEnv.GPU_MEMORY_LIMIT (`40Gi`).
    The limit is enforced by the allocator (an allocation past it fails as out of memory, as on a smaller GPU)
    and is what strategy auto plans for: for a GPU shared with other work, or to try a smaller GPU's choice."""
    text, limit = os.environ.get(UserEnv.GPU_MEMORY_LIMIT, "").strip(), None
    if text:  # checked with or without a GPU, so a typo fails in CI as it would on the cluster
        try:
            limit = memory_bytes(text)
        except ValueError:
            raise ConfigError(f"{UserEnv.GPU_MEMORY_LIMIT}={text[:40]!r}: not a memory size; write one such as 40Gi, "
                              "or unset it") from None  # fmt: skip
    if env.device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(env.device).total_memory
    if limit is None:
        return total
    limit = min(limit, total)
    torch.cuda.set_per_process_memory_fraction(limit / total, env.device)
    return limit


def settle_auto(cfg: TrainerConfig, env: DistEnv, gpu: float | None) -> tuple[TrainerConfig, str]:
    """strategy.type auto: every rank settles on the same setting, from the job's smallest GPU, its least host
    memory per process and the strategy of the newest checkpoint (rank 0 lists the claim, as the resume does)."""
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir and cfg.checkpoint.resume and env.is_main else None
    newest = newest_committed(root) if root else None
    # The host memory each process may use: its container's, shared by the node's processes.
    mine = (gpu, autoplan.host_per_process(env.local_world), saved_strategy(newest) if newest else None)
    every: list = [None] * env.world
    dist.all_gather_object(every, mine)
    gpus = [g for g, _, _ in every if g is not None]
    hosts = [h for _, h, _ in every if h is not None]
    return autoplan.settle(cfg, env.world, min(gpus) if gpus else None, every[0][2], min(hosts) if hosts else None)


def train(cfg: TrainerConfig, env: DistEnv, target: ReportTarget | None = None) -> int:
    """Train until cfg.steps or SIGTERM. Rank 0 reports progress and events to `target` (the operator)."""
    stop = StopRequest()
    if env.is_main:  # the process group is up: the rendezvous is over
        emit({"event": "started", "world": env.world})
    # The world that rendezvoused decides the accumulation when the batch is global (an elastic job).
    cfg = with_kept_batch(cfg, env.local_world)
    accum, global_batch = accumulation_for(cfg, env.world)
    cfg = cfg.model_copy(update={"grad_accum_steps": accum})
    chose, gpu = None, gpu_memory(env)
    if cfg.strategy.type == "auto":  # before the model is built: the strategy decides how it is loaded
        cfg, chose = settle_auto(cfg, env, gpu)
        if env.is_main:
            emit({"event": "auto", "strategy": cfg.strategy.model_dump(mode="json", by_alias=True), "why": chose})
    net = build_network(cfg)
    source, held_out = token_source(cfg, env, net.vocab_size)
    strategy = build_strategy(net, cfg, env)
    prepare_reference(cfg, env, net, strategy, [source, held_out])
    loader = ShardedLoader(source, micro_batch=cfg.micro_batch_size, rank=env.rank, world=env.world)
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
        emit({"event": "layout", "strategy": cfg.strategy.type, "layout": strategy.layout,
              **({"attention": net.attention} if net.attention else {})})  # fmt: skip
    ckpt = CheckpointManager(
        cfg.checkpoint, env, cfg.steps, on_commit=report.checkpoint_committed, on_set_aside=set_aside,
        fingerprint=fingerprint(cfg, net),
    )  # fmt: skip
    # What the run settled on (backend `auto` resolved here outside a pod; the world size torchrun made).
    if env.is_main:
        emit(
            {
                "event": "batch",
                "global_batch": global_batch,
                "grad_accum_steps": accum,
                "world": env.world,
                **({"requested": cfg.global_batch_size} if cfg.global_batch_size not in (None, global_batch) else {}),
            }
        )
    report.event(
        TrainerEventType.SETTING_CHOSEN,
        f"{cfg.strategy.type} on {env.world} processes ({strategy.layout}), backend {env.backend} "
        f"on {env.device.type}, {describe_batch(cfg, env.world)}" + (f"; {chose}" if chose else ""),
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
    meter = Meter(net.flops_per_token(cfg.seq_len), env.device, env.world, flops_6n=net.flops_6n(cfg.seq_len))
    board = EventWriter(Path(cfg.checkpoint.dir) / "tensorboard") if cfg.tensorboard and env.is_main else None
    # A preference pair is two rows (chosen, rejected) of seq_len tokens. (MFU counts the training FLOPs of those
    # tokens; the reference's extra forward pass, with LoRA, is not counted.)
    rows = 2 if cfg.objective.type == "dpo" else 1
    tokens_per_step = cfg.micro_batch_size * rows * cfg.grad_accum_steps * cfg.seq_len

    # The stop vote travels over a CPU group so that it never waits for the GPU: steps stay queued.
    stop_group = dist.new_group(backend="gloo")
    last_loss, preempted, first_step, evaluated = None, False, step, False
    try:
        while step < cfg.steps and not preempted:
            began = time.monotonic()
            loss, grad_norm = strategy.train_step([loader.next_batch() for _ in range(cfg.grad_accum_steps)])
            step += 1
            if step == first_step + 2:  # compiled, optimizer state made: what lives for the run exists
                settle_garbage_collector()
            meter.add(tokens_per_step)
            if step % cfg.log_every == 0 or step == cfg.steps:
                last_loss = mean_over_ranks(loss, env)  # the only per-log synchronization
                norm = None if grad_norm is None else float(grad_norm)
                rec = meter.flush(step, last_loss, strategy.current_lr(), norm)
                rec.update(strategy.objective.flush(env.world))
                if cfg.precision == "fp16" and hasattr(strategy, "skipped_steps"):  # overflows under loss scaling
                    rec["skipped_steps"] = strategy.skipped_steps
                if env.is_main:
                    emit(rec)
                if board is not None:
                    board.scalars(step, {k: rec.get(k) for k in BOARD_SCALARS})
                report.update(
                    step=step,
                    loss=rec["loss"],
                    tokens_per_second=rec["tokens_per_s"],
                    mfu=rec["mfu"],
                    mfu_6n=rec["mfu_6n"],
                    **{k: rec[k] for k in DPO_METRICS if k in rec},
                )
            if held_out is not None and (step % (cfg.data.eval_every or cfg.steps) == 0 or step == cfg.steps):
                evaluated_now = evaluate(strategy, held_out, cfg, env)
                if not evaluated:  # its forward-only graphs, compiled once
                    settle_garbage_collector()
                    evaluated = True
                if env.is_main:
                    emit({"event": "eval", "step": step, **{k: round(v, 5) for k, v in evaluated_now.items()}})
                if board is not None:
                    board.scalars(step, evaluated_now)
                report.update(step=step, eval_loss=evaluated_now["eval_loss"])
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
    if cfg.export_on_success and env.is_main and ckpt.last_committed:
        export_at_end(cfg, report, ckpt.last_committed)
    return ExitCode.OK


def export_at_end(cfg: TrainerConfig, report: ProgressReporter, committed: dict) -> None:
    """Rank 0 writes the final checkpoint as a Hugging Face directory (the other ranks are done)."""
    from sharded_trainer.checkpoint.hf_export import export_hf

    out = Path(cfg.checkpoint.dir) / "export"
    written = export_hf(cfg, committed["path"], str(out))
    emit({"event": "exported", "step": committed["step"], "path": str(written)})
    report.event(
        TrainerEventType.EXPORT_WRITTEN, f"exported step {committed['step']} as a Hugging Face directory: {written}",
        step=committed["step"], checkpoint={"step": committed["step"], "path": str(written)},
    )  # fmt: skip
    report.update(step=committed["step"])  # events go out with an update
    report.flush()
