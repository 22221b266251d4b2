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
            standalone=not settings.peering,
            peering_name=settings.peering,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
