"""Checkpoints on the shared volume: commit markers, durability, writer fencing, and exports."""
