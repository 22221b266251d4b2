#!/usr/bin/env bash
# One device call's worth of benchmarks on 2 GPUs: the project's trainer and the hand-written
# reference, arm for arm, in the same run on the same GPUs. Results go to $OUT/<phase>.txt as
# `ARM <label> RESULT|CKPT|PROFILE {...}` lines; bench/summarize.py turns them into tables and a plot.
#   bench/run_h200.sh explore      # best-setting candidates (profiled), steady async save, memory at batch 1
#   bench/run_h200.sh fsdp         # FSDP2 pairs: batch 4 and 8, eager and compiled
#   bench/run_h200.sh zero2        # ZeRO-2 pairs: batch 4 and 8, eager and compiled; 1-GPU scaling pair
#   bench/run_h200.sh compiled     # every compiled pair, the best setting, the 1-GPU pair
#   bench/run_h200.sh checkpoint   # checkpoint cost: raw write, sync, async, load (FSDP2); DeepSpeed (ZeRO-2)
#   bench/run_h200.sh options-fsdp # each FSDP2 option next to the default at batch 4 (hybrid: 2 "nodes" of 1 GPU)
#   bench/run_h200.sh options-zero2  # each ZeRO-2 option next to the default at batch 4 (fp16: loss scaling)
#   bench/run_h200.sh options-1gpu # the options whose memory or compute acts on one GPU, next to the default
#   bench/run_h200.sh eager        # eager pairs at BATCH (default 4) launched REPEAT times (default 2); FSDP2 profiled
#   bench/run_h200.sh checkpoint fsdp   # several phases in one call, in that order
# REPEAT=N launches each pair N times, swapping which side goes first; summarize.py takes medians.
# Arms run in the order listed; once BUDGET_S seconds (default 540) have passed the rest are skipped
# and named in the output, so a call always returns inside the device tool's limit.
# Needs: the reference scripts in $REF (default .ref/), PYTHONPATH with operator/ and trainer/.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: $0 explore|fsdp|zero2|eager|compiled|checkpoint..." >&2; exit 2; }
steps="${STEPS:-20}"
ref="${REF:-.ref}"
budget="${BUDGET_S:-540}"
profiles="${OUT:-/tmp/bench-out}"
mkdir -p "$profiles"

arm() {  # arm LABEL NPROC SCRIPT ARGS...
  local label="$1" nproc="$2" start=$SECONDS
  shift 2
  if ((SECONDS >= budget)); then
    echo "# SKIPPED $label (budget of ${budget}s spent)" | tee -a "$out"
    return
  fi
  echo "== $label" >&2
  timeout 240 torchrun --standalone --nproc-per-node "$nproc" "$@" 2>&1 \
    | tee -a "${out%.txt}.log" | grep -E '^(RESULT|CKPT|PROFILE) ' | sed "s/^/ARM $label /" | tee -a "$out"
  echo "# $label took $((SECONDS - start)) s" >>"$out"
}

ref_arm() {  # ref_arm LABEL NPROC STRATEGY BATCH [ARGS...]: the hand-written reference
  arm "ref-$1" "$2" "$ref/reference_fsdp_zero2.py" --strategy "$3" --batch "$4" --steps "$steps" "${@:5}"
}

our_arm() {  # our_arm LABEL NPROC STRATEGY BATCH [ARGS...]: the trainer, same arguments (fsdp2 is its fsdp)
  local ours="$3"
  [ "$3" = fsdp2 ] && ours=fsdp
  arm "trainer-$1" "$2" bench/bench_trainer.py --strategy "$ours" --batch "$4" --steps "$steps" "${@:5}"
}

pair() {  # pair LABEL NPROC STRATEGY BATCH [--compile]: the reference arm and the trainer's, REPEAT times
  local i
  for ((i = 0; i < ${REPEAT:-1}; i++)); do
    # Repeats swap the order (reference first, then trainer first, ...): GPUs warm up and drift over a call,
    # and a fixed order would charge all of that drift to the same side.
    if ((i % 2 == 0)); then
      ref_arm "$@"
      our_arm "$@"
    else
      our_arm "$@"
      ref_arm "$@"
    fi
  done
}

profiled() {  # profiled LABEL NPROC SCRIPT ARGS...: one more launch under bench/profile_run.py
  local label="$1" nproc="$2"
  shift 2
  arm "profile-$label" "$nproc" bench/profile_run.py --out "$profiles" --label "$label" "$@"
}

trainer() {  # trainer LABEL ARGS...: a trainer arm with no reference counterpart
  local label="$1"
  shift
  arm "trainer-$label" 2 bench/bench_trainer.py --steps "$steps" "$@"
}

one_gpu() {  # one_gpu LABEL ARGS...: a trainer arm on one GPU (no communication to overlap or shrink)
  local label="$1"
  shift
  arm "trainer-$label" 1 bench/bench_trainer.py --steps "$steps" "$@"
}

two_nodes() {  # two_nodes LABEL ARGS...: the trainer as 2 "nodes" of 1 GPU each (2 agents, c10d on loopback)
  local label="$1" start=$SECONDS r
  shift
  if ((SECONDS >= budget)); then
    echo "# SKIPPED $label (budget of ${budget}s spent)" | tee -a "$out"
    return
  fi
  echo "== $label" >&2
  for r in 0 1; do
    CUDA_VISIBLE_DEVICES=$r timeout 240 torchrun --nnodes 2 --nproc-per-node 1 --node-rank "$r" \
      --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29561 --rdzv-id "$label" \
      bench/bench_trainer.py --steps "$steps" "$@" >"${out%.txt}-$label-$r.log" 2>&1 &
  done
  wait
  grep -hE '^RESULT ' "${out%.txt}-$label-"*.log | sed "s/^/ARM trainer-$label /" | tee -a "$out"
  echo "# $label took $((SECONDS - start)) s" >>"$out"
}

for phase in "$@"; do
out="$profiles/$phase.txt"
case "$phase" in
  explore)
    trainer fsdp2-b8-compiled --strategy fsdp --batch 8 --compile
    trainer fsdp2-b8-compiled-cudnn --strategy fsdp --batch 8 --compile --sdpa cudnn
    trainer fsdp2-b8-compiled-noreshard --strategy fsdp --batch 8 --compile --no-reshard
    trainer fsdp2-b16-compiled-noreshard --strategy fsdp --batch 16 --compile --no-reshard
    profiled trainer-fsdp2-b16-compiled-noreshard 2 bench/bench_trainer.py --steps "$steps" \
      --strategy fsdp --batch 16 --compile --no-reshard
    arm trainer-fsdp2-async-steady 2 bench/bench_trainer.py --strategy fsdp --ckpt /tmp/bench-ckpt --async-only
    trainer fsdp2-b1-memory --strategy fsdp --batch 1 --steps 12
    trainer zero2-b1-memory --strategy zero2 --batch 1 --steps 12
    ;;
  fsdp)
    pair fsdp2-b4 2 fsdp2 4
    pair fsdp2-b4-compiled 2 fsdp2 4 --compile
    pair fsdp2-b8-compiled 2 fsdp2 8 --compile
    pair fsdp2-b8 2 fsdp2 8
    ;;
  zero2)
    pair zero2-b4 2 zero2 4
    pair zero2-b4-compiled 2 zero2 4 --compile
    pair zero2-b8-compiled 2 zero2 8 --compile
    pair zero2-b8 2 zero2 8
    pair fsdp2-b4-compiled-1gpu 1 fsdp2 4 --compile
    ;;
  eager)  # at batch $BATCH (default 4)
    b="${BATCH:-4}"
    REPEAT="${REPEAT:-2}" pair "fsdp2-b$b" 2 fsdp2 "$b"
    REPEAT="${REPEAT:-2}" pair "zero2-b$b" 2 zero2 "$b"
    profiled "ref-fsdp2-b$b" 2 "$ref/reference_fsdp_zero2.py" --strategy fsdp2 --batch "$b" --steps "$steps"
    profiled "trainer-fsdp2-b$b" 2 bench/bench_trainer.py --strategy fsdp --batch "$b" --steps "$steps"
    ;;
  compiled)  # every compiled pair, then the best setting
    pair fsdp2-b4-compiled 2 fsdp2 4 --compile
    pair fsdp2-b8-compiled 2 fsdp2 8 --compile
    pair zero2-b4-compiled 2 zero2 4 --compile
    pair zero2-b8-compiled 2 zero2 8 --compile
    trainer fsdp2-b16-compiled-noreshard --strategy fsdp --batch 16 --compile --no-reshard
    pair fsdp2-b4-compiled-1gpu 1 fsdp2 4 --compile
    ;;
  options-fsdp)
    trainer fsdp2-b4 --strategy fsdp --batch 4
    trainer fsdp2-b4-actckpt --strategy fsdp --batch 4 --option activationCheckpointing=true
    trainer fsdp2-b4-prefetch0 --strategy fsdp --batch 4 --option prefetch=0
    trainer fsdp2-b4-prefetch2 --strategy fsdp --batch 4 --option prefetch=2
    two_nodes fsdp2-b4-2x1-full --strategy fsdp --batch 4
    two_nodes fsdp2-b4-2x1-hybrid --strategy fsdp --batch 4 --option shard=hybrid
    trainer fsdp2-b4-cpuoffload --strategy fsdp --batch 4 --steps 8 --option cpuOffload=true
    ;;
  options-zero2)
    trainer zero2-b4 --strategy zero2 --batch 4
    trainer zero2-b4-actckpt --strategy zero2 --batch 4 --option activationCheckpointing=true
    trainer zero2-b4-fp16 --strategy zero2 --batch 4 --precision fp16
    trainer zero2-b4-offload --strategy zero2 --batch 4 --steps 8 --option cpuOffloadOptimizer=true
    ;;
  options-1gpu)  # memory and compute effects only: a world of 1 reduces nothing over a wire
    one_gpu zero2-b4-1gpu --strategy zero2 --batch 4
    one_gpu zero2-b4-1gpu-nocontiguous --strategy zero2 --batch 4 --option contiguousGradients=false
    one_gpu zero2-b4-1gpu-nooverlap --strategy zero2 --batch 4 --option overlapComm=false
    one_gpu zero2-b4-1gpu-smallbuckets --strategy zero2 --batch 4 --option reduceBucketSize=1000000 \
      --option allgatherBucketSize=1000000
    one_gpu zero2-b4-1gpu-compiled --strategy zero2 --batch 4 --compile
    one_gpu fsdp2-b4-1gpu --strategy fsdp --batch 4
    one_gpu fsdp2-b4-1gpu-noreshard --strategy fsdp --batch 4 --no-reshard
    one_gpu fsdp2-b4-1gpu-reduce-bf16 --strategy fsdp --batch 4 --option reduceDtype=bf16
    one_gpu fsdp2-b4-1gpu-compiled --strategy fsdp --batch 4 --compile
    ;;
  checkpoint)
    arm trainer-fsdp2-ckpt 2 bench/bench_trainer.py --strategy fsdp --ckpt /tmp/bench-ckpt
    arm trainer-zero2-ckpt 2 bench/bench_trainer.py --strategy zero2 --ckpt /tmp/bench-ckpt
    ;;
  *)
    echo "unknown phase $phase" >&2
    exit 2
    ;;
esac
echo "done: $out" >&2
done
