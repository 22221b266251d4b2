"""A real Kueue controller on the local control plane: its CRDs, its webhooks and the manager itself, as
its own release ships them, with two local changes a cluster does not need:

- the webhooks are served on loopback and called by URL with our CA's bundle (no Service, no cert-manager);
  the pod webhooks act only in namespaces labelled `kueue-managed=true`, so a stopped Kueue never blocks
  pod creation elsewhere;
- Kueue reads its metrics certificate from the fixed path /etc/kueue/metrics/certs when it does not manage
  certificates itself: it runs in a private mount namespace where a tmpfs holds ours there (root only).

Binary, CRDs and webhook manifests come from the `sigs.k8s.io/kueue` Go module (hack/build-binaries.sh).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import os
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from localstack import cluster as localcluster
from localstack.stack import install_crd

MANAGED_LABEL = "kueue-managed"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
METRICS_CERTS = "/etc/kueue/metrics/certs"
# The webhooks of the integrations used here: plain pods (pod groups) and Kueue's own objects.
WEBHOOK_RESOURCES = {"pods", "workloads", "clusterqueues", "localqueues", "resourceflavors", "cohorts"}


def can_run() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


class LocalKueue:
    """Kueue's manager as a process against a LocalCluster, until stop()."""

    def __init__(self, cluster: localcluster.LocalCluster, workdir: Path):
        self.cluster, self.workdir = cluster, workdir
        self.config_dir = cluster.bin_dir / "kueue-config"  # CRDs and webhook manifests of the built version
        self.proc: subprocess.Popen | None = None
        self.health_port = localcluster.free_port()
        self.webhook_port = localcluster.free_port()

    def start(self, timeout: float = 90) -> LocalKueue:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for crd in sorted((self.config_dir / "crd").glob("*.yaml")):  # Kueue's informers need every kind served
            install_crd(self.cluster.kubeconfig, yaml.safe_load(crd.read_text()))
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        pki = self.cluster.workdir / "pki"
        shutil.copy(pki / "webhook.crt", certs / "tls.crt")
        shutil.copy(pki / "webhook.key", certs / "tls.key")
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration", "namespace": "kueue-system",
            "health": {"healthProbeBindAddress": f"{localcluster.HOST}:{self.health_port}"},
            "metrics": {"bindAddress": f"{localcluster.HOST}:{localcluster.free_port()}"},
            "webhook": {"host": localcluster.HOST, "port": self.webhook_port, "certDir": str(certs)},
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "manageJobsWithoutQueueName": False,
            "managedJobsNamespaceSelector": {"matchLabels": {MANAGED_LABEL: "true"}},
            "integrations": {"frameworks": ["pod"]},
        }  # fmt: skip
        (self.workdir / "config.yaml").write_text(yaml.safe_dump(config))
        binary = self.cluster.bin_dir / "kueue"
        script = (
            f"mkdir -p {METRICS_CERTS} && mount -t tmpfs -o size=1m kueue-certs {METRICS_CERTS} && "
            f"cp {shlex.quote(str(certs))}/tls.* {METRICS_CERTS}/ && "
            f"exec {shlex.quote(str(binary))} --config={shlex.quote(str(self.workdir / 'config.yaml'))} "
            "--feature-gates=VisibilityOnDemand=false --zap-log-level=2"
        )
        log = open(self.workdir / "kueue.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig)},
        )  # fmt: skip
        self._wait_ready(timeout)
        for webhook in self._webhook_configurations():
            self._apply(f"/apis/admissionregistration.k8s.io/v1/{webhook['kind'].lower()}s", webhook)
        return self

    def stop(self) -> None:
        for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations"):
            with contextlib.suppress(OSError):
                self.cluster.api("DELETE", f"/apis/admissionregistration.k8s.io/v1/{kind}/local-kueue")
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._release_finalizers()

    def _release_finalizers(self) -> None:
        """Take Kueue's finalizers off what it leaves behind. Kueue removes them itself once a workload
        is done, but a namespace deleted just before Kueue stops still holds workloads and queues that only
        Kueue would have let go: without this they, and their namespace, stay Terminating for good."""
        kinds = [(f"/apis/{KUEUE_API}", plural) for plural in ("workloads", "localqueues", "clusterqueues",
                                                               "resourceflavors")]  # fmt: skip
        for prefix, plural in [*kinds, ("/api/v1", "pods")]:
            with contextlib.suppress(OSError):
                for item in self.cluster.api("GET", f"{prefix}/{plural}").get("items", []):
                    meta = item["metadata"]
                    kept = [f for f in meta.get("finalizers") or [] if not f.startswith("kueue.x-k8s.io/")]
                    if kept == (meta.get("finalizers") or []):
                        continue
                    where = f"namespaces/{meta['namespace']}/" if meta.get("namespace") else ""
                    patch = {"metadata": {"finalizers": kept or None, "resourceVersion": meta["resourceVersion"]}}
                    with contextlib.suppress(OSError):  # changed or gone meanwhile: nothing of Kueue's to keep
                        self.cluster.api("PATCH", f"{prefix}/{where}{plural}/{meta['name']}", patch,
                                         content_type="application/merge-patch+json")  # fmt: skip

    def log(self) -> str:
        return (self.workdir / "kueue.log").read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"kueue exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://{localcluster.HOST}:{self.health_port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"kueue not ready after {timeout}s:\n{self.log()[-3000:]}")

    def _webhook_configurations(self) -> list[dict]:
        """Kueue's webhooks for pods and its own objects, called at our loopback URL with our CA."""
        ca = base64.b64encode((self.cluster.workdir / "pki" / "ca.crt").read_bytes()).decode()
        out = []
        for doc in yaml.safe_load_all((self.config_dir / "webhook" / "manifests.yaml").read_text()):
            if not doc or "webhooks" not in doc:
                continue
            doc = copy.deepcopy(doc)
            doc["metadata"] = {"name": "local-kueue"}
            hooks = []
            for hook in doc["webhooks"]:
                if not {r for rule in hook["rules"] for r in rule["resources"]} & WEBHOOK_RESOURCES:
                    continue
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://{localcluster.HOST}:{self.webhook_port}{path}", "caBundle": ca}
                if any("pods" in rule["resources"] for rule in hook["rules"]):
                    hook["namespaceSelector"] = {"matchLabels": {MANAGED_LABEL: "true"}}
                hooks.append(hook)
            doc["webhooks"] = hooks
            out.append(doc)
        return out

    def _apply(self, collection: str, body: dict) -> None:
        try:
            self.cluster.api("POST", collection, body)
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise
