"""The API both sides share, pure Python: the operator-trainer contract, the trainer config, its rules and
their CEL, quantities."""
