"""The operator at cluster scale, against a raw client creating the same pods on the same API server.

    .venv/bin/python bench/operator_scale.py --nodes 1000 --jobs 1000 --out bench/results/operator-scale.json

Starts the local control plane (etcd, kube-apiserver, controller-manager, scheduler, KWOK) with `--nodes`
KWOK nodes of 8 GPUs, and in one run, one arm after the other:

1. raw burst: a raw client (the `kubernetes` package, 16 threads, responses read as JSON) creates the pods
   the operator would create for `--jobs` jobs of 8 nodes x 1 GPU (8 training pods and the rendezvous store
   pod each, built by the operator's own builders), as fast as it can;
2. operator burst: `--jobs` ShardedTrainingJobs created as fast as 16 threads can; the operator creates
   everything (Service, ConfigMap, pods, status, events). Then, with every job Running and nothing
   changing, the steady state: the operator's own API requests (its `sharded_api_requests_total`), every
   client's requests (the API server's `apiserver_request_total`), the operator's CPU and RSS;
3. operator paced: jobs arrive at `--rate` jobs/s; at 100, 250, 500 and 1,000 jobs the arrivals pause, every
   job is let reach Running and the steady state is measured again (how it grows with the jobs);
4. raw paced: the raw client creates each job's pods at the same arrival rate.

An arm named `raw-burst-services` (or `raw-paced-services`), not run unless asked for, is the raw client
creating each job's headless Service as well as its pods: the share of the gap to the raw client that is
the cluster's work for a Service's pods (endpoints, the scheduler's spreading) rather than the operator's.

Every pod is timed when this process first sees it in a watch (one label-selected watch of every pod,
read as raw JSON lines); "submit -> all pods" is from the moment a job (or a raw job's first pod) was sent
to the moment its last pod was seen. pods/s = pods / (last pod seen - first submit). Between arms the
namespace is deleted and every pod is waited out.

The simulated nodes heartbeat their status every `--node-heartbeat` seconds (60; a kubelet with node leases
writes its status every 5 minutes) and go NotReady after `--node-grace` seconds without one (600): 1,000
nodes heartbeating every 10 s on the two cores the bench measures on fall behind and flap NotReady, which
makes the operator restart jobs for lost nodes, a fault of the simulation, not of the cluster simulated.

Absolute numbers are this machine's (2 CPU cores shared by the API server, etcd, the scheduler, KWOK, the
operator and this process); the ratios come from arms of the same run. Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "hack"), str(ROOT / "tests")]  # the local stack; the job factory

from kubernetes import client, config  # noqa: E402

from localstack import cluster as localcluster  # noqa: E402
from localstack.stack import OperatorProcess, install_crd  # noqa: E402
from sharded_operator.api.models import GROUP, LABEL_JOB, PLURAL, VERSION, ShardedTrainingJob  # noqa: E402
from sharded_operator.render import podspec, rendezvous  # noqa: E402
from sharded_operator.settings import OperatorSettings  # noqa: E402
from support.jobs import make_job  # noqa: E402

PODS_PER_JOB = 9  # 8 training pods and the rendezvous store pod
THREADS = 16
CHECKPOINTS = (100, 250, 500, 1000)


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


class Bench:
    def __init__(self, cluster: localcluster.LocalCluster, jobs: int, rate: float, steady: float,
                 profile: Path | None = None, memory: Path | None = None):  # fmt: skip
        self.cluster, self.jobs, self.rate, self.steady = cluster, jobs, rate, steady
        self.memory = memory  # the operator runs under bench/operator_memory.py, which writes here
        self.profile, self.profile_tool = profile, shutil.which("py-spy") or "py-spy"
        conf = client.Configuration()
        config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=conf)
        conf.connection_pool_maxsize = THREADS * 2
        self.api = client.ApiClient(conf)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.watch = PodWatch(self.api).start()
        self.pool = ThreadPoolExecutor(THREADS)
        self.operator: OperatorProcess | None = None

    def meter(self) -> CpuMeter:
        pids = {name: proc.pid for name, proc in self.cluster.procs.items()}
        pids["bench"] = os.getpid()
        if self.operator and self.operator.proc:
            pids["operator"] = self.operator.proc.pid
        return CpuMeter(pids)

    # --- namespaces -------------------------------------------------------------------------------

    def namespace(self, name: str) -> str:
        self.core.create_namespace({"metadata": {"name": name}})
        wait(lambda: self._has_sa(name), 60, f"namespace {name}'s default ServiceAccount", 0.2)
        return name

    def _has_sa(self, ns: str) -> bool:
        try:
            return bool(self.core.read_namespaced_service_account("default", ns))
        except client.ApiException:
            return False

    def clear(self, ns: str) -> None:
        """Delete every pod (one request each, 16 at a time: one delete of 9,000 pods outlasts the API
        server's request timeout), then the namespace; wait until every pod of it is gone."""
        print(f"[bench] deleting namespace {ns}", flush=True)
        names = [name for (n, name) in list(self.watch.seen) if n == ns]

        def delete(name: str) -> None:
            try:
                self.core.delete_namespaced_pod(name, ns, grace_period_seconds=0, _preload_content=False)
            except client.ApiException as e:
                if e.status != 404:
                    raise

        list(self.pool.map(delete, names))
        self.core.delete_namespace(ns)
        wait(lambda: self.watch.count(ns)[0] == 0, 900, f"pods of {ns} gone", 2)
        # Its jobs too: an operator started for the next arm must not find jobs that lost their pods (it
        # would restart them, and be refused, in a namespace being deleted).
        wait(lambda: not self._namespace_exists(ns), 1800, f"namespace {ns} gone", 2)

    def _namespace_exists(self, ns: str) -> bool:
        try:
            self.core.read_namespace(ns)
            return True
        except client.ApiException as e:
            if e.status == 404:
                return False
            raise

    # --- arms -------------------------------------------------------------------------------------

    def create(self, ns: str, obj: dict) -> None:
        if obj["kind"] == "Service":
            self.core.create_namespaced_service(ns, obj, _preload_content=False)
        else:
            self.core.create_namespaced_pod(ns, obj, _preload_content=False)

    def raw(self, ns: str, arm: str) -> dict:
        paced = arm.endswith("paced")
        names = [f"j{i:04d}" for i in range(self.jobs)]
        bodies = {n: raw_pods(n, ns, service="services" in arm) for n in names}
        submitted: dict[str, float] = {}

        def send(name: str) -> None:
            for obj in bodies[name]:
                self.create(ns, obj)

        futures = []
        meter, profiles = self.meter(), self.go_profiles(arm)
        start = time.monotonic()
        for i, name in enumerate(names):
            if paced:
                time.sleep(max(0.0, start + i / self.rate - time.monotonic()))
            submitted[name] = time.monotonic()
            if paced:  # a job's pods at once, as a controller sends them
                futures += [self.pool.submit(self.create, ns, obj) for obj in bodies[name]]
            else:
                futures.append(self.pool.submit(send, name))
        for f in futures:
            f.result()
        wait(lambda: self.watch.count(ns)[0] >= self.jobs * PODS_PER_JOB, 900, "every raw pod seen", 0.2)
        cpu = meter.read()
        if profiles:
            profiles.stop()
        return summary(arm, submitted, self.watch.times(ns), cpu)

    def create_jobs(self, ns: str, names: list[str], submitted: dict[str, float], paced: bool) -> None:
        def send(name: str) -> None:
            submitted[name] = time.monotonic()
            self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, job_body(name))

        start = time.monotonic()
        futures = []
        for i, name in enumerate(names):
            if paced:
                time.sleep(max(0.0, start + i / self.rate - time.monotonic()))
            futures.append(self.pool.submit(send, name))
        for f in futures:
            f.result()

    def ours(self, ns: str, paced: bool) -> dict:
        names = [f"j{i:04d}" for i in range(self.jobs)]
        submitted: dict[str, float] = {}
        steady, windows = [], []
        marks = [c for c in CHECKPOINTS if c < self.jobs] + [self.jobs] if paced else [self.jobs]
        done = 0
        for mark in marks:
            name = f"operator-{'paced' if paced else 'burst'}-{mark}"
            meter, sampler, profiles = self.meter(), self.sample(name), self.go_profiles(name)
            self.create_jobs(ns, names[done:mark], submitted, paced)
            window, done = names[done:mark], mark
            wait(lambda m=mark: self.watch.count(ns)[0] >= m * PODS_PER_JOB, 900, "every pod seen", 0.2)
            cpu = meter.read()
            if sampler:
                sampler.send_signal(signal.SIGINT)  # py-spy writes what it sampled when interrupted
                sampler.wait(60)
                if (raw := self.profile / f"{name}.txt").exists():
                    (self.profile / f"{name}-top.txt").write_text(py_spy_top(raw.read_text()))
            if profiles:
                profiles.stop()
            # Paced: the arrivals pause for each steady state; the span of all arrivals includes the pauses,
            # so pods/s is not comparable there (latency is).
            result = summary(f"operator-{'paced' if paced else 'burst'}", submitted, self.watch.times(ns), cpu)
            if paced:  # the jobs that arrived since the last pause, alone: how latency changes with the jobs
                lat = job_latencies({n: submitted[n] for n in window}, self.watch.times(ns))
                windows.append({"jobs": f"{mark - len(window) + 1}-{mark}",
                                "p50_s": round(percentile(lat, 0.5), 3), "p99_s": round(percentile(lat, 0.99), 3)})
                print(json.dumps(windows[-1]), flush=True)
            steady.append(self.steady_state(ns, mark))
        result["steady"] = steady
        if windows:
            result["windows"] = windows
        result["reconcile_seconds"] = self.histogram()
        return result

    def sample(self, name: str) -> subprocess.Popen | None:
        """With --profile, py-spy sampling the operator until interrupted (where its CPU goes while jobs start)."""
        if not (self.profile and self.operator and self.operator.proc):
            return None
        return subprocess.Popen(self.py_spy(name), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def go_profiles(self, arm: str) -> GoProfiles | None:
        """With --profile, the control plane's CPU profiles while the arm runs."""
        return GoProfiles(self.cluster, self.profile, arm) if self.profile else None

    def py_spy(self, name: str, *extra: str) -> list[str]:
        """py-spy recording the operator's stacks into the --profile folder's `name`.txt: only the thread
        holding the GIL, so that the samples are the operator's CPU (threads waiting on a socket or for the GIL
        would count as busy otherwise)."""
        assert self.profile and self.operator and self.operator.proc
        return [self.profile_tool, "record", "--gil", "-p", str(self.operator.proc.pid), "-f", "raw",
                "-o", str(self.profile / f"{name}.txt"), *extra]  # fmt: skip

    # --- the steady state -------------------------------------------------------------------------

    def steady_state(self, ns: str, jobs: int) -> dict:
        wait(lambda: self.watch.count(ns)[1] >= jobs * PODS_PER_JOB, 900, "every pod Running", 1)
        wait(lambda: self._phases(ns).get("Running", 0) >= jobs, 900, "every job Running", 2)
        time.sleep(10)  # the last status writes and events of the start
        before_ops, before_api, before_cpu = self._op_requests(), self._api_requests(), self._op_cpu()
        before_counts = self._op_counts()
        if self.profile and self.operator and self.operator.proc:  # where the operator's CPU goes at rest
            subprocess.run(self.py_spy(f"operator-steady-{jobs}", "-d", str(int(self.steady))), check=False,
                           capture_output=True)  # fmt: skip
        else:
            time.sleep(self.steady)
        after_ops, after_api, after_cpu = self._op_requests(), self._api_requests(), self._op_cpu()
        counts = {k: round((v - before_counts.get(k, 0)) / self.steady, 2) for k, v in self._op_counts().items()}
        out = {
            "jobs": jobs, "seconds": self.steady,
            "operator_requests_per_s": round((after_ops - before_ops) / self.steady, 3),
            "all_clients_requests_per_s": round((after_api - before_api) / self.steady, 2),
            "operator_cpu_percent": round(100 * (after_cpu - before_cpu) / self.steady, 2),
            "operator_rss_mb": round(self._op_rss() / 2**20, 1),
            "job_restarts": self._restarts(ns),  # a healthy start restarts nothing
            "operator_per_s": counts,  # reconciles, skipped looks and watch events handled, per second
        }  # fmt: skip
        print(json.dumps(out), flush=True)
        if self.memory and self.operator and self.operator.proc:  # after the RSS is read: the dump allocates
            with self.memory.open("a") as f:
                f.write(f"\n# steady state, {jobs} jobs, RSS {out['operator_rss_mb']} MB\n")
            size = self.memory.stat().st_size
            self.operator.proc.send_signal(signal.SIGUSR2)
            wait(lambda: self.memory.stat().st_size > size + 200, 300, "the operator's memory dump", 1)
        return out

    def _statuses(self, ns: str) -> list[dict]:
        return [j.get("status") or {} for j in self.custom.list_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL)["items"]]  # fmt: skip

    def _phases(self, ns: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for status in self._statuses(ns):
            out[status.get("phase", "")] = out.get(status.get("phase", ""), 0) + 1
        return out

    def _restarts(self, ns: str) -> int:
        """The gang restarts of every job (none, when nothing failed)."""
        return sum(status.get("restarts") or 0 for status in self._statuses(ns))

    def _metrics(self, url: str) -> list[tuple[str, float]]:
        import urllib.request

        with urllib.request.urlopen(url, timeout=10) as r:
            lines = r.read().decode().splitlines()
        return [(s, float(v)) for s, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))]

    def _op_requests(self) -> float:
        assert self.operator
        rows = self._metrics(f"{self.operator.url}/metrics")
        return sum(v for s, v in rows if s.startswith("sharded_api_requests_total"))

    def _op_counts(self) -> dict[str, float]:
        assert self.operator
        names = {"sharded_reconcile_duration_seconds_count": "reconciles", "sharded_reconcile_skipped_total": "skipped",
                 'sharded_watch_events_total{kind="pods"}': "pod_events", 'sharded_watch_events_total{kind="nodes"}':
                 "node_events", 'sharded_watch_events_total{kind="jobs"}': "job_events"}  # fmt: skip
        return {names[s]: v for s, v in self._metrics(f"{self.operator.url}/metrics") if s in names}

    def histogram(self) -> dict[str, float]:
        assert self.operator
        rows = self._metrics(f"{self.operator.url}/metrics")
        buckets = [(s, v) for s, v in rows if s.startswith("sharded_reconcile_duration_seconds_bucket")]
        return {s.split('le="')[1].rstrip('"}'): v for s, v in buckets}

    def _api_requests(self) -> float:
        raw = self.cluster.api("GET", "/metrics")["raw"]
        lines = [line for line in raw.splitlines() if line.startswith("apiserver_request_total{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    def _op_cpu(self) -> float:
        assert self.operator and self.operator.proc
        return process_cpu(self.operator.proc.pid)

    def _op_rss(self) -> float:
        assert self.operator and self.operator.proc
        for line in Path(f"/proc/{self.operator.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0.0


def add_nodes(cluster: localcluster.LocalCluster, n: int) -> None:
    print(f"[bench] adding {n} KWOK nodes of 8 GPUs", flush=True)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: cluster.add_gpu_node(f"gpu-node-{i}"), range(n)))

    def ready() -> bool:
        nodes = cluster.api("GET", "/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
        return sum(any(c["type"] == "Ready" and c["status"] == "True" for c in (x.get("status") or {}).get(
            "conditions") or []) for x in nodes) >= n  # fmt: skip

    wait(ready, 600, f"{n} nodes Ready", 2)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=5.0, help="paced arrivals, jobs per second")
    ap.add_argument("--steady", type=float, default=60.0, help="seconds of each steady-state measurement")
    ap.add_argument("--arms", default="raw-burst,operator-burst,operator-paced,raw-paced")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", type=Path,
                    help="a folder: py-spy (on PATH) samples the operator while jobs start and in each steady state; "
                         "pprof profiles the API server, scheduler and controller-manager in each arm (go on PATH "
                         "summarises them)")
    ap.add_argument("--tracemalloc", type=Path,
                    help="a file: the operator runs under tracemalloc and writes where its memory is in each steady "
                         "state (slower: not for the timings)")
    ap.add_argument("--malloc-arenas", default="2",
                    help="the operator's MALLOC_ARENA_MAX (its image sets 2); 'glibc': unset, glibc's default")
    ap.add_argument("--node-heartbeat", type=float, default=60.0,
                    help="seconds between a KWOK node's status heartbeats (0: the stages file's 10 s)")
    ap.add_argument("--node-grace", type=float, default=600.0,
                    help="seconds without a heartbeat before a node is NotReady (0: the controller-manager's 50 s)")
    ap.add_argument("--plot", type=Path, help="draw the results (of --out, or --replot's file) into this PNG")
    ap.add_argument("--replot", type=Path, nargs="+",
                    help="results files to plot together (the arms of later files added to the first's), without "
                         "running anything")
    args = ap.parse_args(argv)
    if args.replot:
        merged = json.loads(args.replot[0].read_text())
        for more in args.replot[1:]:
            merged["arms"].update(json.loads(more.read_text())["arms"])
        plot(merged, args.plot)
        return 0
    arms = args.arms.split(",")
    results: dict = {"command": " ".join(["bench/operator_scale.py", *(argv or sys.argv[1:])]), "nodes": args.nodes,
                     "jobs": args.jobs, "rate": args.rate, "pods_per_job": PODS_PER_JOB, "cpus": os.cpu_count(),
                     "arms": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        workdir = Path(tmp)
        cluster = localcluster.LocalCluster(
            workdir=workdir, bin_dir=localcluster.binaries_dir(), gpu_nodes=0,
            node_heartbeat_seconds=args.node_heartbeat or None, node_grace_seconds=args.node_grace or None,
        )  # fmt: skip
        cluster.start()
        try:
            install_crd(cluster.kubeconfig)
            add_nodes(cluster, args.nodes)
            bench = Bench(cluster, args.jobs, args.rate, args.steady, args.profile, args.tracemalloc)
            for i, arm in enumerate(arms):
                print(f"[bench] arm {arm}", flush=True)
                ns = bench.namespace(f"{arm}-{i}")
                if arm.startswith("raw"):
                    results["arms"][arm] = bench.raw(ns, arm)
                else:
                    log = workdir / f"operator-{arm}.log"
                    operator = OperatorProcess(cluster.kubeconfig, log, RESYNC_SECONDS="300")
                    if args.tracemalloc:
                        operator.command = [sys.executable, str(ROOT / "bench" / "operator_memory.py"),
                                            str(args.tracemalloc.resolve())]  # fmt: skip
                    if args.malloc_arenas == "glibc":
                        operator.env.pop("MALLOC_ARENA_MAX", None)
                    else:
                        operator.env["MALLOC_ARENA_MAX"] = args.malloc_arenas
                    bench.operator = operator.start(timeout=600 if args.tracemalloc else 60)  # traced: slow
                    try:
                        results["arms"][arm] = bench.ours(ns, paced=arm.endswith("paced"))
                    finally:
                        bench.operator.stop()
                        bench.operator = None
                bench.clear(ns)
                if args.out:  # what has been measured survives a later arm's failure
                    args.out.write_text(json.dumps(results, indent=2) + "\n")
        finally:
            cluster.stop()
    burst = results["arms"]
    if "raw-burst" in burst and "operator-burst" in burst:
        ratio = burst["operator-burst"]["pods_per_s"] / burst["raw-burst"]["pods_per_s"]
        results["burst_pods_per_s_ratio"] = round(ratio, 3)
        print(f"[bench] burst pods/s, operator / raw: {ratio:.3f}", flush=True)
    if "raw-burst-services" in burst and "operator-burst" in burst:
        ratio = burst["operator-burst"]["pods_per_s"] / burst["raw-burst-services"]["pods_per_s"]
        results["burst_pods_per_s_ratio_to_raw_with_services"] = round(ratio, 3)
        print(f"[bench] burst pods/s, operator / raw with Services: {ratio:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
