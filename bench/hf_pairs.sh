#!/usr/bin/env bash
# Fine-tuning speed: the trainer's Hugging Face model path next to Hugging Face Trainer (the peer,
# peer_hf_trainer.py) and next to the trainer's own preset path, on the same GPUs in one call: same shape,
# seq 2048, batch, bf16, synthetic tokens. Output: `ARM <label> METRICS {...}` (the trainer's step lines:
# tokens/s per GPU over each 10 steps, MFU, peak memory) and `ARM <label> RESULT {...}` (the peer's: median
# step after warm-up); every line of every arm also goes to OUT_FILE's .log. bench/hf_pairs.py turns them
# into a table with ratios.
#   bash bench/hf_pairs.sh SHAPE OUT_FILE [ARM...]
# SHAPE: 1b (the llama-1b preset's shape) or 8b. Arms (default: the 1b set below):
#   peer-full peer-lora           Hugging Face Trainer: full fine-tuning (FSDP full shard on several GPUs,
#                                 plain on one), DDP + peft LoRA r16 on all linear layers
#   preset hf hf-lora hf-qlora    the trainer, FSDP2: preset model, Hugging Face model, + LoRA r16, + NF4 base
#   *-zero2 *-compiled            the same under ZeRO-2 / with every block compiled (e.g. hf-lora-zero2-compiled)
#   *-chat                        chat records instead of synthetic tokens: CHAT_DIR's chat.jsonl, tokenized
#                                 once with its tokenizer (bench/chat_data.py) and packed
#   *-flex *-sdpa                 model.huggingface.attention flex_attention / sdpa instead of auto (which
#                                 picks FlexAttention for packed records on a GPU, SDPA otherwise)
#   *-auto                        strategy.type auto (the memory model picks the setting, activation
#                                 checkpointing where it must) instead of FSDP2
#   peer-KIND[-bf16][-gc][-compiled]  the peer (KIND full or lora) loading the model directory in bf16, as a
#                                 user does (full fine-tuning then trains pure bf16 weights; without -bf16 the
#                                 shape is built in fp32 and the Trainer keeps fp32 master weights); with
#                                 TrainingArguments(gradient_checkpointing=True) (bench/peer_checkpointing.py),
#                                 as long sequences and 8B full fine-tuning on one GPU need; with torch_compile=True
#   *-pure                        precision bf16-pure (bf16 weights and moments, stochastically rounded AdamW)
#   *-gc                          the trainer with activation checkpointing (the peer's -gc setting)
#   *-sac                         the trainer with selective activation checkpointing (matrix products and
#                                 attention kept, the element-wise work between them recomputed)
#   *-noclip                      gradClipNorm 0: no gradient clipping, as the peer runs (max_grad_norm=0.0)
# Env: PEER (peer script, default .devwheels/peer_hf_trainer.py), PROCS (GPUs, default 1), BATCH (4),
# STEPS (30), MODEL_DIR (where the shape's Hugging Face directory is written, default /tmp/llama-SHAPE-hf),
# CHAT_DIR (default .benchdata/chat), SEQ (sequence length, default 2048),
# BUDGET_S (default 560: later arms are skipped and named once it is spent).
set -uo pipefail
shape="${1:?usage: $0 1b|8b OUT_FILE [ARM...]}"
out="${2:?usage: $0 1b|8b OUT_FILE [ARM...]}"
shift 2
arms=("$@")
[ ${#arms[@]} -gt 0 ] || arms=(peer-full peer-lora preset hf hf-lora hf-zero2 hf-lora-zero2 preset-compiled
  hf-compiled hf-lora-compiled)
peer="${PEER:-.devwheels/peer_hf_trainer.py}"
procs="${PROCS:-1}"
batch="${BATCH:-4}"
seq="${SEQ:-2048}"
steps="${STEPS:-30}"
budget="${BUDGET_S:-560}"
dir="${MODEL_DIR:-/tmp/llama-$shape-hf}"
chat="$(realpath "${CHAT_DIR:-.benchdata/chat}")"
log="${out%.*}.log"
case $shape in
  1b) preset=llama-1b ;;
  8b) preset=llama-8b ;;
  *) echo "shape: 1b or 8b" >&2; exit 2 ;;
esac
echo "# $(date -u +%FT%TZ) shape=$shape procs=$procs batch=$batch seq=$seq steps=$steps $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$out"

arm() {  # arm LABEL COMMAND...: run one arm under the budget, keep its result lines
  local label="$1" start=$SECONDS
  shift
  if ((SECONDS >= budget)); then
    echo "# SKIPPED $label (budget of ${budget}s spent)" | tee -a "$out"
    return
  fi
  local left=$((budget + 30 - SECONDS))
  ((left > 300)) && left=300
  echo "== $label" >&2
  # Every step line of the trainer (bench/hf_pairs.py takes the median of its windows after the first).
  timeout "$left" "$@" 2>&1 | tee -a "$log" | grep -E '^(RESULT|METRICS) |Error' | grep -v '"event"' \
    | sed "s/^/ARM $label /" | tee -a "$out"
  echo "# $label took $((SECONDS - start)) s" | tee -a "$out"
}

trainer_arm() {  # trainer_arm LABEL: the trainer with the model, adapters, strategy and compile the label names
  local label="$1" model strategy=fsdp compile=false lora="" data="{source: synthetic}" attention=auto
  local precision=bf16 ac=false clip=1.0 policy=full
  [[ $label == *-flex* ]] && attention=flex_attention
  [[ $label == *-sdpa* ]] && attention=sdpa
  model="{huggingface: {path: $dir, attention: $attention}}"
  # The tokenized cache is keyed by the records and the tokenizer: the first chat arm tokenizes, the rest read.
  [[ $label == *-chat* ]] && data="{source: jsonl, path: $chat/chat.jsonl, tokenizer: $chat/tokenizer, cacheDir: /tmp/hf-pairs-tokenized}"
  [[ $label == preset* ]] && model="{preset: $preset}"
  [[ $label == *zero2* ]] && strategy=zero2
  [[ $label == *-auto* ]] && strategy=auto
  [[ $label == *compiled* ]] && compile=true
  [[ $label == *-pure* ]] && precision=bf16-pure
  [[ $label == *-gc* ]] && ac=true
  [[ $label == *-sac* ]] && ac=true policy=selective
  [[ $label == *-noclip* ]] && clip=0
  [[ $label == hf-lora* ]] && lora="lora: {r: 16, alpha: 32}"
  [[ $label == hf-qlora* ]] && lora="lora: {r: 16, alpha: 32, quantizeBase: nf4}"
  if [[ $label != preset* && ! -f $dir/config.json ]]; then
    python bench/hf_load.py make --shape "$preset" --out "$dir" >&2 || return
  fi
  cat >"/tmp/hf-pairs-$label.yaml" <<YAML
model: $model
strategy:
  type: $strategy
  fsdp: {compile: $compile, activationCheckpointing: $ac, activationCheckpointingPolicy: $policy}
  zero2: {compile: $compile, activationCheckpointing: $ac, activationCheckpointingPolicy: $policy}
data: $data
$lora
precision: $precision
gradClipNorm: $clip
steps: $steps
microBatchSize: $batch
seqLen: $seq
logEvery: 10
YAML
  arm "$label" torchrun --standalone --nproc-per-node "$procs" -m sharded_trainer --config "/tmp/hf-pairs-$label.yaml"
}

peer_arm() {  # peer_arm LABEL: the peer script with the mode, model and settings the label names
  local label="$1" run=("$peer") model="$shape" mode=lora-ddp compile=""
  [[ $label == *-gc* ]] && run=(bench/peer_checkpointing.py "$peer")
  [[ $label == *-compiled* ]] && compile=compile
  if [[ $label == *-bf16* ]]; then
    model="$dir"
    [[ -f $dir/config.json ]] || python bench/hf_load.py make --shape "$preset" --out "$dir" >&2 || return
  fi
  if [[ $label == peer-full* ]]; then
    mode=full-ddp
    ((procs > 1)) && mode=full-fsdp
  fi
  arm "$label" torchrun --standalone --nproc-per-node "$procs" "${run[@]}" "$mode" "$batch" "$seq" "$model" $compile
}

for label in "${arms[@]}"; do
  case $label in
    peer-*) peer_arm "$label" ;;
    *) trainer_arm "$label" ;;
  esac
done
