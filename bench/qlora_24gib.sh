#!/usr/bin/env bash
# The 8B shape's QLoRA on a 24 GiB GPU: the trainer with strategy.type auto under SHARDED_GPU_MEMORY_LIMIT=24Gi
# (the allocator refuses anything past it, as a 24 GiB card would), LoRA r16 on every linear over an NF4 base,
# batch BATCH x 2048, synthetic tokens. Prints the memory model's plan for that GPU, the `auto` event (what it
# chose and why) and the step lines (tokens/s, peak memory).
#   bash bench/qlora_24gib.sh OUT_FILE        Env: MODEL_DIR (/tmp/llama-8b-hf), BATCH (4), STEPS (20), LIMIT (24Gi)
set -uo pipefail
out="${1:?usage: $0 OUT_FILE}"
dir="${MODEL_DIR:-/tmp/llama-8b-hf}"
batch="${BATCH:-4}"
steps="${STEPS:-20}"
limit="${LIMIT:-24Gi}"
echo "# $(date -u +%FT%TZ) qlora 8b limit=$limit batch=$batch seq=2048 steps=$steps $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$out"
[ -f "$dir/config.json" ] || python bench/hf_load.py make --shape llama-8b --out "$dir" >&2 || exit 1
cat >/tmp/qlora-24gib.yaml <<YAML
model: {huggingface: {path: $dir}}
strategy: {type: auto}
data: {source: synthetic}
lora: {r: 16, alpha: 32, quantizeBase: nf4}
steps: $steps
microBatchSize: $batch
seqLen: 2048
logEvery: 10
YAML
python -m sharded_trainer plan --model "$dir" --nodes 1 --gpus-per-node 1 --gpu-memory "$limit" --micro-batch "$batch" \
  --lora 16 --nf4 2>&1 | tee -a "$out"
SHARDED_GPU_MEMORY_LIMIT="$limit" torchrun --standalone --nproc-per-node 1 -m sharded_trainer --config /tmp/qlora-24gib.yaml \
  2>&1 | grep -E '^METRICS |Error|out of memory' | grep -v '"event": "(started|batch)"' | tee -a "$out"
