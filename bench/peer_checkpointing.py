"""The peer (Hugging Face Trainer, ../shared/bench/peer_hf_trainer.py) run unchanged but with
TrainingArguments(gradient_checkpointing=True), as a Trainer user at long sequence lengths must set it.

    torchrun --standalone --nproc-per-node 1 bench/peer_checkpointing.py PEER_SCRIPT ARGS...
"""

from __future__ import annotations

import runpy
import sys

import transformers

_init = transformers.TrainingArguments.__init__


def _with_checkpointing(self, *args, **kwargs):
    kwargs.setdefault("gradient_checkpointing", True)
    _init(self, *args, **kwargs)


transformers.TrainingArguments.__init__ = _with_checkpointing
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
