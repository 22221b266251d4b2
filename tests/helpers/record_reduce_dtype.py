"""Trainer entry that records the dtype of every gradient reduce-scatter FSDP2 issues, one file per rank."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from sharded_trainer.__main__ import main

_reduce_scatter = dist.reduce_scatter_single
_seen: set[str] = set()


def _recording(*args, **kwargs):
    dtype = str(kwargs["input"].dtype)
    if dtype not in _seen:
        _seen.add(dtype)
        with open(f"{os.environ['REDUCE_DTYPES']}.{os.environ['RANK']}", "a") as f:
            f.write(dtype + "\n")
    return _reduce_scatter(*args, **kwargs)


dist.reduce_scatter_single = _recording
sys.exit(main())
