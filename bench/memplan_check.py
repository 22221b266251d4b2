"""The memory model (sharded_trainer.memplan) against the peak GPU memory the trainer reached on H200s, from
the runs kept in bench/results: every run of the current loss (run 5 on), the 8B-shape LoRA and QLoRA runs
of both strategies, and the trainer's arms of bench/hf_pairs.sh. Prints a table (markdown) of predicted
against measured peaks; the runs that fitted the model's constants are marked.
tests/unit/test_memplan.py asserts the same comparison.

    .venv/bin/python bench/memplan_check.py > bench/results/memory-model/memplan-check.md
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import hf_pairs

from sharded_trainer import memplan
from sharded_trainer.memplan import GIB, Job, Setting, estimate, load_shape

RESULTS = Path(__file__).resolve().parent / "results"


def result(name: str) -> Path:
    """A results file by its name, in whichever benchmark's folder it lives."""
    found = sorted(RESULTS.rglob(name))
    if len(found) != 1:
        raise FileNotFoundError(f"{name}: {len(found)} files of that name under {RESULTS}")
    return found[0]


def preset_runs() -> list[tuple[str, str, Job, Setting, float]]:
    """(file, arm, job, setting, measured peak GiB) of the trainer's llama-1b runs in bf16. Runs 1-3 are
    left out: their loss held an fp32 copy of the logits when compiled (docs/benchmarks-history.md, run 5)."""
    shape, runs = load_shape("llama-1b"), []
    for path in sorted(RESULTS.rglob("h200*-run*.txt"), key=lambda p: p.name):
        if int(re.search(r"run(\d+)", path.name).group(1)) < 5:
            continue
        for line in path.read_text().splitlines():
            if not line.startswith("ARM ") or " RESULT " not in line:
                continue
            r = json.loads(line.split(" RESULT ", 1)[1])
            if r.get("impl") != "trainer" or r.get("precision", "bf16") != "bf16":
                continue
            options = dict(o.split("=", 1) for o in r.get("options", []))
            # Hybrid sharding on 2 nodes x 1 GPU shards over the node's one process.
            world = 1 if options.get("shard") == "hybrid" else r["world"]
            setting = Setting(
                "fsdp" if r["strategy"] == "fsdp2" else "zero2", reshard=r.get("reshard", True),
                offload="true" in (options.get("cpuOffload"), options.get("cpuOffloadOptimizer")),
                checkpointing=options.get("activationCheckpointing") == "true",
            )  # fmt: skip
            job = Job(shape, world, r["batch"], r["seq"], compile=r["compile"])
            runs.append((path.name, line.split()[1], job, setting, r["peak_alloc_gib"]))
    return runs


def lora_8b_runs() -> list[tuple[str, str, Job, Setting, float]]:
    """bench/qlora.sh on one H200: the 8B shape, micro-batch 2 x 2048, LoRA r16 on every linear."""
    shape, runs = load_shape("llama-8b"), []
    for name, strategy in (("qlora-8b-h200x1.txt", "fsdp"), ("qlora-8b-zero2-h200x1.txt", "zero2")):
        for line in result(name).read_text().splitlines():
            kind, _, record = line.removeprefix(f"{strategy} ").partition(" METRICS ")
            metrics = json.loads(record) if record else {}
            if metrics.get("step") == 20 and "peak_alloc_gib" in metrics:  # the last step's report
                job = Job(shape, 1, 2, 2048, lora_r=16, nf4=kind == "qlora")
                runs.append((name, f"{strategy} {kind}", job, Setting(strategy), metrics["peak_alloc_gib"]))
    return runs


# Arms measured before a change of the trainer that the model follows, with the run that replaced them.
SUPERSEDED_ARMS = {
    # Compiled QLoRA kept every dequantized bf16 weight until backward, until RecomputedNF4Linear.
    ("hf-pairs-8b-compiled-h200x1.txt", "hf-qlora-compiled"): "hf-pairs-8b-qlora-compiled-h100x1.txt",
}


def hf_pairs_runs() -> list[tuple[str, str, Job, Setting, float]]:
    """bench/hf_pairs.sh on one GPU: the trainer's arms (seq 2048, LoRA r16 on every linear), each arm's
    peak as its last step window reported it (not those of SUPERSEDED_ARMS)."""
    runs = []
    paths = [*RESULTS.rglob("hf-pairs-*.txt"), *RESULTS.rglob("unsharded-*.txt"), *RESULTS.rglob("selective-*.txt")]
    for path in sorted(paths, key=lambda p: p.name):
        head = dict(kv.split("=", 1) for kv in path.read_text().splitlines()[0].split() if "=" in kv)
        shape = load_shape({"1b": "llama-1b", "8b": "llama-8b"}[head["shape"]])
        for label, arm in hf_pairs.parse(path).items():
            # An -auto arm's setting is the trainer's choice, not its label's.
            if label.startswith("peer") or "-auto" in label or (path.name, label) in SUPERSEDED_ARMS:
                continue
            lora = "lora" in label
            job = Job(shape, int(head["procs"]), int(head["batch"]), int(head["seq"]), lora_r=16 if lora else None,
                      nf4="qlora" in label, compile="compiled" in label,
                      precision="bf16-pure" if "-pure" in label else "bf16")  # fmt: skip
            setting = Setting("zero2" if "zero2" in label else "fsdp", checkpointing="-gc" in label or "-sac" in label,
                              selective="-sac" in label)  # fmt: skip
            runs.append((path.name, label, job, setting, arm["peak"]))
    return runs


def held_out_runs():
    """The runs whose configuration (model, processes, batch, setting) is none of the fitted runs'."""
    runs = preset_runs() + lora_8b_runs() + hf_pairs_runs()
    fitted = {(job, setting) for name, arm, job, setting, _ in runs if (name, arm) in memplan.FIT_RUNS}
    return [r for r in runs if (r[2], r[3]) not in fitted]


def main() -> None:
    held_out = {(name, arm) for name, arm, *_ in held_out_runs()}
    print("| run | arm | setting | processes | micro-batch x seq | predicted GiB | measured GiB | error |")
    print("| --- | --- | --- | ---: | --- | ---: | ---: | ---: |")
    for name, arm, job, setting, measured in preset_runs() + lora_8b_runs() + hf_pairs_runs():
        predicted = estimate(job, setting).peak / GIB
        what = setting.label + (" compiled" if job.compile else "") + (
            f" LoRA r{job.lora_r}" + (" NF4" if job.nf4 else "") if job.lora_r else "")  # fmt: skip
        mark = "" if (name, arm) in held_out else " (fit)" if (name, arm) in memplan.FIT_RUNS else " (as a fit run)"
        print(
            f"| {name} | {arm}{mark} | {what} | {job.world} | {job.micro_batch} x {job.seq} | {predicted:.2f} | "
            f"{measured:.2f} | {predicted / measured - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
