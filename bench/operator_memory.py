"""The operator under tracemalloc: `python bench/operator_memory.py OUT` runs `python -m sharded_operator` and,
on each SIGUSR2, writes where its live Python memory was allocated into OUT (appended): the biggest
allocation sites, and the totals by package. `bench/operator_scale.py --tracemalloc F` runs the operator so
and signals it in each steady state.

The imports are made before tracing starts: what is traced is what the operator allocated since.
tracemalloc sees what Python allocates (objects, buffers), not the interpreter's and libraries' own memory
(code, shared libraries, the allocator's free lists): its total is less than the RSS, and it makes the
operator slower. A run under it measures where the memory is, not how fast anything is.
"""

from __future__ import annotations

import collections
import runpy
import signal
import sys
import time
import tracemalloc

FRAMES = 8
TOP = 40


def where(frame: tracemalloc.Frame) -> str:
    """A frame as `package/module.py:line`, the site-packages or checkout prefix left out."""
    name = frame.filename
    for marker in ("site-packages/", "/operator/", "/trainer/", "/lib/python3"):
        if marker in name:
            name = name.split(marker, 1)[1]
            break
    return f"{name}:{frame.lineno}"


def owner(trace: tracemalloc.Traceback) -> str:
    """Who an allocation is for: the innermost frame of the operator's own code, else the innermost installed
    package (a module's import counts for its package), else the innermost frame."""
    frames = list(reversed(trace))  # innermost first
    for frame in frames:
        if "sharded_operator" in frame.filename:
            return where(frame)
    for frame in frames:
        if "site-packages/" in frame.filename:
            return where(frame).split("/")[0]
    return where(frames[0])


def dump(out: str) -> None:
    snap = tracemalloc.take_snapshot()
    stats = snap.statistics("traceback")
    by_owner: collections.Counter[str] = collections.Counter()
    for stat in stats:
        by_owner[owner(stat.traceback)] += stat.size
    total = sum(s.size for s in stats)
    with open(out, "a") as f:
        f.write(f"# {time.strftime('%H:%M:%S')}: {total / 2**20:.1f} MiB traced\n## by owner\n")
        for name, size in by_owner.most_common(TOP):
            f.write(f"{size / 2**20:8.2f} MiB  {name}\n")
        f.write("## by allocation site (innermost frames)\n")
        for stat in snap.statistics("lineno")[:TOP]:
            f.write(f"{stat.size / 2**20:8.2f} MiB  {stat.count:8d}  {where(stat.traceback[0])}\n")


def main() -> None:
    out = sys.argv.pop(1)
    # Imported untraced: what the imports take is measured without tracemalloc (RSS after importing, in
    # docs/benchmarks.md), and the Kubernetes client's API modules take minutes to import under it.
    import kubernetes.client

    from sharded_operator.run import handlers  # noqa: F401 - its imports, and the handlers kopf will run

    for api in ("CoreV1Api", "CustomObjectsApi", "EventsV1Api", "CoordinationV1Api", "AuthenticationV1Api"):
        getattr(kubernetes.client, api)
    tracemalloc.start(FRAMES)
    signal.signal(signal.SIGUSR2, lambda *_: dump(out))
    sys.argv = ["sharded_operator"]
    runpy.run_module("sharded_operator", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
