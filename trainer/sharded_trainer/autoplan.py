"""`strategy.type: auto` made concrete: the memory model (memplan) applied to a trainer config, the GPUs it
runs on and the host memory its node gives each process.

A setting is chosen only when it fits both: the GPU's memory (the device's, or SHARDED_GPU_MEMORY_LIMIT) and
the host's per process (the container's memory limit, or the machine's memory, over the processes of the
node). Offloading moves the optimizer state to the host, so a setting that fits the GPU only by offloading
can still be killed by the host: an 8B-class full fine-tune on one GPU offloads about 184 GiB (the fp32
state and its staging).
When nothing fits both, the job fails before training, naming what to change.
"""

from __future__ import annotations

from pathlib import Path

from sharded_api.config import TrainerConfig
from sharded_api.loading import ConfigError
from sharded_api.objective import reference_kind
from sharded_trainer import memplan
from sharded_trainer.memplan import GIB, HEADROOM, MARGIN, SETTINGS, Job, NotModelled, plan

# A cgroup's "no limit": v2 writes `max`, v1 a number near 2^63.
UNLIMITED = 1 << 60


def job_of(cfg: TrainerConfig, world: int, shape: memplan.Shape | None = None) -> Job:
    """The memory model's view of a trainer config run by `world` processes; the model's shape read from the
    config's model unless given (`sharded plan --model`: a local copy of a claim's config.json)."""
    if shape is None:
        shape = model_shape(cfg)
    lora, dpo = cfg.lora, cfg.objective.type == "dpo"
    reference = reference_kind(cfg.objective.dpo_settings, lora is not None) if dpo else None
    # Compiled blocks keep fewer activations. auto may pick either strategy, so the plan counts them compiled
    # only when both strategies' options compile (bf16-pure is FSDP2's alone: its setting alone counts): a
    # setting it picks is then never short of memory.
    compiled = cfg.strategy.fsdp.compile and (cfg.pure_bf16 or cfg.strategy.zero2.compile)
    return Job(shape, world, cfg.micro_batch_size, cfg.seq_len, lora.r if lora else None,
               bool(lora and lora.quantize_base), compile=compiled, rows=2 if dpo else 1,
               reference_forward=reference in ("adapters", "copy"), reference_copy=reference == "copy",
               precision=cfg.precision, reduce_bf16=cfg.strategy.fsdp.reduce_dtype == "bf16")  # fmt: skip


def model_shape(cfg: TrainerConfig) -> memplan.Shape:
    """The shape of the config's model (a preset, or a Hugging Face directory's config.json)."""
    model = cfg.model.huggingface.path if cfg.model.huggingface else cfg.model.preset
    if model is None:
        raise ConfigError("strategy.type auto needs model.preset or model.huggingface")
    if cfg.model.huggingface and not (Path(model) / "config.json").is_file():
        raise ConfigError(f"model.huggingface.path {model}: no config.json there")
    try:
        shape = memplan.load_shape(model)
    except NotModelled as e:
        raise ConfigError(f"strategy.type auto: {e}; set strategy.type to fsdp or zero2") from None
    except ValueError as e:
        raise ConfigError(f"model.huggingface.path: {e}") from None
    return shape


def host_memory(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> float | None:
    """Bytes of host memory this process's container may use: the least of its memory cgroup's limit (v2
    `memory.max`, v1 `memory.limit_in_bytes`, at the path /proc/self/cgroup names, or the hierarchy's root as
    a container sees it) and the machine's memory; None when neither can be read."""
    found: list[int] = []
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:  # not a cgroup line: nothing to read from it
            continue
        _, controllers, path = fields
        if controllers == "":
            candidates = [cgroups / path.lstrip("/") / "memory.max", cgroups / "memory.max"]
        elif "memory" in controllers.split(","):
            candidates = [cgroups / "memory" / path.lstrip("/") / "memory.limit_in_bytes",
                          cgroups / "memory" / "memory.limit_in_bytes"]  # fmt: skip
        else:
            continue
        for file in candidates:
            try:
                text = file.read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < UNLIMITED:
                found.append(int(text))
            break
    try:
        meminfo = (proc / "meminfo").read_text()
        found.append(int(next(x for x in meminfo.splitlines() if x.startswith("MemTotal:")).split()[1]) * 1024)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    return float(min(found)) if found else None


def settle(
    cfg: TrainerConfig, world: int, gpu_bytes: float | None, kept: str | None = None, host_bytes: float | None = None
) -> tuple[TrainerConfig, str]:
    """strategy.type auto made concrete: the fastest setting that fits in memplan.usable(gpu_bytes) and in host_bytes
    (host memory per process; None: not bounded) (any, the fastest, without a GPU), among those of strategy
    `kept` when a checkpoint of it is to be resumed (FSDP2 and ZeRO-2 checkpoints are not interchangeable) and
    of ZeRO-2 under fp16; the config and why."""
    types = memplan.strategy_types(cfg.precision, kept)
    keeping = f"; the newest checkpoint is {kept}'s" if kept else ""
    if gpu_bytes is None:
        chosen = next(st for st in SETTINGS if st.strategy in types)
        return cfg.model_copy(update={"strategy": chosen.apply(cfg.strategy)}), (
            f"auto: {chosen.label} (no GPU: no memory bound{keeping})"
        )
    job = job_of(cfg, world)
    estimates, chosen = plan(job, gpu_bytes, kept, host_bytes)
    estimates = [e for e in estimates if memplan.allowed(job, e.setting)]
    host = f" and {MARGIN * host_bytes / GIB:.1f} GiB of host memory per process" if host_bytes else ""
    if chosen is None:
        on_gpu = [e for e in estimates if memplan.fits_gpu(e, gpu_bytes)]
        more = ", or use LoRA" if job.lora_r is None else "" if job.nf4 else ", or an NF4 base (lora.quantizeBase)"
        if on_gpu:  # the GPU has room only for settings that offload more than the host holds
            least = min(on_gpu, key=lambda e: e.host)
            need = (f"the least, {least.setting.label}, fits the GPU but needs {least.host / GIB:.1f} GiB of host "
                    "memory per process: raise the pod's memory limit, run fewer processes per node")  # fmt: skip
        else:
            least = min(estimates, key=lambda e: e.peak)
            need = f"the least, {least.setting.label}, needs {least.peak / GIB:.1f} GiB: lower microBatchSize or seqLen"
        raise ConfigError(
            f"strategy.type auto: no setting fits in {memplan.usable(gpu_bytes) / GIB:.1f} GiB ({MARGIN:.0%} of the "
            f"GPU's {gpu_bytes / GIB:.0f} GiB less {HEADROOM / GIB:g} GiB){host} at "
            f"microBatchSize {cfg.micro_batch_size} and seqLen {cfg.seq_len}{keeping} ({need}, or add nodes{more})"
        )  # fmt: skip
    faster = estimates[: estimates.index(chosen)]
    skipped = "".join(
        f", {e.setting.label} would need {e.peak / GIB:.1f}" + ("" if memplan.fits_host(e, host_bytes) else
                                                               f" and {e.host / GIB:.1f} GiB of host")
        for e in faster
    )  # fmt: skip
    return cfg.model_copy(update={"strategy": chosen.setting.apply(cfg.strategy)}), (
        f"auto: {chosen.setting.label}, {chosen.peak / GIB:.1f} GiB predicted per GPU of {gpu_bytes / GIB:.0f} GiB"
        f"{skipped}{keeping}"
    )


def host_per_process(local_world: int) -> float | None:
    """The container's host memory shared by the node's training processes."""
    total = host_memory()
    return total / max(local_world, 1) if total else None


def table(job: Job, gpu_bytes: float, host_bytes: float | None = None) -> str:
    """What `plan` prints: every setting's estimate, whether it fits, and the one chosen."""
    estimates, chosen = plan(job, gpu_bytes, host_bytes=host_bytes)
    s = job.shape
    lines = [
        f"model: {s.params / 1e9:.2f}B parameters ({s.layers} layers, hidden {s.hidden}, vocabulary {s.vocab})"
        + (f", LoRA r{job.lora_r}" + (" on an NF4 base" if job.nf4 else "") if job.lora_r else ", full fine-tuning"),
        f"{job.world} processes, micro-batch {job.micro_batch} x seq {job.seq}"
        + (", compiled" if job.compile else "")
        + (", bf16-pure" if job.pure_bf16 else "")
        + f"; GPU {gpu_bytes / GIB:.0f} GiB, fits under {memplan.usable(gpu_bytes) / GIB:.1f} GiB "
        f"({MARGIN:.0%} less {HEADROOM / GIB:g} GiB)"
        + (f"; host {host_bytes / GIB:.0f} GiB per process" if host_bytes else ""),
        "",
        f"{'setting':<50} {'state':>8} {'activ.':>8} {'transient':>9} {'peak GiB':>9} {'host GiB':>9}  fits",
    ]
    for e in estimates:
        mark = "yes" if memplan.fits_gpu(e, gpu_bytes) else "no"
        mark = mark if memplan.fits_host(e, host_bytes) else "no (host)"
        if not memplan.allowed(job, e.setting):
            mark = "not with bf16-pure" if job.pure_bf16 else "not with NF4"
        mark += "  <- chosen" if e is chosen else ""
        lines.append(f"{e.setting.label:<50} {e.state / GIB:8.1f} {e.activations / GIB:8.1f} "
                     f"{e.transient / GIB:9.1f} {e.peak / GIB:9.1f} {e.host / GIB:9.1f}  {mark}")  # fmt: skip
    if chosen is None and any(memplan.fits_gpu(e, gpu_bytes) and memplan.allowed(job, e.setting) for e in estimates):
        lines.append("\nnothing fits: what fits the GPU offloads more than the host holds; raise the host's memory "
                     "(the pod's limit), add nodes, or use LoRA")  # fmt: skip
    elif chosen is None:
        lines.append("\nnothing fits: lower microBatchSize or seqLen, add nodes, or use LoRA")
    return "\n".join(lines)
