"""The workload of `operator_scale.py` (its jobs, a raw client's pods, the nodes), its options, and what it
measures with: a timed pod watch, CPU meters, the control plane's Go profiles, latency summaries, the plot."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "hack"), str(ROOT / "tests")]  # the local stack; the job factory

from kubernetes import client  # noqa: E402

from localstack import cluster as localcluster  # noqa: E402
from sharded_operator.api.models import LABEL_JOB, ShardedTrainingJob  # noqa: E402
from sharded_operator.render import podspec, rendezvous  # noqa: E402
from sharded_operator.settings import OperatorSettings  # noqa: E402
from support.jobs import make_job  # noqa: E402

PODS_PER_JOB = 9  # 8 training pods and the rendezvous store pod


def job_body(name: str) -> dict:
    return make_job(name).image("trainer:bench").nodes(8).gpus(1).manifest()


def raw_pods(name: str, namespace: str, service: bool = False) -> list[dict]:
    """The pods the operator creates for job `name` (attempt 1), without the owner reference: no job owns them;
    with `service`, its headless Service first (the pods' DNS names: what the cluster does for each pod that
    a Service selects is part of a job's cost)."""
    body = job_body(name)
    body["metadata"].update(namespace=namespace, uid=f"raw-{name}")
    body["status"] = {"attempt": 1}
    job = ShardedTrainingJob.model_validate(body)
    settings = OperatorSettings()
    pods = [podspec.build_pod(job, i, 1, settings) for i in range(8)] + [podspec.build_store_pod(job, settings)]
    for pod in pods:
        pod["metadata"]["namespace"] = namespace
    return [rendezvous.build_service(job), *pods] if service else pods


def add_nodes(cluster: localcluster.LocalCluster, n: int) -> None:
    print(f"[bench] adding {n} KWOK nodes of 8 GPUs", flush=True)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: cluster.add_gpu_node(f"gpu-node-{i}"), range(n)))

    def ready() -> bool:
        nodes = cluster.api("GET", "/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
        return sum(any(c["type"] == "Ready" and c["status"] == "True" for c in (x.get("status") or {}).get(
            "conditions") or []) for x in nodes) >= n  # fmt: skip

    wait(ready, 600, f"{n} nodes Ready", 2)


class PodWatch:
    """When each pod with a job's name label was first seen, and which pods run, from one watch of the cluster."""

    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)
        self.seen: dict[tuple[str, str], float] = {}
        self.running: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PodWatch:
        self.thread.start()
        return self

    def _run(self) -> None:
        rv = None
        while not self.stop.is_set():
            try:
                rv = self._watch(rv)
            except Exception as e:  # the stream broke (or its version expired): list again, from now
                if self.stop.is_set():
                    return
                print(f"[bench] pod watch restarts: {e!r}", flush=True)
                rv = None
                time.sleep(0.5)

    def _watch(self, rv: str | None) -> str:
        if rv is None:  # pods that exist now are seen now
            listed = self.core.list_pod_for_all_namespaces(label_selector=LABEL_JOB)
            now = time.monotonic()
            with self.lock:
                self.seen = {(p.metadata.namespace, p.metadata.name): self.seen.get(
                    (p.metadata.namespace, p.metadata.name), now) for p in listed.items}  # fmt: skip
                self.running = {(p.metadata.namespace, p.metadata.name) for p in listed.items
                                if p.status.phase == "Running"}  # fmt: skip
            rv = listed.metadata.resource_version
        while not self.stop.is_set():
            resp = self.core.list_pod_for_all_namespaces(
                label_selector=LABEL_JOB, watch=True, resource_version=rv, timeout_seconds=60,
                allow_watch_bookmarks=True, _preload_content=False,
            )  # fmt: skip
            pending = b""
            for chunk in resp.stream(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                now = time.monotonic()
                for line in lines:
                    event = json.loads(line)
                    meta = event["object"]["metadata"]
                    rv = meta.get("resourceVersion", rv)
                    if event["type"] == "BOOKMARK":
                        continue
                    key = (meta["namespace"], meta["name"])
                    with self.lock:
                        if event["type"] == "DELETED":
                            self.seen.pop(key, None)
                            self.running.discard(key)
                            continue
                        self.seen.setdefault(key, now)
                        if (event["object"].get("status") or {}).get("phase") == "Running":
                            self.running.add(key)
                        else:
                            self.running.discard(key)
        return rv

    def count(self, namespace: str) -> tuple[int, int]:
        with self.lock:
            return (sum(ns == namespace for ns, _ in self.seen), sum(ns == namespace for ns, _ in self.running))

    def times(self, namespace: str) -> dict[str, float]:
        with self.lock:
            return {name: t for (ns, name), t in self.seen.items() if ns == namespace}


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / tick, sum(values) / tick


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait(predicate, timeout: float, what: str, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise TimeoutError(f"{what} not within {timeout:.0f}s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def job_latencies(submitted: dict[str, float], seen: dict[str, float]) -> list[float]:
    """Per job: submit -> the last of its pods seen (pods are named <job>-<index> and <job>-rdzv)."""
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    for pod, t in seen.items():
        job = pod.rsplit("-", 1)[0]
        last[job], count[job] = max(last.get(job, 0.0), t), count.get(job, 0) + 1
    return [last[j] - t0 for j, t0 in submitted.items() if count.get(j) == PODS_PER_JOB]


def summary(arm: str, submitted: dict[str, float], seen: dict[str, float], cpu: dict | None = None) -> dict:
    lat = job_latencies(submitted, seen)
    span = max(seen.values()) - min(submitted.values())
    out = {
        "arm": arm, "jobs": len(submitted), "pods": len(seen), "seconds": round(span, 2),
        "pods_per_s": round(len(seen) / span, 1),
        "submit_to_all_pods_p50_s": round(percentile(lat, 0.5), 3),
        "submit_to_all_pods_p99_s": round(percentile(lat, 0.99), 3),
        "cpu_seconds": cpu or {},
    }  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def py_spy_top(raw: str, lines: int = 60) -> str:
    """py-spy's raw (collapsed) stacks summed per function: the share of samples with it on the stack
    (cumulative) and as the innermost frame (self), highest first."""
    cum: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        names = [f.split(":")[0] + ")" if " (" in f else f for f in frames]  # the function, not the line
        for name in set(names):
            cum[name] = cum.get(name, 0) + n
        own[names[-1]] = own.get(names[-1], 0) + n
    out = [f"{total} samples", "", "cumulative %  function (file)"]
    for title, counts in (("", cum), ("self %  function (file)", own)):
        if title:
            out += ["", title]
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:lines]
        out += [f"{100 * v / max(total, 1):6.1f}  {k}" for k, v in top]
    return "\n".join(out) + "\n"


class GoProfiles:
    """With --profile, CPU profiles of the control plane's Go processes over an arm: pprof's
    /debug/pprof/profile on each one's HTTPS port, as the cluster's admin, in back-to-back windows of
    `WINDOW` seconds while the arm runs (the last one runs up to a window past its end). `stop()` writes
    `go tool pprof -top` of each process's windows, flat and cumulative, to `<arm>-<process>.txt`."""

    WINDOW = 10
    NAMES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager")

    def __init__(self, cluster: localcluster.LocalCluster, out: Path, arm: str):
        self.cluster, self.out, self.arm = cluster, out, arm
        self.done = threading.Event()
        self.files: dict[str, list[Path]] = {name: [] for name in self.NAMES}
        self.tls = cluster.admin_tls()
        # The scheduler and controller-manager serve a certificate they made themselves, for themselves.
        self.tls.check_hostname, self.tls.verify_mode = False, ssl.CERT_NONE
        self.threads = [threading.Thread(target=self._loop, args=(n,), daemon=True) for n in self.NAMES]
        for t in self.threads:
            t.start()

    def _loop(self, name: str) -> None:
        url = f"https://{localcluster.HOST}:{self.cluster.secure_port(name)}/debug/pprof/profile?seconds={self.WINDOW}"
        while not self.done.is_set():
            path = self.out / f"{self.arm}-{name}-{len(self.files[name]):03d}.pb.gz"
            try:
                with urllib.request.urlopen(url, context=self.tls, timeout=self.WINDOW + 30) as resp:
                    path.write_bytes(resp.read())
                self.files[name].append(path)
            except OSError as e:
                print(f"[bench] {name}'s profile: {e}", flush=True)
                self.done.wait(self.WINDOW)

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(self.WINDOW + 40)
        go = shutil.which("go")
        for name, files in self.files.items():
            if not (go and files):
                print(f"[bench] no {name} profile summary (go on PATH: {bool(go)}, windows: {len(files)})")
                continue
            views = [subprocess.run([go, "tool", "pprof", "-top", *cum, "-nodecount=40", *map(str, files)],
                                    capture_output=True, text=True).stdout for cum in ([], ["-cum"])]  # fmt: skip
            (self.out / f"{self.arm}-{name}.txt").write_text("\n".join(views))


class CpuMeter:
    """CPU seconds used by each process of the stack (and the machine's busy share) between start and read:
    where the cores went during an arm."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.start = self._sample()

    def _sample(self) -> dict[str, float]:
        out = {name: process_cpu(pid) for name, pid in self.pids.items()}
        out["machine_busy"], out["machine_total"] = machine_busy()
        return out

    def read(self) -> dict[str, float]:
        now = self._sample()
        used = {name: round(now[name] - self.start[name], 1) for name in self.pids}
        busy = now["machine_busy"] - self.start["machine_busy"]
        used["machine_busy_percent"] = round(100 * busy / (now["machine_total"] - self.start["machine_total"]), 1)
        return used


def metric_rows(url: str) -> list[tuple[str, float]]:
    """A Prometheus endpoint's samples as (series, value)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return [(s, float(v)) for s, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))]


def operator_requests(url: str) -> float:
    """The operator's own API requests so far (its `sharded_api_requests_total`)."""
    return sum(v for s, v in metric_rows(url) if s.startswith("sharded_api_requests_total"))


def operator_counts(url: str) -> dict[str, float]:
    names = {"sharded_reconcile_duration_seconds_count": "reconciles", "sharded_reconcile_skipped_total": "skipped",
             'sharded_watch_events_total{kind="pods"}': "pod_events", 'sharded_watch_events_total{kind="nodes"}':
             "node_events", 'sharded_watch_events_total{kind="jobs"}': "job_events"}  # fmt: skip
    return {names[s]: v for s, v in metric_rows(url) if s in names}


def reconcile_histogram(url: str) -> dict[str, float]:
    buckets = [(s, v) for s, v in metric_rows(url) if s.startswith("sharded_reconcile_duration_seconds_bucket")]
    return {s.split('le="')[1].rstrip('"}'): v for s, v in buckets}


def apiserver_requests(raw: str) -> float:
    """Every client's requests so far, from the API server's own metrics text."""
    lines = [line for line in raw.splitlines() if line.startswith("apiserver_request_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0.0


def plot(results: dict, out: Path) -> None:
    """Steady state against the number of jobs (paced arm), and the burst and paced arms side by side.
    Needs matplotlib, which the project itself does not depend on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results["arms"]
    steady = arms["operator-paced"]["steady"]
    jobs = [s["jobs"] for s in steady]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(jobs, [s["operator_rss_mb"] for s in steady], "o-", label="operator RSS (MB)")
    left.plot(jobs, [s["operator_cpu_percent"] for s in steady], "s-", label="operator CPU (% of a core)")
    left.plot(jobs, [s["operator_requests_per_s"] * 60 for s in steady], "^-", label="operator API requests / min")
    left.plot(jobs, [s["operator_per_s"].get("node_events", 0) / 10 for s in steady], "x--",
              label="node watch events / s (/10)")  # fmt: skip
    left.set_xlabel("jobs running (8 GPU pods + a store pod each), nothing changing")
    left.set_title(f"steady state, {results['nodes']} KWOK nodes")
    left.legend(fontsize=8)
    names = [a for a in ("raw-burst", "raw-burst-services", "operator-burst", "raw-paced", "operator-paced")
             if a in arms]  # fmt: skip
    x = range(len(names))
    right.bar([i - 0.2 for i in x], [arms[a]["submit_to_all_pods_p50_s"] for a in names], 0.4, label="p50")
    right.bar([i + 0.2 for i in x], [arms[a]["submit_to_all_pods_p99_s"] for a in names], 0.4, label="p99")
    right.set_yscale("log")
    right.set_xticks(list(x), [f"{a}\n{arms[a]['pods_per_s']} pods/s" if "burst" in a else a for a in names])
    right.set_ylabel("submit -> all pods of a job created (s)")
    right.set_title(f"{results['jobs']} jobs: burst, and paced at {results['rate']} jobs/s")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The options of `operator_scale.py`."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=5.0, help="paced arrivals, jobs per second")
    ap.add_argument("--steady", type=float, default=60.0, help="seconds of each steady-state measurement")
    ap.add_argument("--arms", default="raw-burst,operator-burst,operator-paced,raw-paced")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--profile",
        type=Path,
        help="a folder: py-spy (on PATH) samples the operator while jobs start and in each steady state; "
        "pprof profiles the API server, scheduler and controller-manager in each arm (go on PATH "
        "summarises them)",
    )
    ap.add_argument(
        "--tracemalloc",
        type=Path,
        help="a file: the operator runs under tracemalloc and writes where its memory is in each steady "
        "state (slower: not for the timings)",
    )
    ap.add_argument(
        "--malloc-arenas",
        default="2",
        help="the operator's MALLOC_ARENA_MAX (its image sets 2); 'glibc': unset, glibc's default",
    )
    ap.add_argument(
        "--node-heartbeat",
        type=float,
        default=60.0,
        help="seconds between a KWOK node's status heartbeats (0: the stages file's 10 s)",
    )
    ap.add_argument(
        "--node-grace",
        type=float,
        default=600.0,
        help="seconds without a heartbeat before a node is NotReady (0: the controller-manager's 50 s)",
    )
    ap.add_argument("--plot", type=Path, help="draw the results (of --out, or --replot's file) into this PNG")
    ap.add_argument(
        "--replot",
        type=Path,
        nargs="+",
        help="results files to plot together (the arms of later files added to the first's), without running anything",
    )
    return ap.parse_args(argv)
