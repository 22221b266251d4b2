"""The operator at cluster scale, against a raw client creating the same pods on the same API server.

    .venv/bin/python bench/operator_scale.py --nodes 1000 --jobs 1000 --out bench/results/operator-scale/NAME.json

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

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "hack"), str(ROOT / "tests")]  # the local stack; the job factory

import scale_probes as probes  # noqa: E402
from kubernetes import client, config  # noqa: E402

from localstack import cluster as localcluster  # noqa: E402
from localstack.stack import OperatorProcess, install_crd  # noqa: E402
from sharded_operator.api.models import GROUP, PLURAL, VERSION  # noqa: E402

THREADS = 16
CHECKPOINTS = (100, 250, 500, 1000)


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
        self.watch = probes.PodWatch(self.api).start()
        self.pool = ThreadPoolExecutor(THREADS)
        self.operator: OperatorProcess | None = None

    def meter(self) -> probes.CpuMeter:
        pids = {name: proc.pid for name, proc in self.cluster.procs.items()}
        pids["bench"] = os.getpid()
        if self.operator and self.operator.proc:
            pids["operator"] = self.operator.proc.pid
        return probes.CpuMeter(pids)

    # --- namespaces -------------------------------------------------------------------------------

    def namespace(self, name: str) -> str:
        self.core.create_namespace({"metadata": {"name": name}})
        probes.wait(lambda: self._has_sa(name), 60, f"namespace {name}'s default ServiceAccount", 0.2)
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
        probes.wait(lambda: self.watch.count(ns)[0] == 0, 900, f"pods of {ns} gone", 2)
        # Its jobs too: an operator started for the next arm must not find jobs that lost their pods (it
        # would restart them, and be refused, in a namespace being deleted).
        probes.wait(lambda: not self._namespace_exists(ns), 1800, f"namespace {ns} gone", 2)

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
        bodies = {n: probes.raw_pods(n, ns, service="services" in arm) for n in names}
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
        probes.wait(lambda: self.watch.count(ns)[0] >= self.jobs * probes.PODS_PER_JOB, 900, "every raw pod seen", 0.2)
        cpu = meter.read()
        if profiles:
            profiles.stop()
        return probes.summary(arm, submitted, self.watch.times(ns), cpu)

    def create_jobs(self, ns: str, names: list[str], submitted: dict[str, float], paced: bool) -> None:
        def send(name: str) -> None:
            submitted[name] = time.monotonic()
            self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, probes.job_body(name))

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
            probes.wait(lambda m=mark: self.watch.count(ns)[0] >= m * probes.PODS_PER_JOB, 900, "every pod seen", 0.2)
            cpu = meter.read()
            if sampler:
                sampler.send_signal(signal.SIGINT)  # py-spy writes what it sampled when interrupted
                sampler.wait(60)
                if (raw := self.profile / f"{name}.txt").exists():
                    (self.profile / f"{name}-top.txt").write_text(probes.py_spy_top(raw.read_text()))
            if profiles:
                profiles.stop()
            # Paced: the arrivals pause for each steady state; the span of all arrivals includes the pauses,
            # so pods/s is not comparable there (latency is).
            result = probes.summary(f"operator-{'paced' if paced else 'burst'}", submitted, self.watch.times(ns), cpu)
            if paced:  # the jobs that arrived since the last pause, alone: how latency changes with the jobs
                lat = probes.job_latencies({n: submitted[n] for n in window}, self.watch.times(ns))
                p50, p99 = probes.percentile(lat, 0.5), probes.percentile(lat, 0.99)
                first = mark - len(window) + 1
                windows.append({"jobs": f"{first}-{mark}", "p50_s": round(p50, 3), "p99_s": round(p99, 3)})
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

    def go_profiles(self, arm: str) -> probes.GoProfiles | None:
        """With --profile, the control plane's CPU profiles while the arm runs."""
        return probes.GoProfiles(self.cluster, self.profile, arm) if self.profile else None

    def py_spy(self, name: str, *extra: str) -> list[str]:
        """py-spy recording the operator's stacks into the --profile folder's `name`.txt: only the thread
        holding the GIL, so that the samples are the operator's CPU (threads waiting on a socket or for the GIL
        would count as busy otherwise)."""
        assert self.profile and self.operator and self.operator.proc
        return [self.profile_tool, "record", "--gil", "-p", str(self.operator.proc.pid), "-f", "raw",
                "-o", str(self.profile / f"{name}.txt"), *extra]  # fmt: skip

    # --- the steady state -------------------------------------------------------------------------

    def steady_state(self, ns: str, jobs: int) -> dict:
        probes.wait(lambda: self.watch.count(ns)[1] >= jobs * probes.PODS_PER_JOB, 900, "every pod Running", 1)
        probes.wait(lambda: self._phases(ns).get("Running", 0) >= jobs, 900, "every job Running", 2)
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
            probes.wait(lambda: self.memory.stat().st_size > size + 200, 300, "the operator's memory dump", 1)
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

    def _op_requests(self) -> float:
        assert self.operator
        return probes.operator_requests(f"{self.operator.url}/metrics")

    def _op_counts(self) -> dict[str, float]:
        assert self.operator
        return probes.operator_counts(f"{self.operator.url}/metrics")

    def histogram(self) -> dict[str, float]:
        assert self.operator
        return probes.reconcile_histogram(f"{self.operator.url}/metrics")

    def _api_requests(self) -> float:
        return probes.apiserver_requests(self.cluster.api("GET", "/metrics")["raw"])

    def _op_cpu(self) -> float:
        assert self.operator and self.operator.proc
        return probes.process_cpu(self.operator.proc.pid)

    def _op_rss(self) -> float:
        assert self.operator and self.operator.proc
        return probes.rss(self.operator.proc.pid)


def main(argv: list[str] | None = None) -> int:
    args = probes.parse_args(argv, __doc__.splitlines()[0])
    if args.replot:
        merged = json.loads(args.replot[0].read_text())
        for more in args.replot[1:]:
            merged["arms"].update(json.loads(more.read_text())["arms"])
        probes.plot(merged, args.plot)
        return 0
    arms = args.arms.split(",")
    results: dict = {"command": " ".join(["bench/operator_scale.py", *(argv or sys.argv[1:])]), "nodes": args.nodes,
                     "jobs": args.jobs, "rate": args.rate, "pods_per_job": probes.PODS_PER_JOB, "cpus": os.cpu_count(),
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
            probes.add_nodes(cluster, args.nodes)
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
        probes.plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
