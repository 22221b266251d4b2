"""The job's rendezvous store: torchrun's c10d TCPStore, served from a pod of its own.

Every node's torchrun agent connects to it as a client (`is_host=false`), so no training pod hosts it
and any one of them can die and be replaced while the others wait for it at the next rendezvous round.
Keys are prefixed by the rendezvous id, which changes with every attempt: one store serves them all.

    python -m sharded_trainer.store --port 29400
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from datetime import timedelta

from sharded_trainer.launch import log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sharded_trainer.store", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="TCP port to serve on (every interface)")
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be a TCP port (1-65535)")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    from torch.distributed import TCPStore  # the import takes seconds: after the arguments are checked

    # The server side listens on every interface; the host name only matters to clients. The timeout is
    # the store's per-request wait, which agents bound themselves (read_timeout in their rendezvous conf).
    store = TCPStore("0.0.0.0", args.port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1))
    log(f"rendezvous store serving on port {args.port}")
    stop.wait()
    log("rendezvous store stopping")
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
