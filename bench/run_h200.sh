#!/usr/bin/env bash
# One device call's worth of benchmarks on 2 GPUs: the project's trainer and the hand-written
# reference, arm for arm, in the same run on the same GPUs. Results go to $OUT/<phase>.txt as
# `ARM <label> RESULT {...}` / `CKPT {...}` lines; bench/summarize.py turns them into tables and a plot.
#   bench/run_h200.sh throughput   # 2 GPUs: FSDP2 and ZeRO-2 at batch 4 eager and compiled, FSDP2 batch 8
#   bench/run_h200.sh rest         # ZeRO-2 batch 8, 1-GPU scaling, memory at batch 1, checkpoint cost
# Needs: the reference scripts in $REF (default .ref/), PYTHONPATH with operator/ and trainer/.
set -uo pipefail
phase="${1:?throughput|rest}"
steps="${STEPS:-20}"
ref="${REF:-.ref}"
out="${OUT:-/tmp/bench-out}/$phase.txt"
mkdir -p "$(dirname "$out")"

arm() {  # arm LABEL NPROC SCRIPT ARGS...
  local label="$1" nproc="$2"
  shift 2
  echo "== $label" >&2
  timeout 420 torchrun --standalone --nproc-per-node "$nproc" "$@" 2>&1 \
    | tee -a "${out%.txt}.log" | grep -E '^(RESULT|CKPT) ' | sed "s/^/ARM $label /" | tee -a "$out"
}

pair() {  # pair LABEL NPROC STRATEGY BATCH [--compile]: the reference arm, then the trainer's
  local ours="$3"
  [ "$3" = fsdp2 ] && ours=fsdp
  arm "ref-$1" "$2" "$ref/reference_fsdp_zero2.py" --strategy "$3" --batch "$4" --steps "$steps" "${@:5}"
  arm "trainer-$1" "$2" bench/bench_trainer.py --strategy "$ours" --batch "$4" --steps "$steps" "${@:5}"
}

if [ "$phase" = throughput ]; then
  pair fsdp2-b4 2 fsdp2 4
  pair fsdp2-b4-compiled 2 fsdp2 4 --compile
  pair fsdp2-b8-compiled 2 fsdp2 8 --compile
  pair zero2-b4 2 zero2 4
  pair zero2-b4-compiled 2 zero2 4 --compile
else
  pair zero2-b8-compiled 2 zero2 8 --compile
  pair fsdp2-b4-compiled-1gpu 1 fsdp2 4 --compile
  arm "trainer-fsdp2-b1-memory" 2 bench/bench_trainer.py --strategy fsdp --batch 1 --steps 12
  arm "trainer-zero2-b1-memory" 2 bench/bench_trainer.py --strategy zero2 --batch 1 --steps 12
  arm "trainer-fsdp2-ckpt" 2 bench/bench_trainer.py --strategy fsdp --ckpt /tmp/bench-ckpt
  arm "trainer-zero2-ckpt" 2 bench/bench_trainer.py --strategy zero2 --ckpt /tmp/bench-ckpt
fi
echo "done: $out" >&2
