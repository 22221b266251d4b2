"""Turn bench/results/*.txt (ARM lines from bench/run_h200.sh) into markdown tables and a plot.

    python bench/summarize.py bench/results/trainer-vs-reference/h200x2-*.txt [--plot docs/benchmarks.png]

Ratios are computed only between arms of the same file (the same run on the same GPUs); an arm run
several times (REPEAT=N in bench/run_h200.sh) is its median, with the range the ratio can take. The plot needs
matplotlib, which the project itself does not depend on.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PSI = 1_235_814_400  # parameters of the llama-1b shape
GIB = 2**30


def parse(path: Path) -> dict[str, dict]:
    """Arms of one run by label. An arm launched several times (REPEAT) reports the median tokens/s
    and MFU of its launches, with `n` and the tokens/s range."""
    samples: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        if line.startswith("ARM "):
            _, label, kind, payload = line.split(" ", 3)
            key = label if kind in ("RESULT", "CKPT") else f"{label}:{kind.lower()}"  # a PROFILE beside a RESULT
            samples.setdefault(key, []).append({"kind": kind, **json.loads(payload)})
    arms = {}
    for key, runs in samples.items():
        arm = {**runs[-1], "n": len(runs)}
        if arm["kind"] == "RESULT":
            tps = [r["tok_s_gpu"] for r in runs]
            arm.update(tok_s_gpu=round(statistics.median(tps)), mfu=statistics.median(r["mfu"] for r in runs))
            arm["tok_s_range"] = (min(tps), max(tps))
        arms[key] = arm
    return arms


def trainer_arms(runs: dict[str, dict[str, dict]]):
    """(run, arm name, trainer result, same-run reference result or None) for each throughput arm."""
    for run, arms in runs.items():
        for label, res in arms.items():
            if label.startswith("trainer-") and res["kind"] == "RESULT" and "memory" not in label:
                name = label.removeprefix("trainer-")
                yield run, name, res, arms.get("ref-" + name)


def spread(res: dict, ref: dict) -> str:
    """For repeated arms: how far the ratio can move within the launches' tokens/s ranges."""
    if res["n"] == 1 and ref["n"] == 1:
        return ""
    (lo, hi), (rlo, rhi) = res["tok_s_range"], ref["tok_s_range"]
    return f" ({lo / rhi:.3f}-{hi / rlo:.3f}, n={res['n']})"


def throughput_table(runs: dict[str, dict[str, dict]]) -> list[str]:
    rows = ["| run | arm | reference tok/s/GPU | trainer tok/s/GPU | ratio | trainer MFU | peak alloc / reserved GiB |",
            "| --- | --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for run, name, res, ref in trainer_arms(runs):
        if ref is not None:  # the others are in trainer_only_table
            rows.append(
                f"| {run} | {name} | {ref['tok_s_gpu']} | {res['tok_s_gpu']} | "
                f"{res['tok_s_gpu'] / ref['tok_s_gpu']:.3f}{spread(res, ref)} | {res['mfu']:.1%} | "
                f"{res['peak_alloc_gib']} / {res['peak_reserved_gib']} |"
            )
    return rows


def trainer_only_table(runs: dict[str, dict[str, dict]]) -> list[str]:
    """Trainer settings with no reference counterpart (candidates for the best setting)."""
    rows = ["| run | arm | trainer tok/s/GPU | trainer MFU | peak alloc / reserved GiB |",
            "| --- | --- | ---: | ---: | --- |"]  # fmt: skip
    for run, name, res, ref in trainer_arms(runs):
        if ref is None:
            rows.append(
                f"| {run} | {name} | {res['tok_s_gpu']} | {res['mfu']:.1%} | "
                f"{res['peak_alloc_gib']} / {res['peak_reserved_gib']} |"
            )
    return rows


def memory_table(arms: dict[str, dict]) -> list[str]:
    rows = ["| strategy (N=2, batch 1) | theory (states only) | measured peak allocated | excess |",
            "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for label, theory in (
        ("trainer-fsdp2-b1-memory", 16 * PSI / 2),
        ("trainer-zero2-b1-memory", 2 * PSI + 14 * PSI / 2),
    ):
        if label in arms:
            got = arms[label]["peak_alloc_gib"] * GIB
            rows.append(
                f"| {label.split('-')[1]} | {theory / GIB:.2f} GiB | {got / GIB:.2f} GiB | {got / theory - 1:+.0%} |"
            )
    return rows


def checkpoint_table(arms: dict[str, dict]) -> list[str]:
    rows = [
        "| strategy | state GB | raw write GB/s | save s | save GB/s | save / raw | first async stall s "
        "| steady async stall s | steady async total s | load s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in arms.values():
        if r["kind"] != "CKPT":
            continue
        rows.append(
            f"| {r['strategy']} | {r['bytes_total'] / 1e9:.1f} | {r['raw_GBps']:.2f} | {r['sync_save_s']:.1f} | "
            f"{r['save_GBps']:.2f} | {r['save_vs_raw']:.0%} | {r.get('async_stall_s', '-')} | "
            f"{r.get('async_steady_stall_s', '-')} | {r.get('async_steady_total_s', '-')} | {r['load_s']:.1f} |"
        )
    return rows


def plot(runs: dict[str, dict[str, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ref_tps, our_tps, ref_mfu, our_mfu = [], [], [], [], []
    for run, name, res, ref in trainer_arms(runs):
        if ref is not None:
            labels.append(f"{name}\n({run})")
            ref_tps.append(ref["tok_s_gpu"])
            our_tps.append(res["tok_s_gpu"])
            ref_mfu.append(ref["mfu"] * 100)
            our_mfu.append(res["mfu"] * 100)
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    x = range(len(labels))
    for ax, ref, ours, title in ((axes[0], ref_tps, our_tps, "tokens/s per GPU"), (axes[1], ref_mfu, our_mfu, "MFU %")):
        ax.bar([i - 0.2 for i in x], ref, 0.4, label="hand-written reference")
        ax.bar([i + 0.2 for i in x], ours, 0.4, label="sharded_trainer")
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0, max(ref_tps + our_tps) * 1.25)  # headroom for the legend above the bars
    axes[0].legend(loc="upper left", ncol=2)
    axes[1].set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
    fig.suptitle("Llama 1.24B, seq 2048, bf16, 2x H200 unless noted (same-run pairs only)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    runs = {f.stem.replace("h200x2-", ""): parse(f) for f in a.files}
    merged = {k: v for arms in runs.values() for k, v in arms.items()}
    print("\n".join(throughput_table(runs)), "\n".join(trainer_only_table(runs)), sep="\n\n")
    print("", "\n".join(memory_table(merged)), "", sep="\n")
    print("\n".join(checkpoint_table(merged)))
    if a.plot:
        plot(runs, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
