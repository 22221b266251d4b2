#!/usr/bin/env bash
# The trainer's Hugging Face model path against its preset path on the same shape (llama-1b), on the GPUs
# of one machine, synthetic tokens, bf16, eager: the METRICS lines of each (tokens/s, MFU, peak memory).
#   bash bench/hf_vs_preset.sh [MODEL_DIR] [OUT_FILE] [PROCS]
set -euo pipefail
dir="${1:-/tmp/llama-1b-hf}"
out="${2:-/tmp/hf_vs_preset.txt}"
procs="${3:-1}"
[ -f "$dir/config.json" ] || python bench/hf_load.py make --shape llama-1b --out "$dir"
for kind in preset hf hf-lora; do
  case $kind in
    preset) model='{preset: llama-1b}'; extra='' ;;
    hf) model="{huggingface: {path: $dir}}"; extra='' ;;
    hf-lora) model="{huggingface: {path: $dir}}"; extra='lora: {r: 16, alpha: 32}' ;;
  esac
  cat > "/tmp/$kind.yaml" <<EOF
model: $model
data: {source: synthetic}
steps: 30
microBatchSize: 4
seqLen: 2048
logEvery: 10
$extra
EOF
  torchrun --nproc-per-node "$procs" -m sharded_trainer --config "/tmp/$kind.yaml" 2>&1 \
    | grep -E "^METRICS|Error" | sed "s/^/$kind /" | tee -a "$out"
done
