"""The running operator: kopf handlers, the reconcile loop, API I/O, the web endpoints, the node watch,
leader election."""
