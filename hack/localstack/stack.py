"""The whole local setup for end-to-end runs: control plane + node agent + the operator as a process.

Used by `make demo` (hack/demo.py) and the e2e tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

from localstack import cluster as localcluster
from localstack.nodeagent import NodeAgent
from localstack.podstart import GATEWAY

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "training.sharded.dev_shardedtrainingjobs.yaml"


class OperatorProcess:
    """`python -m sharded_operator` as a real process against a cluster."""

    def __init__(self, kubeconfig: Path, log: Path, host: str = "127.0.0.1", **settings: str):
        port, progress_port = localcluster.free_port(host), localcluster.free_port(host)
        self.url = f"http://{host}:{port}"  # /metrics, /healthz
        self.progress_url = f"http://{host}:{progress_port}/progress"
        self.log = log
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "SHARDED_OPERATOR_HTTP_HOST": host,
            "SHARDED_OPERATOR_HTTP_PORT": str(port),
            "SHARDED_OPERATOR_PROGRESS_PORT": str(progress_port),
            "SHARDED_OPERATOR_PROGRESS_URL": self.progress_url,
            "SHARDED_OPERATOR_RESYNC_SECONDS": "300",  # events and timers drive every decision; the resync is a net
            "SHARDED_OPERATOR_LOG_FORMAT": "plain",
            "MALLOC_ARENA_MAX": "2",  # as the operator image sets it
            **{f"SHARDED_OPERATOR_{k.upper()}": str(v) for k, v in settings.items()},
        }
        self.command = [sys.executable, "-m", "sharded_operator"]  # the bench may wrap it (a profiler)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> OperatorProcess:
        out = open(self.log, "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"operator not healthy after {timeout}s; see {self.log}")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crashed or OOM-killed operator."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


AGGREGATED_DISCOVERY = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"


def install_crd(kubeconfig: Path, body: dict | None = None, timeout: float = 30) -> None:
    """Create a CRD (the generated ShardedTrainingJob one unless `body` is given) and wait until it is
    Established and listed in the API's aggregated discovery. Established alone is not enough for a
    controller started right after: the discovery document is rebuilt a moment later, and a controller whose
    REST mapper reads it first exits with `no matches for kind` (Kueue did, once in a suite run)."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    api = config.new_client_from_config(config_file=str(kubeconfig))
    ext = client.ApiextensionsV1Api(api)
    body = body or yaml.safe_load(CRD_FILE.read_text())
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as e:
        if e.status != 409:
            raise
    group, plural = body["spec"]["group"], body["spec"]["names"]["plural"]
    versions = {v["name"] for v in body["spec"]["versions"] if v.get("served", True)}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conds = ext.read_custom_resource_definition(body["metadata"]["name"]).status.conditions or []
        established = any(c.type == "Established" and c.status == "True" for c in conds)
        if established and versions <= discovered_versions(api, group, plural):
            return
        time.sleep(0.2)
    raise TimeoutError(f"CRD {body['metadata']['name']} not Established and discovered after {timeout}s")


def discovered_versions(api, group: str, plural: str) -> set[str]:
    """The versions of `group` whose resources include `plural` in the aggregated discovery document (the one
    client-go's REST mappers read)."""
    # Served at /apis exactly (the generated ApisApi asks for /apis/, which answers only the legacy list).
    method, url, headers, body, post = api.param_serialize(
        "GET", "/apis", header_params={"Accept": AGGREGATED_DISCOVERY}, auth_settings=["BearerToken"]
    )
    resp = api.call_api(method, url, headers, body, post, _request_timeout=10)
    resp.read()
    doc = json.loads(resp.data)
    return {
        version["version"]
        for item in doc.get("items", [])
        if item["metadata"]["name"] == group
        for version in item.get("versions", [])
        if any(r.get("resource") == plural for r in version.get("resources", []))
    }


def wait_collectable(kubeconfig: Path, timeout: float = 90) -> None:
    """Until the garbage collector watches ShardedTrainingJobs. It rediscovers the API's resources every 30 s,
    so for up to 30 s after the CRD is installed a deleted job's pods stay (nothing tells the collector
    their owner is gone): on a fresh control plane, a test that deletes a job would depend on the clock.
    A probe job in kube-system (which the tests' operators ignore) with a ConfigMap it owns is deleted until
    the ConfigMap is collected."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    api = config.new_client_from_config(config_file=str(kubeconfig))
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    crd = yaml.safe_load(CRD_FILE.read_text())
    group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
    version = crd["spec"]["versions"][0]["name"]
    deadline = time.monotonic() + timeout
    for attempt in range(1000):
        name = f"gc-probe-{attempt}"
        job = custom.create_namespaced_custom_object(group, version, "kube-system", plural, {
            "apiVersion": f"{group}/{version}", "kind": crd["spec"]["names"]["kind"], "metadata": {"name": name},
            "spec": {"image": "gc-probe"}})  # fmt: skip
        owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": name, "uid": job["metadata"]["uid"]}
        core.create_namespaced_config_map("kube-system", {"metadata": {"name": name, "ownerReferences": [owner]}})
        custom.delete_namespaced_custom_object(group, version, "kube-system", plural, name)
        for _ in range(20):  # collected within 2 s once the collector watches the kind
            try:
                core.read_namespaced_config_map(name, "kube-system")
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            time.sleep(0.1)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the garbage collector did not collect a deleted {crd['spec']['names']['kind']}'s "
                               f"dependents within {timeout:.0f}s")  # fmt: skip


class LocalStack:
    """Start order matters: the agent's bridge must exist before the operator binds to its gateway."""

    def __init__(self, workdir: Path, nodes: int = 2, containers: bool = False):
        self.workdir = workdir
        self.containers = containers  # pods run from their images through docker (localstack.containers)
        self.cluster = localcluster.LocalCluster(workdir=workdir, bin_dir=localcluster.binaries_dir(), gpu_nodes=0)
        self.nodes = nodes
        self.agent: NodeAgent | None = None
        self.operator: OperatorProcess | None = None

    def start(self) -> LocalStack:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.cluster.start()
            install_crd(self.cluster.kubeconfig)
            names = [f"local-node-{i}" for i in range(self.nodes)]
            self.agent = NodeAgent(
                str(self.cluster.kubeconfig),
                self.workdir / "nodeagent",
                names,
                pki=self.cluster.workdir / "pki",
                containers=self.containers,
            ).start()
            self.operator = OperatorProcess(
                self.cluster.kubeconfig, self.workdir / "operator.log", host=GATEWAY,
                RESTART_GRACE_SECONDS="10", SUSPEND_GRACE_SECONDS="60", PROGRESS_WRITE_SECONDS="2",
            ).start()  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.operator:
            self.operator.stop()
        if self.agent:
            self.agent.stop()
        self.cluster.stop()

    def new_claim(self, namespace: str, claim: str, size: str = "1Gi", timeout: float = 60) -> Path:
        """A ReadWriteMany claim bound to one of the static volumes; returns its host directory, where a test
        or the demo puts what the pods will read (a model, records)."""
        self.cluster.api("POST", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims", {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                     "resources": {"requests": {"storage": size}}},
        })  # fmt: skip
        deadline = time.monotonic() + timeout
        path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}"
        while self.cluster.api("GET", path).get("status", {}).get("phase") != "Bound":
            if time.monotonic() > deadline:
                raise TimeoutError(f"claim {claim} not bound after {timeout:.0f}s")
            time.sleep(0.3)
        return self.claim_dir(namespace, claim)

    def claim_dir(self, namespace: str, claim: str) -> Path:
        """The host directory behind a bound claim (the static PVs are hostPath)."""
        pvc = self.cluster.api("GET", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        pv = self.cluster.api("GET", f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
        return Path(pv["spec"]["hostPath"]["path"])
