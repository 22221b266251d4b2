"""Trainer entry whose ranks other than 0 see an older "newest" checkpoint than rank 0 does (as a network
filesystem's attribute cache can show them), and which prints the step each rank loaded."""

from __future__ import annotations

import os
import sys

from sharded_trainer.__main__ import main
from sharded_trainer.checkpoint import manager as checkpoint

RANK = int(os.environ.get("RANK", "0"))
if RANK != 0:
    _listed = checkpoint.committed_steps
    checkpoint.committed_steps = lambda root: _listed(root)[:-1]

_load = checkpoint.CheckpointManager.load_latest


def _load_and_say(self, strategy):
    state = _load(self, strategy)
    print(f"LOADED rank {RANK} step {state['step'] if state else None}", flush=True)
    return state


checkpoint.CheckpointManager.load_latest = _load_and_say
sys.exit(main())
