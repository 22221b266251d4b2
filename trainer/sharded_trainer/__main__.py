"""Entry point run by torchrun in every pod: `python -m sharded_trainer --config FILE [key=value ...]`.

`python -m sharded_trainer export --config FILE --checkpoint DIR --out PATH [--merge]` consolidates
a checkpoint: a preset's into one safetensors file, a Hugging Face model's into a Hugging Face directory (with
LoRA: the adapter in peft's format, and with --merge the merged model under PATH/merged).
Exit codes (`contract.ExitCode`): 0 done, 2 invalid config (before any process group starts), 75 stopped
by SIGTERM after a final checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from sharded_trainer.config import ConfigError, load_config
from sharded_trainer.contract import ExitCode
from sharded_trainer.launch import record_exit
from sharded_trainer.reporting import target_from_env


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


def main(argv: list[str] | None = None) -> int:
    return record_exit(_main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    export = bool(argv) and argv[0] == "export"
    args = _export_parser().parse_args(argv[1:]) if export else _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, None if export else args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.INVALID_CONFIG
    if export:
        from sharded_trainer.export import export_checkpoint

        out = export_checkpoint(cfg, args.checkpoint, args.out, merge=args.merge)
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
