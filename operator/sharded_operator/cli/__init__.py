"""The `sharded` command line (also `kubectl stj`)."""
