"""Kubernetes operator for ShardedTrainingJob resources."""
