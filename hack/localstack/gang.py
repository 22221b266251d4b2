"""The real gang schedulers on the local control plane, as their releases run them: Volcano's scheduler and
controller manager, and a kube-scheduler built with the scheduler-plugins coscheduling plugin as a second
scheduler (the way the scheduler-plugins chart installs it, under its own name).

Binaries, CRDs and Volcano's scheduler configuration come from the `volcano.sh/volcano` and
`sigs.k8s.io/scheduler-plugins` Go modules at the versions of hack/versions.env (hack/build-binaries.sh).
Each runs as a component of the cluster (its pid file under the cluster's workdir), so a crashed test run
leaves nothing behind: the cluster's stop() ends them too. Neither needs a webhook for PodGroups the
operator creates: Volcano's admission webhooks validate its own Jobs and default a pod's scheduler only
when asked to, so they are not run here.
"""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from localstack import cluster as localcluster
from localstack.stack import install_crd
from sharded_operator.render.podgroup import VOLCANO_API, VOLCANO_SCHEDULER

COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"  # the scheduler-plugins chart's second scheduler


def wait_until(cluster: localcluster.LocalCluster, ready, timeout: float, what: str, components: tuple[str, ...]):
    """Poll `ready()` until true; fail at once, with its log's tail, if one of the cluster's `components` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in components:
            proc = cluster.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{cluster.log_tail(name)}")
        if ready():
            return
        time.sleep(0.3)
    tails = "\n".join(f"--- {name}\n{cluster.log_tail(name)}" for name in components)
    raise TimeoutError(f"{what}: not after {timeout:.0f}s\n{tails}")


class LocalVolcano:
    """vc-scheduler and vc-controller-manager against a LocalCluster, until stop()."""

    def __init__(self, cluster: localcluster.LocalCluster, schedule_period: str = "500ms"):
        self.cluster, self.schedule_period = cluster, schedule_period
        self.config = cluster.bin_dir / "volcano-config"  # CRDs and the chart's scheduler.conf of the version

    def start(self, timeout: float = 60) -> LocalVolcano:
        for crd in sorted((self.config / "crd").glob("*.yaml")):  # the scheduler informs on every kind
            install_crd(self.cluster.kubeconfig, yaml.safe_load(crd.read_text()))
        kc = f"--kubeconfig={self.cluster.kubeconfig}"
        # The queue controller opens queues (the proportion plugin schedules only in an open one); the podgroup
        # controller is what a Volcano install runs beside it.
        self.cluster.spawn("vc-controller-manager", [
            "vc-controller-manager", kc, "--controllers=queue-controller,pg-controller", "--leader-elect=false",
            f"--listen-address={localcluster.HOST}:{localcluster.free_port()}",
            f"--healthz-address={localcluster.HOST}:{localcluster.free_port()}", "-v=2",
        ])  # fmt: skip
        self.cluster.spawn("vc-scheduler", [
            "vc-scheduler", kc, f"--scheduler-conf={self.config / 'volcano-scheduler.conf'}",
            f"--scheduler-name={VOLCANO_SCHEDULER}", f"--schedule-period={self.schedule_period}",
            "--leader-elect=false", f"--listen-address={localcluster.HOST}:{localcluster.free_port()}",
            f"--healthz-address={localcluster.HOST}:{localcluster.free_port()}", "-v=2",
        ])  # fmt: skip
        # Ready when the scheduler has made its default queue and the controller has opened it.
        wait_until(
            self.cluster, lambda: self._queue_state("default") == "Open", timeout, "Volcano's default queue open",
            ("vc-scheduler", "vc-controller-manager"),
        )  # fmt: skip
        return self

    def _queue_state(self, name: str) -> str | None:
        try:
            queue = self.cluster.api("GET", f"/apis/{VOLCANO_API}/queues/{name}")
        except OSError:
            return None
        return (queue.get("status") or {}).get("state")

    def open_queue(self, name: str, timeout: float = 30) -> None:
        """A Queue of that name (created if missing), once the controller has opened it."""
        try:
            self.cluster.api("POST", f"/apis/{VOLCANO_API}/queues", {
                "apiVersion": VOLCANO_API, "kind": "Queue", "metadata": {"name": name},
                "spec": {"weight": 1, "reclaimable": True},
            })  # fmt: skip
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise
        wait_until(self.cluster, lambda: self._queue_state(name) == "Open", timeout, f"queue {name} open",
                                ("vc-controller-manager",))  # fmt: skip

    def stop(self) -> None:
        """Stop both and remove Volcano's CRDs (and with them its queues and PodGroups): the cluster is as it
        was, for tests that need a PodGroup API to be missing."""
        self.cluster.stop_component("vc-scheduler")
        self.cluster.stop_component("vc-controller-manager")
        uninstall_crds(self.cluster, sorted((self.config / "crd").glob("*.yaml")))


class LocalCoscheduling:
    """scheduler-plugins' kube-scheduler with the Coscheduling plugin, as a second scheduler, until stop()."""

    def __init__(self, cluster: localcluster.LocalCluster, workdir: Path, permit_wait_seconds: int = 60):
        self.cluster, self.workdir, self.permit_wait_seconds = cluster, workdir, permit_wait_seconds
        self.config = cluster.bin_dir / "coscheduling-config"
        self.port = localcluster.free_port()

    def start(self, timeout: float = 60) -> LocalCoscheduling:
        install_crd(self.cluster.kubeconfig, yaml.safe_load((self.config / "crd.yaml").read_text()))
        self.workdir.mkdir(parents=True, exist_ok=True)
        # The plugin's own example configuration (manifests/coscheduling/scheduler-config.yaml), as a profile
        # of its own name beside the cluster's default scheduler.
        config = {
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "leaderElection": {"leaderElect": False},
            "clientConnection": {"kubeconfig": str(self.cluster.kubeconfig)},
            "profiles": [{
                "schedulerName": COSCHEDULING_SCHEDULER,
                "plugins": {"multiPoint": {"enabled": [{"name": "Coscheduling"}]},
                            "queueSort": {"enabled": [{"name": "Coscheduling"}], "disabled": [{"name": "*"}]}},
                "pluginConfig": [{"name": "Coscheduling",
                                  "args": {"permitWaitingTimeSeconds": self.permit_wait_seconds}}],
            }],
        }  # fmt: skip
        path = self.workdir / "coscheduling.yaml"
        path.write_text(yaml.safe_dump(config))
        kc = self.cluster.kubeconfig
        self.cluster.spawn("coscheduler", [
            "coscheduler", f"--config={path}", f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}", f"--bind-address={localcluster.HOST}", f"--secure-port={self.port}",
            "--v=2",
        ])  # fmt: skip
        wait_until(self.cluster, self._healthy, timeout, "the coscheduling scheduler healthy", ("coscheduler",))
        return self

    def _healthy(self) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # its self-signed serving certificate
        try:
            with urllib.request.urlopen(f"https://{localcluster.HOST}:{self.port}/healthz", context=ctx,
                                        timeout=2) as r:  # fmt: skip
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.cluster.stop_component("coscheduler")
        uninstall_crds(self.cluster, [self.config / "crd.yaml"])


def uninstall_crds(cluster: localcluster.LocalCluster, files: list[Path], timeout: float = 60) -> None:
    """Delete the CRDs of `files` and wait until the API server no longer serves them."""
    names = [yaml.safe_load(f.read_text())["metadata"]["name"] for f in files]
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    for name in names:
        try:
            cluster.api("DELETE", f"{path}/{name}")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise

    def gone() -> bool:
        served = {c["metadata"]["name"] for c in cluster.api("GET", path)["items"]}
        return not served & set(names)

    wait_until(cluster, gone, timeout, "the CRDs removed", ())
