"""Several trainer configs in one torchrun launch, one after another in the same process group: a test covers
a matrix of settings without paying a launch (interpreter, imports, rendezvous) for each. `--config` names a
file listing the configs' paths; rank 0 marks where each run's metrics start."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from sharded_api.loading import load_config
from sharded_trainer.process_group import init_distributed, shutdown
from sharded_trainer.reporting.metrics import emit
from sharded_trainer.train import train


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    paths = Path(parser.parse_args().config).read_text().split()
    configs = [load_config(path, None) for path in paths]  # every config checked before the first run
    env = init_distributed(configs[0].backend)
    try:
        for index, cfg in enumerate(configs):
            # Each run compiles as a fresh process would: Dynamo keeps the graphs of the run before (the same
            # block code) and would reuse them without consulting Inductor's cache.
            torch._dynamo.reset()
            if env.is_main:
                emit({"event": "run", "index": index, "config": paths[index]})
            code = train(cfg, env, None)
            if code:
                return code
        return 0
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
