#!/usr/bin/env bash
# QLoRA against LoRA over a bf16 base on the llama-8b shape, on the GPUs of one machine, synthetic tokens:
# the trainer's METRICS lines of each (tokens/s, peak GPU memory), then the host memory of each load.
#   bash bench/qlora.sh [MODEL_DIR] [OUT_FILE] [PROCS] [STRATEGY: fsdp|zero2]
set -euo pipefail
dir="${1:-/tmp/llama-8b-hf}"
out="${2:-/tmp/qlora.txt}"
procs="${3:-1}"
strategy="${4:-fsdp}"
[ -f "$dir/config.json" ] || python bench/hf_load.py make --shape llama-8b --out "$dir"
for kind in lora qlora; do
  case $kind in
    lora) lora='{r: 16, alpha: 32}' ;;
    qlora) lora='{r: 16, alpha: 32, quantizeBase: nf4}' ;;
  esac
  cat > "/tmp/$kind.yaml" <<YAML
model: {huggingface: {path: $dir}}
strategy: {type: $strategy}
data: {source: synthetic}
lora: $lora
steps: 20
microBatchSize: 2
seqLen: 2048
logEvery: 5
YAML
  torchrun --nproc-per-node "$procs" -m sharded_trainer --config "/tmp/$kind.yaml" 2>&1 \
    | grep -E "^METRICS|Error" | sed "s/^/$strategy $kind /" | tee -a "$out"
  torchrun --nproc-per-node "$procs" bench/hf_load.py load --model "$dir" --strategy "$strategy" --lora "$kind" 2>&1 \
    | grep -E "^LOAD|Error" | sed "s/^/$strategy $kind /" | tee -a "$out"
done
