"""Peak GPU memory per process for each way of running a job, from the model's shape alone: the memory model
behind `python -m sharded_trainer plan`, `sharded plan` and `strategy.type: auto`. No torch: it runs anywhere,
before anything is loaded.

Peak = max(end of forward, optimizer step), each the sum of what the strategy keeps per process and what the
step adds (bf16 mixed precision, AdamW; B = parameters, W = processes the state is sharded over):

- FSDP2: fp32 parameters 4B/W and Adam's moments 8B/W; the fp32 gradients (4B/W) exist from backward to the
  step, when the activations are gone. Under bf16-pure all three are bf16 (6B/W kept, 2B/W gradients). The
  gathered bf16 copies of the output head and of the block in flight are a transient; with
  reshardAfterForward false every block's stays gathered (2 bytes per block parameter, unsharded).
  cpuOffload keeps all of the state in host memory.
- ZeRO-2: bf16 parameters on every process (2B), fp32 master 4B/W and moments 8B/W; cpuOffloadOptimizer
  moves the last two to the host.
- LoRA: the frozen base in bf16 (sharded under FSDP2, whole under ZeRO-2) or, with an NF4 base, its
  decoder linears at about half a byte each; the adapters (rank r on every linear of the decoder) trained
  as above.
- Activations per token: per block, the tensors a Llama block saves for backward (7 of the hidden width,
  3 of the key/value width, 4 of the MLP width, in bf16) times ACT_SCALE; for the output head and the fp32
  loss, LOGIT_BYTES per vocabulary entry. Activation checkpointing keeps each block's input (selective: also
  its matrix products' and attention's outputs) and recomputes one block at a time. Compiled, a block saves
  COMPILED_BLOCKS of it and the head and loss COMPILED_LOGITS.

Host memory per process: HOST_BASE, plus what offloading moves there (OFFLOAD_HOST_BYTES per trained
parameter, over W).
autoplan.py holds a setting to both, for `strategy.type: auto`.

The four constants were fitted on five runs of the trainer on H200s (FIT_RUNS); tests/unit/test_memplan.py
checks the model against every other run in bench/results, within 10%.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sharded_api.config import PURE_BF16
from sharded_api.presets import PRESETS
from sharded_api.strategy import StrategyConfig, fsdp_unsharded

GIB = 1024**3
ACT_SCALE = 1.013  # measured bytes per token per block over the saved tensors counted (llama-1b)
REFERENCE_LOGIT_BYTES = 6  # per token and vocabulary entry: bf16 logits and their fp32 log-softmax, no gradient
LOGIT_BYTES = 11.3  # per token and vocabulary entry: bf16 logits, their fp32 upcast and its gradient
# Compiled, over eager: a block's saved activations, and the output head's and loss's (the fused loss keeps
# no fp32 copy of the logits). Fitted on a 1.24B and an 8B run, whose shares of logits differ (FIT_RUNS).
COMPILED_BLOCKS = 0.792
COMPILED_LOGITS = 0.336
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4 bits, a 1-byte scale per 64 values, an fp32 one per 256 scales
MAX_SIZE = 1 << 24  # any one dimension of a model (layers, widths, vocabulary): far above any released model
MARGIN = 0.9  # a setting fits when its peak is under this share of the GPU's memory, less HEADROOM
# Memory PyTorch's allocator does not count (the CUDA context, NCCL's buffers) and blocks it cannot reuse when
# held to its limit: QLoRA of the 8B shape predicted at 14.4 GiB (measured 14.7) ran out of memory once in two
# on a 16 GiB limit, where 90% alone had let it fit (bench/results/memory-model/auto-check.md).
HEADROOM = 1.0 * 2**30
# Host memory every training process holds whatever the model: the interpreter, torch, the CUDA context, the
# data pipeline and the loader's buffers (measured after building an 8B model on a GPU: 1.25 GiB resident,
# bench/results/hf-finetuning/hf-load-8b-h200.jsonl; the rest is allowance for pinned staging buffers). The
# loader's own peak is file pages of the mapped safetensors, which the kernel reclaims under a limit.
HOST_BASE = 3.0 * 2**30
# Host bytes per trained parameter (over W) that offloading holds. Fitted on ZeRO-2 with DeepSpeed's CPU Adam,
# the 1.24B shape on one H100: its memory cgroup peaked at 31.3 GiB; a cap of 24 GiB was OOM-killed while 16
# bytes (fp32 master, two moments, the fp32 gradient partition) had predicted 21.4
# (bench/results/memory-model/auto-host-*). The rest is DeepSpeed's pinned staging and the copies it builds the
# partition from. FSDP2's cpuOffload is planned at the same rate (not measured).
OFFLOAD_HOST_BYTES = 24.6
FIT_RUNS = (
    ("h200x2-options-fsdp-run14.txt", "trainer-fsdp2-b4"),
    ("h200x2-eager-run10.txt", "trainer-fsdp2-b8"),
    ("h200x2-options-fsdp-run14.txt", "trainer-fsdp2-b4-actckpt"),
    ("h200-options-1gpu-run15.txt", "trainer-fsdp2-b4-1gpu-compiled"),
    ("hf-pairs-8b-compiled-h200x1.txt", "hf-lora-compiled"),
)


# The decoder families whose blocks the model counts, by config.json's model_type: attention (q, k, v, o; fused
# or not, the same parameters) and an MLP of three linears (gate, up, down) or of two (up, down). Every
# family here is checked against the parameters of the model transformers builds from its config
# (tests/trainer/test_architectures.py). Others, and any config with mixture-of-experts routing, are not
# modelled: `plan` says so, and `strategy.type: auto` asks for a strategy instead of guessing.
GATED_MLP = frozenset({
    "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "olmo3", "granite",
    "internlm3", "cohere", "helium", "smollm3", "seed_oss", "glm", "stablelm", "phi3", "exaone4", "vaultgemma",
})  # fmt: skip
PLAIN_MLP = frozenset({"gpt_neox", "phi", "starcoder2", "nemotron", "persimmon"})
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


class NotModelled(ValueError):
    """The config describes a model whose memory this model does not predict; the message says why."""


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape (the families of GATED_MLP and PLAIN_MLP)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    gated: bool = True  # an MLP of gate, up and down; else of up and down

    @classmethod
    def from_hf_config(cls, config: object) -> Shape:
        """The shape a config.json describes; ValueError naming the field when it is missing or no sane size
        (the file sits on a claim: anything may be in it)."""
        if not isinstance(config, dict):
            raise ValueError("config.json is not a JSON object")
        text = config.get("text_config") or config  # multimodal configs nest the language model's
        if not isinstance(text, dict):
            raise ValueError("config.json: text_config is not a JSON object")

        def size(key: str, default: int | None = None) -> int:
            value = text.get(key) or default
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
                raise ValueError(f"config.json: {key} must be a whole number from 1 to {MAX_SIZE} (got {value!r})")
            return value

        kind = text.get("model_type") or config.get("model_type")
        experts = [k for k in EXPERT_KEYS if isinstance(text.get(k), int) and text[k] > 1]
        if experts:
            raise NotModelled(f"config.json: {kind} routes tokens to experts ({experts[0]} {text[experts[0]]}): "
                              "mixture-of-experts memory is not modelled")  # fmt: skip
        if kind not in GATED_MLP | PLAIN_MLP:
            raise NotModelled(f"config.json: model_type {kind!r} is not modelled (modelled: "
                              f"{', '.join(sorted(GATED_MLP | PLAIN_MLP))})")  # fmt: skip
        hidden, heads = size("hidden_size"), size("num_attention_heads")
        return cls(
            hidden=hidden, layers=size("num_hidden_layers"), heads=heads,
            kv_heads=size("num_key_value_heads", heads), head_dim=size("head_dim", max(hidden // heads, 1)),
            ffn=size("intermediate_size"), vocab=size("vocab_size"),
            tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            gated=kind in GATED_MLP,
        )  # fmt: skip

    @property
    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of each linear layer of a block."""
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.ffn
        return [(h, q), (h, kv), (h, kv), (q, h), *([(h, f)] if self.gated else []), (h, f), (f, h)]

    @property
    def block_linear_params(self) -> int:
        return sum(i * o for i, o in self.linears)

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        blocks = self.layers * (self.block_linear_params + 2 * self.hidden)
        return blocks + self.embedding * (1 if self.tied else 2) + self.hidden

    def lora_params(self, r: int) -> int:
        return self.layers * r * sum(i + o for i, o in self.linears)

    def block_act_bytes(self) -> float:
        """Bytes a block saves for backward per token."""
        kv = self.kv_heads * self.head_dim
        # A plain MLP saves its input to the activation and the activation's output (2 of the MLP width), a
        # gated one also the gate and the product (4); the fit was on gated blocks.
        return ACT_SCALE * 2 * (7 * self.hidden + 3 * kv + (4 if self.gated else 2) * self.ffn)

    def selective_bytes(self, lora_r: int | None = None) -> float:
        """Bytes per token a selectively checkpointed block keeps: its input, every linear's output and
        attention's, in bf16; under LoRA also each adapter's A output (its B is recomputed:
        strategies.parallel._selective_context)."""
        adapters = (lora_r or 0) * len(self.linears)
        return 2 * (self.hidden + sum(o for _, o in self.linears) + self.heads * self.head_dim + adapters)


def load_shape(model: str) -> Shape:
    """A preset's name, or a Hugging Face model directory (its config.json)."""
    config = Path(model) / "config.json"
    if config.is_file():
        try:
            return Shape.from_hf_config(json.loads(config.read_text()))
        except ValueError as e:  # json's own errors are ValueErrors too
            raise (NotModelled if isinstance(e, NotModelled) else ValueError)(f"{config}: {e}") from None
    if model not in PRESETS:
        raise ValueError(f"--model {model}: neither a directory with config.json nor a preset ({', '.join(PRESETS)})")
    a = PRESETS[model]
    return Shape(a.dim, a.n_layers, a.n_heads, a.n_kv_heads or a.n_heads, a.dim // a.n_heads, a.ffn_dim,
                 a.vocab_size, a.tie_embeddings)  # fmt: skip


@dataclass(frozen=True)
class Setting:
    """One way to run: the strategy and the options that move memory."""

    strategy: str  # fsdp | zero2
    reshard: bool = True  # fsdp: reshardAfterForward
    offload: bool = False  # fsdp: cpuOffload; zero2: cpuOffloadOptimizer
    checkpointing: bool = False
    selective: bool = False  # activationCheckpointingPolicy selective rather than full

    @property
    def label(self) -> str:
        parts = [self.strategy]
        if self.strategy == "fsdp" and not self.reshard:
            parts.append("noReshard")
        if self.checkpointing:
            parts.append("activationCheckpointing" + ("(selective)" if self.selective else ""))
        if self.offload:
            parts.append("cpuOffload" if self.strategy == "fsdp" else "cpuOffloadOptimizer")
        return "+".join(parts)

    def apply(self, strategy: StrategyConfig) -> StrategyConfig:
        """`strategy` with this setting's type and options; its other options stay as they were."""
        update = {"activation_checkpointing": self.checkpointing,
                  "activation_checkpointing_policy": "selective" if self.selective else "full"}  # fmt: skip
        if self.strategy == "fsdp":
            update |= {"reshard_after_forward": self.reshard, "cpu_offload": self.offload}
        else:
            update |= {"cpu_offload_optimizer": self.offload}
        options = getattr(strategy, self.strategy).model_copy(update=update)
        return strategy.model_copy(update={"type": self.strategy, self.strategy: options})


# Fastest first, from the H200 runs (docs/benchmarks-history.md): FSDP2 a little ahead of ZeRO-2, checkpointing about
# 0.8x, offload several times slower. Selective checkpointing (between none and full: 8B on one H100, 0.90x of
# none eager against full's 0.87x) is estimated but not yet among auto's choices: those have to be run under
# bench/auto_check.py first, as every choice auto makes has been.
SETTINGS = (
    Setting("fsdp", reshard=False), Setting("fsdp"), Setting("zero2"),
    Setting("fsdp", checkpointing=True), Setting("zero2", checkpointing=True),
    Setting("zero2", checkpointing=True, offload=True), Setting("fsdp", checkpointing=True, offload=True),
)  # fmt: skip


@dataclass(frozen=True)
class Job:
    """What the job trains: the model, the processes the state is sharded over, and the micro-batch."""

    shape: Shape
    world: int
    micro_batch: int
    seq: int
    lora_r: int | None = None
    nf4: bool = False
    compile: bool = False
    # Sequences per sample: 2 for preference pairs (DPO trains a pair's two rows in one forward pass).
    rows: int = 1
    # DPO's reference as a forward pass without gradients (LoRA, adapters off; or a frozen copy), run after the
    # policy's forward while its activations are held: its logits and their fp32 log-softmax add to the peak (a
    # precomputed reference is two numbers per pair).
    reference_forward: bool = False
    # DPO's reference as a frozen copy of the model: its bf16 parameters, sharded as the policy's are.
    reference_copy: bool = False
    # The trainer's precision: under bf16-pure (FSDP2) bf16 parameters and moments, no fp32 master, bf16
    # gradients; the others keep the fp32 master and its state.
    precision: str = "bf16"
    # strategy.fsdp.reduceDtype bf16: FSDP2's gradient reduce buffers in bf16 rather than fp32.
    reduce_bf16: bool = False

    @property
    def pure_bf16(self) -> bool:
        return self.precision == PURE_BF16


@dataclass(frozen=True)
class Estimate:
    setting: Setting
    state: float  # parameters, gradients and optimizer state on the GPU at the step, bytes
    activations: float
    transient: float
    load: float  # the peak while the model is loaded, where it exceeds what the load leaves
    peak: float
    host: float = 0.0  # host memory one process holds at its peak, bytes


def estimate(job: Job, setting: Setting) -> Estimate:
    s, w = job.shape, job.world
    fsdp = setting.strategy == "fsdp"
    if job.lora_r is None:
        trained, frozen = s.params, 0.0
    else:
        trained = s.lora_params(job.lora_r)
        linear = s.layers * s.block_linear_params
        frozen = (linear * NF4_BYTES + (s.params - linear) * 2) if job.nf4 else s.params * 2
        frozen /= w if fsdp else 1  # ZeRO-2 keeps whole parameters on every process
    # Kept across the step: fp32 master (FSDP2's sharded parameters) and Adam's two moments; ZeRO-2 adds
    # the bf16 parameters every process computes with.
    # bf16-pure: the bf16 parameters and bf16 moments, 6 bytes, and bf16 gradients.
    state_bytes, grad_bytes = (6, 2) if job.pure_bf16 else (12, 4)
    kept = 0.0 if setting.offload and fsdp else frozen + (0 if setting.offload else state_bytes * trained / w)
    if not fsdp:
        kept += 2 * trained
    if job.reference_copy and not (setting.offload and fsdp):
        kept += 2 * s.params / (w if fsdp else 1)
    grads = 0.0 if setting.offload else grad_bytes * trained / w
    tokens = job.micro_batch * job.rows * job.seq
    blocks = s.layers * s.block_act_bytes()
    if setting.checkpointing:
        # Each block's input, its matrix products' and attention's outputs when selective, and one block
        # recomputed at a time.
        kept_per_block = s.selective_bytes(job.lora_r) if setting.selective else 2 * s.hidden
        blocks = s.layers * kept_per_block + s.block_act_bytes()
    if job.compile:
        act = tokens * (blocks * COMPILED_BLOCKS + s.vocab * LOGIT_BYTES * COMPILED_LOGITS)
    else:
        act = tokens * (blocks + s.vocab * LOGIT_BYTES)
    # An NF4 weight is dequantized again for the backward pass, compiled too (RecomputedNF4Linear): QLoRA's
    # activations are LoRA's (measured: 8B compiled QLoRA peaks the base weights' difference below LoRA).
    block_bf16 = 2 * (s.block_linear_params + 2 * s.hidden)
    # FSDP2 gathers the output head (or the tied embedding) for the logits, and the blocks in flight; without
    # resharding every block's gathered copy stays until backward. An NF4 weight is dequantized as it is used.
    # One process storing what it computes in runs the model as it is (fsdp_unsharded): nothing gathered or reduced.
    sharded = fsdp and not fsdp_unsharded(w, job.precision, setting.offload)
    transient = 0.0
    if sharded:
        transient = 2 * s.embedding + block_bf16 + (0 if setting.reshard else s.layers * block_bf16)
    elif job.nf4:
        transient = block_bf16
    # ZeRO-2 with an NF4 base: DeepSpeed casts the whole loaded base to bf16 on every process, then each weight
    # is quantized in place; the bf16 weights are freed only once all of them are (measured: bench/hf_load.py).
    load = 0.0
    if job.nf4 and not fsdp:
        load = s.params * 2 + s.layers * s.block_linear_params * NF4_BYTES + 6 * trained
    if job.reference_forward:
        transient += tokens * s.vocab * REFERENCE_LOGIT_BYTES
    # FSDP2 reduces the root's gradients (embeddings, final norm, output head) last, through buffers of the
    # reduce dtype: the bf16 gradients and the reduce input, then the input and the output (its 1/W part, a
    # copy on one process). One process keeps backward's bf16 (measured: 8B bf16-pure on one GPU peaked 7.9 GiB
    # above its state and gradients with fp32 buffers, 8 bytes per root parameter).
    reduce = 0.0
    if sharded and job.lora_r is None and not setting.offload:
        r = 2 if w == 1 or job.reduce_bf16 else 4
        reduce = (s.embedding * (1 if s.tied else 2) + s.hidden) * max(2 + r, r + r / w)
    peak = max(kept + act + transient, kept + grads + transient + reduce, load)
    # Offloaded, the state lives in host memory instead: FSDP2's sharded fp32 parameters, gradients and Adam's
    # moments (and a frozen base's shard); DeepSpeed's CPU Adam the fp32 master, the moments and the fp32
    # gradient partition, with its staging buffers (OFFLOAD_HOST_BYTES).
    host = HOST_BASE
    if setting.offload:
        host += OFFLOAD_HOST_BYTES * trained / w + (frozen if fsdp else 0.0)
        host += 2 * s.params / w if job.reference_copy and fsdp else 0.0
    return Estimate(setting, kept + grads, act, transient, load, peak, host)


def allowed(job: Job, setting: Setting) -> bool:
    """FSDP2 cannot offload an NF4 base to host memory, nor train bf16-pure offloaded (config rules on
    strategy.fsdp.cpuOffload and precision)."""
    return not ((job.nf4 or job.pure_bf16) and setting.strategy == "fsdp" and setting.offload)


def plan(
    job: Job, gpu_bytes: float, kept: str | None = None, host_bytes: float | None = None
) -> tuple[list[Estimate], Estimate | None]:
    """The estimate of every setting of the strategies the job may use (strategy_types), and the fastest allowed
    one that fits (None: none fits): in the GPU's memory and, when `host_bytes` (host memory per process) is
    known, in the host's too."""
    types = strategy_types(job.precision, kept)
    estimates = [estimate(job, st) for st in SETTINGS if st.strategy in types]
    fits = [e for e in estimates if fits_gpu(e, gpu_bytes) and fits_host(e, host_bytes) and allowed(job, e.setting)]
    return estimates, (fits[0] if fits else None)


def fits_gpu(e: Estimate, gpu_bytes: float) -> bool:
    return e.peak <= usable(gpu_bytes)


def fits_host(e: Estimate, host_bytes: float | None) -> bool:
    """Within MARGIN of the host memory per process (the pod's limit, or the node's, over its processes)."""
    return host_bytes is None or e.host <= MARGIN * host_bytes


def strategy_types(precision: str, kept: str | None = None) -> frozenset[str]:
    """The strategies auto may choose: that of a checkpoint to be resumed (FSDP2 and ZeRO-2 checkpoints are
    not interchangeable), only ZeRO-2 under fp16 (FSDP2 has no loss scaler), only FSDP2 under bf16-pure."""
    if kept:
        return frozenset({kept})
    return frozenset({"zero2"} if precision == "fp16" else {"fsdp"} if precision == PURE_BF16 else {"fsdp", "zero2"})


def usable(gpu_bytes: float) -> float:
    """What a setting's predicted peak may reach on a GPU of `gpu_bytes`."""
    return MARGIN * gpu_bytes - HEADROOM
