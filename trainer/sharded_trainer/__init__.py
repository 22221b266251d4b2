"""Trainer run by torchrun in every pod of a ShardedTrainingJob: FSDP2 or DeepSpeed ZeRO-2."""
