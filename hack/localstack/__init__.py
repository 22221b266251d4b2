"""The local stack: a control plane built from Go modules, KWOK GPU nodes, a node agent that runs pods as
processes (or containers), the operator as a process, and Kueue; for `make demo` and the test tiers."""
