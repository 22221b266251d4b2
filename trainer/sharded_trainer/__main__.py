"""Entry point run by torchrun in every pod: `python -m sharded_trainer --config FILE [key=value ...]`.

`python -m sharded_trainer export --config FILE --checkpoint DIR --out model.safetensors` consolidates a
checkpoint into one file. Exit codes: 0 done, 2 invalid config (before any process group starts),
75 stopped by SIGTERM after a final checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys

from sharded_trainer import exitcodes
from sharded_trainer.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sharded_trainer", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="trainer config (YAML or JSON)")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. steps=20")
    return p


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sharded_trainer export", description="consolidate a checkpoint")
    p.add_argument("--config", required=True, help="the config the checkpoint was trained with")
    p.add_argument("--checkpoint", required=True, help="a step directory, or the root (newest is used)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    return p


def _report_target() -> dict:
    """Where rank 0 posts progress: set by the operator in every pod, absent elsewhere."""
    url = os.environ.get("SHARDED_PROGRESS_URL")
    identity = {
        "uid": os.environ.get("SHARDED_JOB_UID", ""),
        "namespace": os.environ.get("SHARDED_JOB_NAMESPACE", ""),
        "name": os.environ.get("SHARDED_JOB_NAME", ""),
        "attempt": int(os.environ.get("SHARDED_ATTEMPT", "0")),
    }
    return {"url": url, "identity": identity} if url and identity["uid"] else {}


def _record_exit(code: int) -> int:
    """Leave this rank's exit code where the pod's launcher reads it (torchrun itself only says 1)."""
    exit_dir = os.environ.get("SHARDED_EXIT_DIR")
    if exit_dir:
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(exit_dir, f"rank-{rank}"), "w") as f:
            f.write(str(code))
    return code


def main(argv: list[str] | None = None) -> int:
    return _record_exit(_main(sys.argv[1:] if argv is None else argv))


def _main(argv: list[str]) -> int:
    export = bool(argv) and argv[0] == "export"
    args = _export_parser().parse_args(argv[1:]) if export else _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, None if export else args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return exitcodes.INVALID_CONFIG
    if export:
        from sharded_trainer.export import export_checkpoint

        out = export_checkpoint(cfg, args.checkpoint, args.out)
        print(f"wrote {out}")
        return 0

    # torch is imported only now, so a bad config fails in a fraction of a second.
    from sharded_trainer.dist import init_distributed, shutdown
    from sharded_trainer.train import train

    env = init_distributed(cfg.backend)
    try:
        return train(cfg, env, _report_target())
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
