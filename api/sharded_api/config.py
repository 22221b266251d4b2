"""The trainer's configuration: pure pydantic (no torch import), embedded in the CRD by the operator."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from sharded_api.cel import At, Has
from sharded_api.objective import ObjectiveConfig
from sharded_api.rules import Model, Rule
from sharded_api.strategy import PURE_BF16, StrategyConfig


class HuggingFaceModel(Model):
    """A released model in Hugging Face's directory format, trained through transformers' own classes."""

    path: str = Field(
        ..., min_length=1, max_length=4096,
        description="Directory with config.json, safetensors weights (one file or shards with an index) and the "
        "tokenizer files, on a claim or in the image.",
    )  # fmt: skip
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Dtype the parameters are kept in. auto: trained parameters in fp32 (the optimizer's master "
        "copy) and a frozen LoRA base in the compute precision; under ZeRO-2 DeepSpeed keeps its own fp32 master.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow model code shipped in the directory (auto_map); only for directories you trust."
    )
    attention: Literal["auto", "sdpa", "flex_attention", "eager"] = Field(
        "auto",
        description="transformers' attention implementation. auto: torch's SDPA where the architecture supports "
        "it, else transformers' own. flex_attention: torch's FlexAttention, which skips the blocks between "
        "packed records instead of masking them.",
    )


class ModelConfig(Model):
    """Which network to train: a built-in preset or a Hugging Face model directory."""

    rules = (
        Rule(
            "huggingface", "preset and huggingface are exclusive: give one model",
            ~(Has("preset") & Has("huggingface")),
            good=({"preset": "tiny"}, {"huggingface": {"path": "/models/qwen"}, "preset": None}, {}),
            bad=({"preset": "tiny", "huggingface": {"path": "/models/qwen"}},),
        ),
        Rule(
            "vocabSize", "applies to a preset only: a Hugging Face model's vocabulary is its tokenizer's",
            ~(Has("vocabSize") & Has("huggingface")),
            good=({"preset": "tiny", "vocabSize": 512},),
            bad=({"huggingface": {"path": "/models/qwen"}, "vocabSize": 512},),
        ),
    )  # fmt: skip

    preset: Literal["tiny", "llama-125m", "llama-1b", "llama-8b"] | None = Field(
        None,
        description="Llama-style decoder shape, randomly initialised (benchmarks and tests): tiny (the default "
        "when no model is given), llama-125m, llama-1b (dim 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, "
        "vocab 128256, tied embeddings) or llama-8b.",
    )
    huggingface: HuggingFaceModel | None = Field(
        None, description="Fine-tune this Hugging Face causal LM (Llama, Qwen2/3, Mistral, Gemma, ...)."
    )
    vocab_size: int | None = Field(
        None, ge=2, le=1_048_576, description="Override the preset's vocabulary size (must cover the data's tokens)."
    )

    @property
    def preset_name(self) -> str:
        return self.preset or "tiny"


RECORD_SOURCES = ("jsonl", "parquet", "arrow")


class DataConfig(Model):
    """Where training tokens come from."""

    rules = (
        Rule(
            "path", "is required for sources tokens, jsonl, parquet and arrow: give the file or directory",
            At("source").is_in(["tokens", *RECORD_SOURCES]).implies(Has("path")),
            good=({"source": "tokens", "path": "/data/tokens.bin"}, {"source": "synthetic"},
                  {"source": "jsonl", "path": "/data/chat.jsonl", "tokenizer": "/models/qwen"}),
            bad=({"source": "tokens"}, {"source": "parquet"}),
        ),
        Rule(
            "evalEvery", "needs evalFraction above 0: there is nothing to evaluate on",
            Has("evalEvery").implies(At("evalFraction").gt(0)),
            good=({"evalEvery": 10, "evalFraction": 0.05}, {"evalFraction": 0.05}),
            bad=({"evalEvery": 10},),
        ),
    )  # fmt: skip

    source: Literal["synthetic", "learnable", "tokens", "jsonl", "parquet", "arrow"] = Field(
        "learnable",
        description="synthetic: random tokens (throughput benchmarks); learnable: a deterministic sequence task "
        "whose loss must fall (tests, demos); tokens: a pre-tokenized memory-mapped file at `path`; jsonl, "
        "parquet, arrow: records with `text` or chat `messages` at `path` (a file or a directory of them), "
        "tokenized once with the model's tokenizer and chat template.",
    )
    path: str | None = Field(None, max_length=4096, description="The data file or directory (see source).")
    dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of the token file.")
    seed: int = Field(1234, description="Seed of the synthetic generators and of the sampling order.")
    tokenizer: str | None = Field(
        None, max_length=4096,
        description="Tokenizer directory for record sources; default: the Hugging Face model's directory.",
    )  # fmt: skip
    response_only_loss: bool = Field(
        True, description="Chat records: train only on the assistant's tokens (false: on the whole conversation)."
    )
    packing: bool = Field(
        True,
        description="Pack several records into each sequence; each keeps its own positions and attends only to "
        "itself. false: one record per sequence, padded (longer records are cut into pieces either way).",
    )
    cache_dir: str | None = Field(
        None, max_length=4096,
        description="Where the tokenized records are kept, shared by every start and rank; default: "
        "`tokenized/` under checkpoint.dir (on the claim), else a temporary directory on each node.",
    )  # fmt: skip
    eval_fraction: float = Field(
        0.0, ge=0, le=0.5, description="Record sources: this fraction of the records is held out for evaluation."
    )
    eval_every: int | None = Field(
        None, ge=1, le=100_000_000, description="Evaluate the held-out records every this many steps (and at the end)."
    )
    eval_samples: int = Field(
        256, ge=1, le=1_000_000, description="Sequences of the held-out set each evaluation uses at most."
    )
    skip_bad_records: bool = Field(
        False,
        description="Preference records (objective dpo): skip a record that cannot be trained on (a missing or "
        "empty chosen or rejected answer, or both the same) and count it in the `tokenized` event, instead of "
        "failing before training with the record's file and line.",
    )


class LoraConfig(Model):
    """Low-rank adapters (peft's LoRA) on a frozen base model."""

    r: int = Field(16, ge=1, le=4096, description="Adapter rank.")
    alpha: float = Field(32, gt=0, le=1_000_000, description="Scaling numerator: adapters are scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=lambda: ["all-linear"], min_length=1, max_length=64,
        description="Module names (or suffixes) to adapt, e.g. [q_proj, v_proj]; all-linear adapts every linear "
        "layer of the decoder but the output head.",
    )  # fmt: skip
    quantize_base: Literal["nf4"] | None = Field(
        None,
        description="QLoRA: hold the frozen linear weights of the decoder layers in 4-bit NF4 (quantized as they "
        "are read, each process only the rows it keeps; under ZeRO-2 after loading). GPUs only; not with "
        "strategy.fsdp.shard hybrid.",
    )


class OptimizerConfig(Model):
    """AdamW settings."""

    name: Literal["adamw"] = Field(
        "adamw",
        description="Optimizer; AdamW (torch's fused kernel; under precision bf16-pure torchao's, stochastically "
        "rounded).",
    )
    lr: float = Field(3e-4, gt=0, le=1, description="Peak learning rate.")
    weight_decay: float = Field(0.1, ge=0, le=1, description="Decoupled weight decay.")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="Adam beta2.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")


class ScheduleConfig(Model):
    """Learning-rate schedule: linear warmup, then decay to `minLrRatio` of the peak."""

    warmup_steps: int = Field(10, ge=0, description="Steps of linear warmup from 0 to the peak LR.")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="Shape of the decay after warmup.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak.")


_HF_MODEL = {"model": {"huggingface": {"path": "/m"}, "preset": None}}  # rule examples: a Hugging Face model


def _dpo(**settings) -> dict:
    """A rule example: preference training on records with these DPO settings."""
    return {"objective": {"type": "dpo", **({"dpo": settings} if settings else {})},
            "data": {"source": "jsonl", "path": "/pairs.jsonl"}, **_HF_MODEL}  # fmt: skip


class TrainingSpec(Model):
    """What to train and for how long: the part of the trainer config a job's author writes."""

    rules = (
        Rule(
            "data.tokenizer", "record sources (jsonl, parquet, arrow) need a tokenizer: give model.huggingface "
            "or data.tokenizer",
            At("data.source").is_in(list(RECORD_SOURCES)).implies(Has("model.huggingface") | Has("data.tokenizer")),
            good=({"data": {"source": "jsonl", "path": "/d.jsonl"},
                   "model": {"huggingface": {"path": "/m"}, "preset": None}},
                  {"data": {"source": "jsonl", "path": "/d.jsonl", "tokenizer": "/tok"}}),
            bad=({"data": {"source": "jsonl", "path": "/d.jsonl"}},),
        ),
        Rule(
            "objective", "preference training (type dpo) reads preference records: set data.source jsonl, parquet "
            "or arrow and data.path",
            At("objective.type").eq("dpo").implies(At("data.source").is_in(list(RECORD_SOURCES))),
            good=(_dpo(), {"objective": {"type": "sft"}}),
            bad=({"objective": {"type": "dpo"}}, {"objective": {"type": "dpo"}, "data": {"source": "synthetic"}}),
        ),
        Rule(
            "objective.dpo", "applies to objective.type dpo only: set type dpo, or remove dpo",
            Has("objective.dpo").implies(At("objective.type").eq("dpo")),
            good=(_dpo(beta=0.2), _dpo()),
            bad=({"objective": {"type": "sft", "dpo": {"beta": 0.2}}},),
        ),
        Rule(
            "objective.dpo.labelSmoothing", "applies to loss sigmoid only (conservative DPO): set it to 0, or "
            "loss sigmoid",
            At("objective.dpo.labelSmoothing").gt(0).implies(At("objective.dpo.loss").eq("sigmoid")),
            good=(_dpo(labelSmoothing=0.1), _dpo(loss="ipo"), _dpo(loss="hinge", labelSmoothing=0)),
            bad=(_dpo(loss="ipo", labelSmoothing=0.1),),
        ),
        Rule(
            "objective.dpo.reference", "a reference-free loss has no reference to compute: leave reference auto",
            At("objective.dpo.referenceFree").implies(At("objective.dpo.reference").eq("auto")),
            good=(_dpo(referenceFree=True), _dpo(reference="precomputed"), _dpo(reference="copy")),
            bad=(_dpo(referenceFree=True, reference="precomputed"), _dpo(referenceFree=True, reference="copy")),
        ),
        Rule(
            "lora", "adapters as the DPO reference need LoRA: set lora, or objective.dpo.reference precomputed or "
            "copy",
            At("objective.dpo.reference").eq("adapters").implies(Has("lora")),
            good=(
                {**_dpo(reference="adapters"), "lora": {"r": 8}},
                _dpo(reference="precomputed"),
                _dpo(reference="copy"),
            ),
            bad=(_dpo(reference="adapters"),),
        ),
        Rule(
            "lora", "adapters need a Hugging Face model to adapt: set model.huggingface",
            Has("lora").implies(Has("model.huggingface")),
            good=({"lora": {"r": 8}, "model": {"huggingface": {"path": "/m"}, "preset": None}}, {}),
            bad=({"lora": {"r": 8}}, {"lora": {"r": 8}, "model": {"preset": "tiny"}}),
        ),
    )  # fmt: skip

    model: ModelConfig = Field(default_factory=ModelConfig, description="The network.")
    data: DataConfig = Field(default_factory=DataConfig, description="The token source.")
    lora: LoraConfig | None = Field(
        None, description="Train low-rank adapters on a frozen base instead of every weight (Hugging Face models)."
    )
    objective: ObjectiveConfig = Field(
        default_factory=ObjectiveConfig, description="The training objective: next-token (sft) or preference (dpo)."
    )
    steps: int = Field(100, ge=1, le=100_000_000, description="Optimizer steps to train for.")
    micro_batch_size: int = Field(2, ge=1, le=4096, description="Sequences per process per forward pass.")
    grad_accum_steps: int = Field(1, ge=1, le=1024, description="Micro-batches accumulated per optimizer step.")
    global_batch_size: int | None = Field(
        None, ge=1, le=1_048_576,
        description="Sequences per optimizer step over all processes. When set, gradAccumSteps is derived from "
        "the world size at each start, so a job resumed on more or fewer processes keeps its batch (and its loss "
        "curve); when the world does not divide it, the nearest achievable batch is used and the SettingChosen "
        "event says so.",
    )  # fmt: skip
    seq_len: int = Field(128, ge=8, le=131_072, description="Tokens per sequence.")
    precision: Literal["bf16", "fp16", "fp32", "bf16-pure"] = Field(
        "bf16",
        description="Compute dtype. bf16 and fp16 compute in that dtype over fp32 master weights (16 bytes of "
        "state per trained parameter with AdamW); fp32 computes in fp32. bf16-pure keeps the weights, gradients "
        "and AdamW's moments in bf16 (8 bytes per parameter) and rounds each update stochastically (torchao's "
        "AdamW), so that updates smaller than bf16's spacing still move the weights on average: FSDP2 only, full "
        "fine-tuning only. bf16 on CPU falls back to fp32 compute where unsupported.",
    )  # fmt: skip
    grad_clip_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Learning-rate schedule.")
    seed: int = Field(0, description="Seed of parameter initialisation.")
    log_every: int = Field(10, ge=1, description="Emit a metrics line every this many steps.")
    tensorboard: bool = Field(
        False,
        description="Rank 0 also writes TensorBoard event files (loss, lr, grad norm, tokens/s, MFU every logEvery "
        "steps) into tensorboard/ next to the checkpoints.",
    )
    export_on_success: bool = Field(
        False,
        description="Hugging Face models: after the last step, write the model (with LoRA: the adapter) as a "
        "Hugging Face directory under export/ next to the checkpoints; status names its path.",
    )

    @property
    def pure_bf16(self) -> bool:
        return self.precision == PURE_BF16


class CheckpointPolicy(Model):
    """How often the trainer saves, how many it keeps, and whether it resumes."""

    interval: int = Field(50, ge=1, description="Save every this many steps (and at the last step).")
    keep_last: int = Field(3, ge=1, le=1000, description="Complete checkpoints kept; older ones are deleted.")
    async_save: bool = Field(
        False, alias="async", description="FSDP only: write in the background while training continues."
    )
    resume: bool = Field(True, description="Resume from the newest complete checkpoint at start.")


class CheckpointConfig(CheckpointPolicy):
    """The trainer's checkpoint settings: the policy plus the directory to write to."""

    dir: str | None = Field(None, description="Checkpoint root directory; unset disables checkpointing.")


_HF = _HF_MODEL


class TrainerConfig(TrainingSpec):
    """The whole config `python -m sharded_trainer --config FILE` reads."""

    # The job spec holds these fields too (precision under `trainer`) and checks them at admission.
    rules = (
        Rule(
            "precision", "fp16 needs a loss scaler that FSDP2 does not provide: use bf16, or strategy.type zero2",
            At("strategy.type").eq("fsdp").implies(At("precision").ne("fp16")),
            good=({"precision": "fp16", "strategy": {"type": "zero2"}}, {"precision": "bf16"}),
            bad=({"precision": "fp16", "strategy": {"type": "fsdp"}}, {"precision": "fp16"}),
        ),
        Rule(
            "precision", "bf16-pure is full fine-tuning under FSDP2 on the GPU (ZeRO-2 keeps its own fp32 master; "
            "LoRA adapters already train in fp32 over a bf16 base): use strategy.type fsdp or auto, without lora "
            "and strategy.fsdp.cpuOffload, or use precision bf16",
            At("precision").eq(PURE_BF16).implies(
                At("strategy.type").ne("zero2") & ~Has("lora") & At("strategy.fsdp.cpuOffload").ne(True)
            ),
            good=({"precision": "bf16-pure", "strategy": {"type": "auto", "fsdp": {"cpuOffload": False}}},
                  {"precision": "bf16", "lora": {"r": 8}, "strategy": {"type": "zero2"}, **_HF}),
            bad=({"precision": "bf16-pure", "strategy": {"type": "zero2"}},
                 {"precision": "bf16-pure", "lora": {"r": 8}, **_HF},
                 {"precision": "bf16-pure", "strategy": {"fsdp": {"cpuOffload": True}}}),
        ),
        Rule(
            "checkpoint.async", "asynchronous saves are supported for strategy.type fsdp only: set it to false",
            At("checkpoint.async").implies(At("strategy.type").eq("fsdp")),
            good=({"checkpoint": {"async": True}}, {"strategy": {"type": "zero2"}, "checkpoint": {"async": False}}),
            bad=({"checkpoint": {"async": True}, "strategy": {"type": "zero2"}},),
        ),
        Rule(
            "lora.quantizeBase", "an NF4 base is sharded over one dimension of processes: use strategy.fsdp.shard "
            "full (or strategy.type zero2), or remove quantizeBase",
            Has("lora.quantizeBase").implies(At("strategy.type").eq("zero2") | At("strategy.fsdp.shard").eq("full")),
            good=({"lora": {"quantizeBase": "nf4"}, "strategy": {"type": "fsdp"}, **_HF},
                  {"lora": {"quantizeBase": "nf4"}, "strategy": {"type": "zero2"}, **_HF},
                  {"lora": {"r": 8}, "strategy": {"fsdp": {"shard": "hybrid"}}, **_HF}),
            bad=({"lora": {"quantizeBase": "nf4"}, "strategy": {"fsdp": {"shard": "hybrid"}}, **_HF},),
        ),
        Rule(
            "strategy.fsdp.cpuOffload", "FSDP2 cannot offload an NF4 base to host memory: set cpuOffload false (the "
            "NF4 base is a quarter of the bf16 one), use strategy.type zero2 with cpuOffloadOptimizer, or remove "
            "lora.quantizeBase",
            Has("lora.quantizeBase").implies(At("strategy.type").eq("zero2") | At("strategy.fsdp.cpuOffload").ne(True)),
            good=({"lora": {"quantizeBase": "nf4"}, "strategy": {"zero2": {"cpuOffloadOptimizer": True}}, **_HF},
                  {"lora": {"quantizeBase": "nf4"}, "strategy": {"type": "zero2", "fsdp": {"cpuOffload": True}}, **_HF},
                  {"lora": {"r": 8}, "strategy": {"fsdp": {"cpuOffload": True}}, **_HF}),
            bad=({"lora": {"quantizeBase": "nf4"}, "strategy": {"fsdp": {"cpuOffload": True}}, **_HF},),
        ),
        *TrainingSpec.rules,
    )  # fmt: skip

    strategy: StrategyConfig = Field(default_factory=StrategyConfig, description="FSDP2 or ZeRO-2.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="Process-group backend; auto is nccl with GPUs, gloo without."
    )
    batch_nodes: int | None = Field(
        None, ge=1, le=1024,
        description="Set by the operator for an elastic job (elastic.keepGlobalBatch): without globalBatchSize, "
        "the global batch is that of this many nodes at the configured micro-batch and accumulation.",
    )  # fmt: skip
    progress_file: str | None = Field(
        None,
        description="Rank 0 rewrites this JSON file with its latest progress, for local runs and tools; in a pod, "
        "progress reaches the operator over HTTP instead.",
    )

    @model_validator(mode="after")
    def _tensorboard_has_a_place(self) -> TrainerConfig:
        if self.tensorboard and not self.checkpoint.dir:
            raise ValueError("tensorboard needs checkpoint.dir: the event files are written next to the checkpoints")
        if self.export_on_success and not (self.checkpoint.dir and self.model.huggingface):
            raise ValueError(
                "exportOnSuccess needs checkpoint.dir and model.huggingface: the export is a Hugging "
                "Face directory written next to the checkpoints"
            )
        return self
