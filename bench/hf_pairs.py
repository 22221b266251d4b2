"""Tables (and a plot) from bench/hf_pairs.sh runs: the trainer's Hugging Face path against Hugging Face
Trainer (the peer) and against the trainer's preset path, ratios only within one run.

    python bench/hf_pairs.py bench/results/hf-finetuning/hf-pairs-*.txt [--plot docs/hf-pairs.png]

The trainer's tokens/s per GPU is the median of its 10-step windows after the first (compilation and
warm-up); the peer's is its own median step after the first third. Each trainer step window comes from
the run's .log beside the .txt (runs whose .txt kept only the last window: the arms in the order the .txt
names them, each trainer launch starting at its `started` event). The peer's MFU counts the FLOPs the
trainer counts for the same model (its MFU per token/s); for LoRA that is 4 FLOPs per frozen and 6 per
trained parameter and token, plus attention. The plot needs matplotlib, which the project does not depend on.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

TOOK = re.compile(r"^# (\S+) took \d+ s$")


def arm_lines_from_log(txt: Path) -> dict[str, list[dict]]:
    """Every result line of each arm, from the run's .log: launches in the order the .txt lists its arms."""
    labels = [m.group(1) for line in txt.read_text().splitlines() if (m := TOOK.match(line))]
    launches: list[list[dict]] = []
    for line in txt.with_suffix(".log").read_text().splitlines():
        if line.startswith("RESULT "):
            launches.append([{"kind": "RESULT", **json.loads(line[7:])}])
        elif line.startswith("METRICS "):
            rec = json.loads(line[8:])
            if rec.get("event") == "started":
                launches.append([])
            elif "event" not in rec:
                launches[-1].append({"kind": "METRICS", **rec})
    if len(launches) != len(labels):
        raise SystemExit(f"{txt}: {len(labels)} arms listed, {len(launches)} launches in its log")
    return dict(zip(labels, launches, strict=True))


def parse(txt: Path) -> dict[str, dict]:
    lines: dict[str, list[dict]] = {}
    for line in txt.read_text().splitlines():
        if line.startswith("ARM ") and (" METRICS {" in line or " RESULT {" in line):
            _, label, kind, payload = line.split(" ", 3)
            lines.setdefault(label, []).append({"kind": kind, **json.loads(payload)})
    if any(len(v) == 1 and v[0]["kind"] == "METRICS" for v in lines.values()) and txt.with_suffix(".log").exists():
        lines = arm_lines_from_log(txt)
    arms = {}
    for label, recs in lines.items():
        if recs[0]["kind"] == "RESULT":
            r = recs[0]
            arms[label] = {"tok_s": r["tok_s_gpu"], "peak": r["peak_alloc_gib"], "windows": 1}
            continue
        after = [r for r in recs if r["step"] > 10] or recs
        arms[label] = {
            "tok_s": round(statistics.median(r["tokens_per_s_per_device"] for r in after)),
            "mfu_per_tok": statistics.median(r["mfu"] / r["tokens_per_s_per_device"] for r in after),
            "peak": max(r["peak_alloc_gib"] for r in recs), "windows": len(after),
            "range": (round(min(r["tokens_per_s_per_device"] for r in after)),
                      round(max(r["tokens_per_s_per_device"] for r in after))),
        }  # fmt: skip
    return arms


def peer_of(label: str, arms: dict, compiled: bool = False) -> str:
    """The peer an arm is compared with: the same kind of training at the same precision (bf16-pure against the
    Trainer that loaded the directory in bf16, mixed precision against the one keeping fp32 master weights),
    the peer with gradient checkpointing where the run has only that one (long sequences, 8B full fine-tuning
    on one GPU); with `compiled`, the peer with torch_compile=True."""
    kind = "peer-lora" if "lora" in label else "peer-full-bf16" if "pure" in label else "peer-full"
    end = "-compiled" if compiled else ""
    return kind + end if kind + end in arms else kind + "-gc" + end


def table(name: str, arms: dict[str, dict]) -> list[str]:
    rows = [f"| {name}: arm | tokens/s per GPU | windows (min-max) | MFU | peak allocated GiB | vs peer "
            "| vs compiled peer | vs preset |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for label, a in arms.items():
        if label.startswith("peer"):
            ours = arms.get("hf-lora" if label.startswith("peer-lora") else "hf") or next(
                (a for k, a in arms.items() if k.startswith("hf-lora" if "lora" in label else "hf")), None
            )
            mfu = f"{a['tok_s'] * ours['mfu_per_tok']:.1%}" if ours else "-"
            peak = a["peak"]
            rows.append(
                f"| {label} (Hugging Face Trainer) | {a['tok_s']:,} | median step | {mfu} | {peak} | 1.00 | - | - |"
            )
            continue
        peer = arms.get(peer_of(label, arms))
        preset = arms.get(label.replace("hf", "preset", 1)) if label.startswith("hf-") or label == "hf" else None
        vs_peer = f"**{a['tok_s'] / peer['tok_s']:.2f}**" if peer and not label.startswith("preset") else "-"
        compiled = arms.get(peer_of(label, arms, compiled=True))
        vs_compiled = f"**{a['tok_s'] / compiled['tok_s']:.2f}**" if compiled else "-"
        vs_preset = f"{a['tok_s'] / preset['tok_s']:.3f}" if preset else "-"
        lo, hi = a["range"]
        rows.append(
            f"| {label} | {a['tok_s']:,} | {a['windows']} ({lo:,}-{hi:,}) | {a['tok_s'] * a['mfu_per_tok']:.1%} | "
            f"{a['peak']} | {vs_peer} | {vs_compiled} | {vs_preset} |"
        )
    return rows


def plot(runs: dict[str, dict[str, dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, (name, arms) in zip(axes[0], runs.items(), strict=True):
        labels = list(arms)
        colors = ["tab:gray" if x.startswith("peer") else "tab:blue" if x.startswith("hf") else "tab:green"
                  for x in labels]  # fmt: skip
        ax.bar(range(len(labels)), [arms[x]["tok_s"] for x in labels], color=colors)
        ax.set_xticks(range(len(labels)), labels, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s per GPU")
        ax.set_title(name, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Hugging Face Trainer (gray), the trainer's Hugging Face path (blue), its preset path (green)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args()
    runs = {f.stem: parse(f) for f in a.files}
    for name, arms in runs.items():
        print("\n".join(table(name, arms)) + "\n")
    if a.plot:
        plot(runs, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
