"""The trainer's exit codes, shared by the worker entry point and the pod launcher (no torch import)."""

INVALID_CONFIG = 2  # the config failed validation: permanent by default in failurePolicy
RENDEZVOUS_UNREACHABLE = 3  # the startup barrier gave up waiting for the rendezvous endpoint
PREEMPTED = 75  # stopped by SIGTERM after committing a final checkpoint: resume me
