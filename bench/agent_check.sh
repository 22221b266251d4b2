#!/usr/bin/env bash
# The trainer's workers forked by the agent's preloading server on a GPU (sharded_trainer.agent): a Hugging Face
# LoRA job must train on CUDA in its forked workers (the server must not have touched CUDA, whose driver state
# does not survive a fork; on a GPU node it leaves transformers, which probes CUDA, to the workers). Prints the
# step lines and the exit code.
#   bash bench/agent_check.sh MODEL_DIR [PROCS]
set -uo pipefail
dir="${1:?usage: $0 MODEL_DIR [PROCS]}"
procs="${2:-1}"
cat >/tmp/agent-check.yaml <<YAML
model: {huggingface: {path: $dir}}
data: {source: synthetic}
lora: {r: 16, alpha: 32}
steps: 20
microBatchSize: 2
seqLen: 1024
logEvery: 10
YAML
python -m sharded_trainer.agent --standalone --nproc-per-node "$procs" --run-path --start-method=forkserver \
  "$(python -c 'from sharded_trainer.agent import WORKER; print(WORKER)')" --config /tmp/agent-check.yaml 2>&1 \
  | grep -E '^METRICS |Error|CUDA' | grep -v '"event": "batch"'
echo "agent exit ${PIPESTATUS[0]}"
