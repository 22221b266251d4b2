"""A real local Kubernetes control plane on loopback: etcd, kube-apiserver, controller-manager,
scheduler and KWOK fake GPU nodes, started from the binaries hack/build-binaries.sh builds.

Used by the test fixtures, and from the command line through `python -m localstack` (`make cluster-up`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from localstack.pki import HOST, kubeconfig, write_pki
from localstack.processes import stop_dir, stop_pid_file

ROOT = Path(__file__).resolve().parents[2]
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
# As the GPU Operator and an RDMA shared device plugin make a node report them.
GPU_NODE_CAPACITY = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8", "rdma/ib": "8"}


def binaries_dir() -> Path:
    """Build (or find cached) control-plane binaries and return their directory."""
    override = os.environ.get("SHARDED_BIN_DIR")
    if override:
        return Path(override)
    out = subprocess.run(
        ["bash", str(ROOT / "hack" / "build-binaries.sh")], check=True, stdout=subprocess.PIPE, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


def free_port(host: str = HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --- the cluster --------------------------------------------------------------------------------


@dataclass
class LocalCluster:
    """The control-plane processes of one local cluster, rooted at `workdir`."""

    workdir: Path
    bin_dir: Path
    gpu_nodes: int = 4
    static_volumes: int = 32
    # A simulated node's status heartbeat (KWOK's `node-heartbeat` stage: this period, plus up to half of it
    # at random) and how long the controller-manager waits for one before calling the node NotReady. None:
    # the stages file's 10 s and the controller-manager's default. Many nodes on a busy machine need both
    # longer: the heartbeats of 1,000 nodes every 10 s are work the machine shares with what it measures,
    # and when they fall behind nodes flap NotReady, which a real kubelet on its own machine would not do.
    node_heartbeat_seconds: float | None = None
    node_grace_seconds: float | None = None
    audit: bool = False  # the API server's audit log of writes to jobs, pods and Leases (audit_events)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_port: int = 0
    _tls: ssl.SSLContext | None = field(default=None, repr=False)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://{HOST}:{self.api_port}"

    @staticmethod
    def _controller_flags(kubeconfig: Path) -> list[str]:
        """What kube-controller-manager and kube-scheduler both need: the API, loopback serving, no election."""
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--bind-address={HOST}",
            f"--secure-port={free_port()}",
            "--leader-elect=false",
        ]

    def secure_port(self, name: str) -> int:
        """The HTTPS port a control-plane component serves its health, metrics and /debug/pprof on."""
        if name == "kube-apiserver":
            return self.api_port
        return int(next(a.split("=", 1)[1] for a in self.procs[name].args if a.startswith("--secure-port=")))

    def stop_component(self, name: str) -> None:
        """Stop one component started by spawn() (its whole process group)."""
        self.procs.pop(name, None)
        stop_pid_file(self.workdir / "pids" / name)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        log = self.workdir / "logs" / f"{name}.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""

    def spawn(self, name: str, args: list[str]) -> None:
        """Run a component (a scheduler, a controller) from the binaries, stopped with the cluster."""
        log = open(self.workdir / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        # A session of its own, so stop() can kill the whole process group even if we die first.
        proc = subprocess.Popen(
            [str(self.bin_dir / args[0]), *args[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs[name] = proc
        (self.workdir / "pids").mkdir(exist_ok=True)
        (self.workdir / "pids" / name).write_text(str(proc.pid))

    def _kwok_stages(self) -> Path:
        """The KWOK stages file, with the node heartbeat's period where one is set."""
        stages = ROOT / "hack" / "kwok-stages.yaml"
        if not self.node_heartbeat_seconds:
            return stages
        import yaml

        docs = list(yaml.safe_load_all(stages.read_text()))
        (beat,) = [d for d in docs if d["metadata"]["name"] == "node-heartbeat"]
        ms = int(self.node_heartbeat_seconds * 1000)
        # KWOK waits the duration plus a random part of (duration, jitter]: jitter is the longest wait.
        beat["spec"]["delay"] = {"durationMilliseconds": ms, "jitterDurationMilliseconds": ms * 3 // 2}
        out = self.workdir / "kwok-stages.yaml"
        out.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        return out

    @property
    def audit_log(self) -> Path:
        return self.workdir / "logs" / "audit.jsonl"

    def audit_mark(self) -> int:
        """Where the audit log ends now: `audit_events(since=...)` reads only what came after."""
        return self.audit_log.stat().st_size if self.audit_log.exists() else 0

    def audit_events(self, since: int = 0) -> list[dict]:
        """The audit log's events (writes to jobs, pods and Leases) after offset `since`, oldest first."""
        if not self.audit_log.exists():
            return []
        with open(self.audit_log, "rb") as f:
            f.seek(since)
            lines = f.read().decode().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def _audit_policy(self) -> Path:
        """Metadata (who, what, when, the answer) of the writes to jobs, pods and Leases; nothing else, so the
        log stays small and costs the API server little."""
        policy = {
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
            "rules": [
                {"level": "Metadata", "verbs": ["create", "update", "patch", "delete"],
                 "resources": [{"group": "training.sharded.dev"}, {"group": "", "resources": ["pods"]},
                               {"group": "coordination.k8s.io", "resources": ["leases"]}]},
                {"level": "None"},
            ],
        }  # fmt: skip
        out = self.workdir / "audit-policy.json"
        out.write_text(json.dumps(policy))
        return out

    def start(self, timeout: float = 120) -> LocalCluster:
        """Start every component, wait until the API server is ready and the GPU nodes are Ready."""
        started = time.monotonic()
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        pki = self.workdir / "pki"
        write_pki(pki)
        self._tls = None  # the admin's context trusts this CA
        self.api_port = free_port()
        etcd_port, etcd_peer = free_port(), free_port()
        self.kubeconfig.write_text(json.dumps(kubeconfig(pki, self.server), indent=2))
        kc = str(self.kubeconfig)
        try:
            self.spawn(
                "etcd",
                [
                    "etcd",
                    f"--data-dir={self.workdir / 'etcd'}",
                    f"--listen-client-urls=http://{HOST}:{etcd_port}",
                    f"--advertise-client-urls=http://{HOST}:{etcd_port}",
                    f"--listen-peer-urls=http://{HOST}:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://{HOST}:{etcd_peer}",
                    f"--initial-cluster=default=http://{HOST}:{etcd_peer}",
                    "--unsafe-no-fsync",  # test data only; fsync dominates startup on slow disks
                    "--log-level=warn",
                ],
            )
            self.spawn(
                "kube-apiserver",
                [
                    "kube-apiserver",
                    f"--etcd-servers=http://{HOST}:{etcd_port}",
                    f"--bind-address={HOST}",
                    f"--advertise-address={HOST}",
                    f"--secure-port={self.api_port}",
                    f"--tls-cert-file={pki / 'apiserver.crt'}",
                    f"--tls-private-key-file={pki / 'apiserver.key'}",
                    f"--client-ca-file={pki / 'ca.crt'}",
                    f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                    f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                    f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                    "--kubelet-preferred-address-types=InternalIP",
                    f"--service-account-key-file={pki / 'sa.pub'}",
                    f"--service-account-signing-key-file={pki / 'sa.key'}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    "--api-audiences=https://kubernetes.default.svc",
                    "--authorization-mode=Node,RBAC",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--allow-privileged=true",
                    "--enable-priority-and-fairness=false",
                    "--endpoint-reconciler-type=none",
                    # With `audit`: every write to the objects the operator acts on, with who sent it and when
                    # it landed, what the HA test reads to show that two replicas never act at once. Off
                    # otherwise: each audited write waits for its line, which slows every other tier's writes.
                    *(
                        [
                            f"--audit-policy-file={self._audit_policy()}",
                            f"--audit-log-path={self.audit_log}",
                            "--audit-log-format=json",
                        ]
                        if self.audit
                        else []
                    ),
                    "--v=1",
                ],
            )
            self._wait_ready(timeout - (time.monotonic() - started))
            self.spawn(
                "kube-controller-manager",
                [
                    "kube-controller-manager",
                    *self._controller_flags(kc),
                    f"--service-account-private-key-file={pki / 'sa.key'}",
                    f"--root-ca-file={pki / 'ca.crt'}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    *([f"--node-monitor-grace-period={self.node_grace_seconds:g}s"] if self.node_grace_seconds else []),
                    "--v=1",
                ],
            )
            self.spawn(
                "kube-scheduler",
                ["kube-scheduler", *self._controller_flags(kc), "--v=1"],
            )
            self.spawn(
                "kwok",
                [
                    "kwok",
                    f"--kubeconfig={kc}",
                    f"--config={self._kwok_stages()}",
                    "--manage-nodes-with-label-selector=type=kwok",
                    f"--cidr={POD_CIDR}",
                    f"--node-ip={HOST}",
                    f"--server-address={HOST}:{free_port()}",
                ],
            )
            for i in range(self.gpu_nodes):
                self.add_gpu_node(f"gpu-node-{i}")
            for i in range(self.static_volumes):
                self.add_volume(f"local-pv-{i}")
            self._wait_nodes_ready(timeout - (time.monotonic() - started))
        except BaseException:
            self.stop()
            raise
        return self

    def admin_tls(self) -> ssl.SSLContext:
        """TLS as the cluster admin (its client certificate), trusting the cluster's CA: made once, as tests
        poll through `api` several times a second and each load parses the CA and the key again."""
        if self._tls is None:
            ctx = ssl.create_default_context(cafile=str(self.workdir / "pki" / "ca.crt"))
            ctx.load_cert_chain(self.workdir / "pki" / "admin.crt", self.workdir / "pki" / "admin.key")
            self._tls = ctx
        return self._tls

    def api(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json") -> dict:
        """One JSON request to the API server as the cluster admin (PATCH: pass a patch content type)."""
        ctx = self.admin_tls()
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.server + path, data=data, method=method, headers={"Content-Type": content_type}
        )
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()}

    def add_gpu_node(
        self,
        name: str,
        capacity: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        taints: list[dict[str, str]] | None = None,
    ) -> None:
        """Register a KWOK-managed node that advertises `nvidia.com/gpu` capacity (with `labels` and `taints`:
        a pool only the tests that tolerate it use)."""
        cap = capacity or GPU_NODE_CAPACITY
        self.api(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {
                        "type": "kwok",
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "nvidia.com/gpu.present": "true",
                        **(labels or {}),
                    },
                    "annotations": {"kwok.x-k8s.io/node": "fake"},
                },
                "spec": {"taints": taints or []},
                "status": {"capacity": cap, "allocatable": cap},
            },
        )

    def add_volume(self, name: str, size: str = "100Gi", *, nodes: Sequence[str] = (),
                   claim: tuple[str, str] | None = None) -> Path:  # fmt: skip
        """A pre-provisioned PersistentVolume, a directory of this host's, returned: hostPath, which claims
        without a storage class bind to; with `nodes`, a `local` volume only those (real) nodes mount, to which
        the kubelet's local-volume plugin applies the pod's fsGroup as it does on a cluster. `claim`
        (namespace, name) reserves it for that claim."""
        path = self.workdir / "volumes" / name
        path.mkdir(parents=True, exist_ok=True)
        spec: dict = {"capacity": {"storage": size}, "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                      "persistentVolumeReclaimPolicy": "Retain", "storageClassName": ""}  # fmt: skip
        if nodes:
            spec["local"] = {"path": str(path)}
            spec["nodeAffinity"] = {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": list(nodes)}]}]}}  # fmt: skip
        else:
            spec["hostPath"] = {"path": str(path), "type": "DirectoryOrCreate"}
        if claim is not None:
            spec["claimRef"] = {"namespace": claim[0], "name": claim[1]}
        self.api("POST", "/api/v1/persistentvolumes", {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "labels": {"local.sharded.dev/pool": "static"}}, "spec": spec,
        })  # fmt: skip
        return path

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} during startup:\n{self.log_tail(name)}")
            try:
                if self.api("GET", "/readyz").get("raw") == "ok":
                    return
            except Exception as e:  # not listening yet, or a check still failing
                last = str(e)
            time.sleep(0.5)
        raise TimeoutError(f"kube-apiserver not ready after {timeout:.0f}s: {last}")

    def _wait_nodes_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            nodes = self.api("GET", "/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
            ready = [
                n
                for n in nodes
                if any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", []))
            ]
            if len(ready) >= self.gpu_nodes:
                return
            time.sleep(0.5)
        raise TimeoutError(f"KWOK nodes not Ready after {timeout:.0f}s; see {self.workdir / 'logs' / 'kwok.log'}")

    def stop(self) -> None:
        """Kill every component (whole process groups), also those of an earlier crashed launcher."""
        stop_dir(self.workdir)
        self.procs.clear()


@contextlib.contextmanager
def running_cluster(gpu_nodes: int = 4, workdir: Path | None = None, audit: bool = False):
    """Context manager: a started cluster, torn down on exit whatever happened inside."""
    tmp = Path(workdir or tempfile.mkdtemp(prefix="sharded-cluster-"))
    cluster = LocalCluster(workdir=tmp, bin_dir=binaries_dir(), gpu_nodes=gpu_nodes, audit=audit)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
