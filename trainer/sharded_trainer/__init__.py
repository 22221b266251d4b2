"""Trainer run by torchrun in every pod of a ShardedTrainingJob: FSDP2 or DeepSpeed ZeRO-2.

For a script of your own (`spec.command`), `sharded_trainer.report`, `stop_requested`, `exit_stopped` and
`job_config` (from `sharded_trainer.helper`) give it the operator's features; nothing is imported until used.
"""

_HELPERS = ("report", "flush", "stop_requested", "exit_stopped", "job_config", "is_main")


def __getattr__(name: str):
    if name in _HELPERS:
        from sharded_trainer import helper

        return getattr(helper, name)
    raise AttributeError(f"module 'sharded_trainer' has no attribute {name!r}")
