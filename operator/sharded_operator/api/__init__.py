"""The ShardedTrainingJob API: the spec and status models (the CRD's single source), pod-override
policy, CRD generation."""
