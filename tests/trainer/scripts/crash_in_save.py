"""Trainer entry that dies hard (no cleanup) after writing the shards of step 20 but before committing them."""

from __future__ import annotations

import os
import sys

from sharded_trainer.__main__ import main
from sharded_trainer.checkpoint.manager import CheckpointManager

_commit = CheckpointManager._commit


def _crash_before_commit(self, step, state):
    if step == 20:
        os._exit(13)  # as a SIGKILL or node loss would: nothing after this runs
    return _commit(self, step, state)


CheckpointManager._commit = _crash_before_commit
sys.exit(main())
