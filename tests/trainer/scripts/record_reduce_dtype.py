"""Trainer entry that records the dtype of every gradient reduce-scatter FSDP2 issues, one file per rank."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from sharded_trainer.__main__ import main

_seen: set[str] = set()


def _recording(collective):
    def record(*args, **kwargs):
        dtype = str(kwargs["input"].dtype if "input" in kwargs else args[1].dtype)
        if dtype not in _seen:
            _seen.add(dtype)
            with open(f"{os.environ['REDUCE_DTYPES']}.{os.environ['RANK']}", "a") as f:
                f.write(dtype + "\n")
        return collective(*args, **kwargs)

    return record


# FSDP2 calls the collective through the module attribute; its name differs across torch releases
# (reduce_scatter_tensor in the locked 2.11, reduce_scatter_single later), so wrap whichever exists.
for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
    if hasattr(dist, name):
        setattr(dist, name, _recording(getattr(dist, name)))
sys.exit(main())
