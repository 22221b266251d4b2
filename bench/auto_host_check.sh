#!/usr/bin/env bash
# strategy.type auto and host memory, on a GPU machine: each case prints the trainer's `auto` choice (or its
# refusal) and how the run ended.
#   bash bench/auto_host_check.sh OUT
# 1. The 8B shape's full fine-tuning on one GPU with the machine's whole host memory: only the offloading
#    settings fit the GPU, and they offload ~120 GiB of fp32 state (before, auto picked one and the host
#    SIGKILLed the run). Expected: exit 2 before training, naming the host memory.
# 2. The 1.24B shape's full fine-tuning under SHARDED_GPU_MEMORY_LIMIT=12Gi, in a memory cgroup of 16 GiB
#    (refused: offloading needs 21.4 GiB) and of 48 GiB (offloads and trains), where cgroup v2 can be written;
#    the cgroup's measured peak (memory.peak) next to the prediction.
set -uo pipefail
out="${1:?usage: $0 OUT}"
echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); host $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)" | tee "$out"
config() {  # config PRESET STEPS FILE
  cat >"$3" <<YAML
model: {preset: $1}
strategy: {type: auto}
data: {source: synthetic}
steps: $2
microBatchSize: 1
seqLen: 2048
logEvery: 5
YAML
}
case_run() {  # case_run LABEL CONFIG [cgroup]
  local label="$1" cfg="$2" group="${3:-}" start=$SECONDS rc
  echo "== $label" | tee -a "$out"
  if [[ -n $group ]]; then
    # memory.peak counts the page cache too (libraries, the mapped weights); the anonymous memory is what a
    # limit cannot reclaim, so its peak is sampled from memory.stat as well.
    (peak=0; while :; do a=$(awk '$1=="anon"{print $2}' "$group/memory.stat"); ((a > peak)) && peak=$a && echo "$peak" > "/tmp/$label.anon"; sleep 0.2; done) &
    local sampler=$!
    bash -c "echo \$\$ > $group/cgroup.procs; exec torchrun --standalone --nproc-per-node 1 -m sharded_trainer --config $cfg" >"/tmp/$label.log" 2>&1
    rc=$?
    kill $sampler 2>/dev/null
    echo "# $label peak anonymous memory $(awk '{printf "%.2f GiB", $1/2^30}' "/tmp/$label.anon" 2>/dev/null)" | tee -a "$out"
  else
    torchrun --standalone --nproc-per-node 1 -m sharded_trainer --config "$cfg" >"/tmp/$label.log" 2>&1
    rc=$?
  fi
  grep -E '"event": "auto"|strategy.type auto|"step": [0-9]+, "loss"|Killed|SIGKILL|exitcode' "/tmp/$label.log" | cut -c1-700 | tail -6 | tee -a "$out"
  echo "# $label exit $rc after $((SECONDS - start)) s" | tee -a "$out"
  [[ -n $group && -f $group/memory.peak ]] && echo "# $label cgroup memory.peak $(awk '{printf "%.2f GiB", $1/2^30}' "$group/memory.peak")" | tee -a "$out"
}
config llama-8b 5 /tmp/auto-8b-full.yaml
[[ ${CAPS:-} ]] || case_run 8b-full-whole-host /tmp/auto-8b-full.yaml
config llama-1b 10 /tmp/auto-1b-full.yaml
export SHARDED_GPU_MEMORY_LIMIT=12Gi
root=/sys/fs/cgroup
if [[ -f $root/cgroup.controllers ]] && grep -qw memory "$root/cgroup.controllers"; then
  grep -qw memory "$root/cgroup.subtree_control" || echo +memory > "$root/cgroup.subtree_control" 2>/dev/null
  for cap in ${CAPS:-16 48}; do  # GiB; each cap in a fresh cgroup, so its memory.peak is this run's own
    group="$root/auto-host-$cap-$$"
    mkdir "$group" && echo "${cap}G" > "$group/memory.max" && case_run "1b-full-12gi-host$cap" /tmp/auto-1b-full.yaml "$group"
  done
else
  echo "# no writable cgroup v2 memory controller here: the capped cases were not run ($(head -3 /proc/self/cgroup | tr '\n' ' '))" | tee -a "$out"
fi
