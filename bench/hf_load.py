"""Host memory of loading a Hugging Face model: our meta-device build and shard-by-shard reads against
transformers' `from_pretrained`, on a model directory of a preset's shape with random weights.

    python bench/hf_load.py make --shape llama-8b --out DIR          # the directory (bf16 safetensors shards)
    python bench/hf_load.py baseline --model DIR --dtype fp32         # from_pretrained in one process
    torchrun --nproc-per-node N bench/hf_load.py load --model DIR --strategy fsdp|zero2 [--device cpu] [--lora qlora]

`load` builds the network and the strategy exactly as the trainer does (which reads the weights) and prints,
per rank, `LOAD {...}` with the peak resident set (VmHWM) and its anonymous and file-backed parts after the
load: file-backed pages are the safetensors files, mapped and read in place.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path


def memory() -> dict:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = {k: int(status[k].split()[0]) for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile") if k in status}
    out = {k: round(v / 2**20, 2) for k, v in kib.items()}  # GiB
    out["ru_maxrss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return out


def make(shape: str, out: Path) -> None:
    """A Llama directory of a preset's shape with random bf16 weights, written tensor by tensor."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from sharded_trainer.modeling.decoder import PRESETS

    a = PRESETS[shape]
    config = LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.dim, intermediate_size=a.ffn_dim, num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads, rope_theta=a.rope_theta,
        rms_norm_eps=a.norm_eps, tie_word_embeddings=a.tie_embeddings, max_position_embeddings=8192,
        dtype="bfloat16",
    )  # fmt: skip
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shard, size, files, index = {}, 0, [], {}
    names = [(n, p.shape) for n, p in model.named_parameters()]

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        index.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape_ in names:
        if name.endswith("norm.weight"):
            t = torch.ones(shape_, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape_, device=device, dtype=torch.bfloat16) * 0.02).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= 4 * 2**30:
            flush()
    if shard:
        flush()
    total = sum((out / f).stat().st_size for f in files)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": index}))  # fmt: skip
    print(f"wrote {out}: {len(files)} files, {total / 2**30:.1f} GiB", flush=True)


def baseline(model_dir: str, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, {"fp32": "float32"}.get(dtype,
                                                 "bfloat16")))  # fmt: skip
    params = sum(p.numel() for p in model.parameters())
    print("LOAD " + json.dumps({"mode": f"from_pretrained {dtype}", "rank": 0, "world": 1, "params": params,
                                "seconds": round(time.perf_counter() - began, 1), **memory()}), flush=True)  # fmt: skip


def load(model_dir: str, strategy: str, device: str, precision: str, lora: str | None) -> None:
    import torch

    from sharded_api.config import TrainerConfig
    from sharded_trainer.modeling.build import build_network
    from sharded_trainer.modeling.quantize import is_nf4, nf4_bytes
    from sharded_trainer.process_group import init_distributed, shutdown
    from sharded_trainer.strategies.pick import build_strategy

    cfg = TrainerConfig.model_validate({
        "model": {"huggingface": {"path": model_dir}}, "precision": precision, "strategy": {"type": strategy},
        "data": {"source": "synthetic"}, "backend": "gloo" if device == "cpu" else "nccl",
        **({"lora": {"r": 16, "alpha": 32, **({"quantizeBase": "nf4"} if lora == "qlora" else {})}} if lora else {}),
    })  # fmt: skip
    env = init_distributed(cfg.backend)
    began = time.perf_counter()
    net = build_network(cfg)
    built = memory()
    built_s = time.perf_counter() - began
    strat = build_strategy(net, cfg, env)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in strat.model.parameters()]
    kept = nf4_bytes(strat.model) + sum(t.numel() * t.element_size() for t in local if not is_nf4(t))
    rec = {
        "mode": f"{strategy}{' ' + lora if lora else ''} on {env.device.type}", "rank": env.rank,
        "world": env.world, "precision": precision,
        "seconds": round(time.perf_counter() - began, 1), "build_seconds": round(built_s, 1),
        "kept_param_gib": round(kept / 2**30, 2), "after_build": built, **memory(),
    }  # fmt: skip
    if env.device.type == "cuda":
        rec["gpu_allocated_gib"] = round(torch.cuda.max_memory_allocated(env.device) / 2**30, 2)  # peak
        rec["gpu_after_load_gib"] = round(torch.cuda.memory_allocated(env.device) / 2**30, 2)
    print("LOAD " + json.dumps(rec), flush=True)
    del strat, net
    shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--shape", default="llama-8b")
    m.add_argument("--out", required=True)
    b = sub.add_parser("baseline")
    b.add_argument("--model", required=True)
    b.add_argument("--dtype", default="fp32")
    ld = sub.add_parser("load")
    ld.add_argument("--model", required=True)
    ld.add_argument("--strategy", default="fsdp")
    ld.add_argument("--device", default="cuda")
    ld.add_argument("--precision", default="bf16")
    ld.add_argument("--lora", choices=["lora", "qlora"], help="adapters on a frozen base (qlora: an NF4 base)")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.shape, Path(a.out))
    elif a.cmd == "baseline":
        baseline(a.model, a.dtype)
    else:
        if a.device == "cpu":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        load(a.model, a.strategy, a.device, a.precision, a.lora)


if __name__ == "__main__":
    sys.exit(main())
