#!/usr/bin/env bash
# Preference training (DPO) speed: the trainer's objective dpo with LoRA next to TRL's DPOTrainer (the peer,
# bench/dpo_peer_trl.py) on the same model directory and records, one GPU, one call: 8B shape (the llama-8b
# preset's, random bf16 weights), LoRA r16 on every linear layer, beta 0.1, sigmoid loss, the reference the
# base with the adapters off on both sides, PAIRS pairs a step (2 x PAIRS rows of SEQ tokens).
# Output: `ARM <label> METRICS {...}` (the trainer's 10-step windows) and `ARM <label> RESULT {...}` (the peer's
# median step); bench/hf_pairs.py turns them into a table with ratios.
#   bash bench/dpo_pairs.sh OUT_FILE [ARM...]
# Arms: trl (TRL's defaults: gradient checkpointing on), trl-nockpt (off); dpo-lora[-compiled][-ac][-copy]: the
# trainer, eager or with every block compiled, with activation checkpointing (-ac) or without (the trainer's
# default), the reference the adapters turned off or (-copy) a frozen bf16 copy of the base (objective.dpo.reference
# copy: the same numbers for 16 GB more).
# Default: trl trl-nockpt dpo-lora-compiled dpo-lora-compiled-ac.
# Env: PAIRS (2), SEQ (2048), STEPS (30), MODEL_DIR (/tmp/llama-8b-hf), BUDGET_S (560).
set -uo pipefail
out="${1:?usage: $0 OUT_FILE [ARM...]}"
shift
arms=("$@")
[ ${#arms[@]} -gt 0 ] || arms=(trl trl-nockpt dpo-lora-compiled dpo-lora-compiled-ac)
pairs="${PAIRS:-2}"
seq="${SEQ:-2048}"
steps="${STEPS:-30}"
budget="${BUDGET_S:-560}"
dir="${MODEL_DIR:-/tmp/llama-8b-hf}"
records="$dir-pairs.jsonl"
log="${out%.*}.log"
echo "# $(date -u +%FT%TZ) dpo pairs=$pairs seq=$seq steps=$steps $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" | tee -a "$out"
[ -f "$dir/config.json" ] || python bench/hf_load.py make --shape llama-8b --out "$dir" >&2 || exit 1
[ -f "$records" ] || PYTHONPATH="hack:${PYTHONPATH:-}" python bench/dpo_data.py "$dir" "$records" 400 "$seq" || exit 1

arm() {  # arm LABEL COMMAND...: run one arm under the budget, keep its result lines
  local label="$1" start=$SECONDS
  shift
  if ((SECONDS >= budget)); then
    echo "# SKIPPED $label (budget of ${budget}s spent)" | tee -a "$out"
    return
  fi
  local left=$((budget + 30 - SECONDS))
  ((left > 360)) && left=360
  echo "== $label" >&2
  timeout "$left" "$@" 2>&1 | tee -a "$log" | grep -E '^(RESULT|METRICS) |Error' | grep -v '"event"' \
    | sed "s/^/ARM $label /" | tee -a "$out"
  echo "# $label took $((SECONDS - start)) s" | tee -a "$out"
}

for label in "${arms[@]}"; do
  if [[ $label == trl* ]]; then
    checkpointing=checkpointing
    [[ $label == trl-nockpt ]] && checkpointing=none
    arm "$label" python bench/dpo_peer_trl.py "$dir" "$records" "$pairs" "$seq" "$steps" "$checkpointing"
    continue
  fi
  compile=false ac=false reference=auto
  [[ $label == *compiled* ]] && compile=true
  [[ $label == *-ac* ]] && ac=true
  [[ $label == *-copy ]] && reference=copy
  cat >"/tmp/dpo-pairs-$label.yaml" <<YAML
model: {huggingface: {path: $dir}}
data: {source: jsonl, path: $records}
objective: {type: dpo, dpo: {beta: 0.1, reference: $reference}}
lora: {r: 16, alpha: 32}
strategy: {type: fsdp, fsdp: {compile: $compile, activationCheckpointing: $ac}}
optimizer: {lr: 1.0e-5, weightDecay: 0.0}
steps: $steps
microBatchSize: $pairs
seqLen: $seq
logEvery: 10
checkpoint: {dir: /tmp/dpo-pairs-$label-$pairs, interval: 100000, resume: false}
YAML
  arm "$label" torchrun --standalone --nproc-per-node 1 -m sharded_trainer --config "/tmp/dpo-pairs-$label.yaml"
  # The memory model's peak for this arm's config on one process (what `strategy.type: auto` would weigh).
  python - "/tmp/dpo-pairs-$label.yaml" <<'PY' | sed "s/^/ARM $label /" | tee -a "$out"
import dataclasses, json, sys, yaml
from sharded_api.config import TrainerConfig
from sharded_trainer import memplan
cfg = TrainerConfig.model_validate(yaml.safe_load(open(sys.argv[1])))
fsdp = cfg.strategy.fsdp
job = dataclasses.replace(memplan.job_of(cfg, 1), compile=fsdp.compile)
setting = memplan.Setting("fsdp", reshard=fsdp.reshard_after_forward, checkpointing=fsdp.activation_checkpointing)
print("PREDICTED", json.dumps({"peak_gib": round(memplan.estimate(job, setting).peak / 2**30, 2)}))
PY
done
