"""Entry point run by torchrun in every pod: `python -m sharded_trainer --config FILE [key=value ...]`.

`python -m sharded_trainer export --config FILE --checkpoint DIR --out PATH [--merge]` consolidates
a checkpoint: a preset's into one safetensors file, a Hugging Face model's into a Hugging Face directory (with
LoRA: the adapter in peft's format, and with --merge the merged model under PATH/merged).
`python -m sharded_trainer plan --model DIR|PRESET --nodes N --gpus-per-node G --gpu-memory 80Gi` prints the
memory model's peak per GPU for each strategy and option, and the fastest setting that fits.
Exit codes (`contract.ExitCode`): 0 done, 2 invalid config (before any process group starts), 75 stopped
by SIGTERM after a final checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from sharded_api.contract import ExitCode
from sharded_api.loading import ConfigError, load_config
from sharded_api.quantity import memory_bytes
from sharded_trainer.agent import name_worker
from sharded_trainer.launch import record_exit
from sharded_trainer.reporting.progress import target_from_env


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sharded_trainer", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="trainer config (YAML or JSON)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. steps=20")
    return p


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sharded_trainer export", description="consolidate a checkpoint")
    p.add_argument("--config", required=True, help="the config the checkpoint was trained with")
    p.add_argument("--checkpoint", required=True, help="a step directory, or the root (newest is used)")
    p.add_argument("--out", required=True, help="output: a .safetensors file (presets), a directory (Hugging Face)")
    p.add_argument("--merge", action="store_true", help="LoRA: also write the adapters merged into the model")
    return p


def _plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sharded_trainer plan", description="peak GPU memory per setting")
    p.add_argument("--model", required=True, help="a Hugging Face model directory or a preset name")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-memory", required=True, help="each GPU's memory, e.g. 80Gi or 141G")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per GPU per step (microBatchSize)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (seqLen)")
    p.add_argument("--lora", type=int, metavar="R", help="LoRA of this rank on every linear layer")
    p.add_argument("--nf4", action="store_true", help="with --lora: an NF4 base (QLoRA)")
    p.add_argument("--compile", action="store_true", help="compiled blocks")
    p.add_argument("--host-memory", help="each node's host memory for the job (the pod's limit), e.g. 128Gi")
    return p


def _plan(argv: list[str]) -> int:
    from sharded_trainer import autoplan, memplan

    a = _plan_parser().parse_args(argv)
    try:
        shape = memplan.load_shape(a.model)
        gpu = memory_bytes(a.gpu_memory)
        host = memory_bytes(a.host_memory) / max(a.gpus_per_node, 1) if a.host_memory else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.INVALID_CONFIG
    if min(a.nodes, a.gpus_per_node, a.micro_batch, a.seq) < 1 or (a.nf4 and not a.lora):
        print("error: --nodes, --gpus-per-node, --micro-batch and --seq must be at least 1; --nf4 needs --lora",
              file=sys.stderr)  # fmt: skip
        return ExitCode.INVALID_CONFIG
    job = memplan.Job(shape, a.nodes * a.gpus_per_node, a.micro_batch, a.seq, a.lora, a.nf4, a.compile)
    print(autoplan.table(job, gpu, host))
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    name_worker()
    return record_exit(_main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
    export = bool(argv) and argv[0] == "export"
    args = _export_parser().parse_args(argv[1:]) if export else _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, None if export else args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.INVALID_CONFIG
    if export:
        from sharded_trainer.checkpoint.export import export_checkpoint

        try:
            out = export_checkpoint(cfg, args.checkpoint, args.out, merge=args.merge)
        except ConfigError as e:  # strategy auto, and the checkpoint does not say which strategy wrote it
            print(f"error: {e}", file=sys.stderr)
            return ExitCode.INVALID_CONFIG
        print(f"wrote {out}")
        return ExitCode.OK

    # torch is imported only now, so a bad config fails in a fraction of a second.
    from sharded_trainer.process_group import init_distributed, shutdown
    from sharded_trainer.train import train

    env = init_distributed(cfg.backend)
    try:
        return train(cfg, env, target_from_env())
    except ConfigError as e:  # the model directory or the records: what the config points at is unusable
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.INVALID_CONFIG
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
