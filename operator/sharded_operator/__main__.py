"""Run the operator: `python -m sharded_operator` (settings from SHARDED_OPERATOR_* variables)."""

from __future__ import annotations

import asyncio
import sys


def _import_kopf() -> None:
    """Import kopf with the `kubernetes` package hidden. kopf imports it, when it is installed, only to
    recognise its model objects, which the operator never hands to kopf; loading it costs each replica about
    20 MB (transport.py talks to the API server without it)."""
    hidden = "kubernetes" not in sys.modules
    if hidden:
        sys.modules["kubernetes"] = None  # type: ignore[assignment]  # `import kubernetes` fails
    try:
        import kopf

        # kopf's own default registry probes for client libraries to add logins of its own; handlers.login
        # is the operator's.
        kopf.set_default_registry(kopf.OperatorRegistry())
    finally:
        if hidden:
            del sys.modules["kubernetes"]


_import_kopf()
import kopf  # noqa: E402


def main() -> int:
    from sharded_operator.run import handlers  # registers the handlers

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
