"""Helpers the test tiers and the benchmarks share: the job factory, manifests, torchrun launches, the
end-to-end client, the suite clock."""
