"""FSDP2 and DeepSpeed ZeRO-2 behind one training-step interface, each applied to an unchanged model."""
