"""Run the operator: `python -m sharded_operator` (settings from SHARDED_OPERATOR_* variables)."""

from __future__ import annotations

import asyncio
import sys

import kopf


def main() -> int:
    from sharded_operator import handlers  # registers the handlers

    settings = handlers.SETTINGS
    kopf.configure(log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.PLAIN)
    asyncio.run(
        kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=settings.namespaces,
            standalone=True,  # replicas elect the one that acts through a Lease (election.py), not kopf peering
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
