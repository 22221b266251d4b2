"""A job is one Kueue workload, against a real Kueue controller (its webhooks included) on the local control
plane: Kueue admits all of a job's pods at once, or none of them, and a job that does not fit the quota
waits whole until it does."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

import pytest
from kubernetes.client.rest import ApiException

from conftest import wait_for
from localstack.kueue import KUEUE_API, MANAGED_LABEL, LocalKueue, can_run
from sharded_operator.api.models import GROUP, PLURAL, VERSION, training_pods
from support.jobs import make_job

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not can_run(), reason="Kueue runs in a private mount namespace: needs root"),
]
KUEUE = KUEUE_API
GATE = "kueue.x-k8s.io/admission"


@pytest.fixture(scope="module")
def kueue(cluster, crd_installed):
    k = LocalKueue(cluster, Path(tempfile.mkdtemp(prefix="kueue-"))).start()
    yield k
    k.stop()


@pytest.fixture
def queue(cluster, kueue, namespace, core, custom, operator):
    """A namespace Kueue manages, with a LocalQueue onto a ClusterQueue of 8 GPUs."""
    core.patch_namespace(namespace, {"metadata": {"labels": {MANAGED_LABEL: "true"}}})
    cluster.api("POST", f"/apis/{KUEUE}/resourceflavors", {"apiVersion": KUEUE, "kind": "ResourceFlavor",
                                                           "metadata": {"name": f"{namespace}-flavor"}})  # fmt: skip
    quota = [{"name": r, "nominalQuota": q} for r, q in (("cpu", "100"), ("memory", "1Ti"), ("nvidia.com/gpu", "8"))]
    cluster.api("POST", f"/apis/{KUEUE}/clusterqueues", {
        "apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": f"{namespace}-gpus"},
        "spec": {"namespaceSelector": {}, "resourceGroups": [{
            "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
            "flavors": [{"name": f"{namespace}-flavor", "resources": quota}]}]},
    })  # fmt: skip
    cluster.api("POST", f"/apis/{KUEUE}/namespaces/{namespace}/localqueues", {
        "apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": "team"},
        "spec": {"clusterQueue": f"{namespace}-gpus"},
    })  # fmt: skip
    yield "team"
    # Kueue holds its finalizer on a pod until the pod is terminal; a kubelet makes a deleted pod terminal,
    # KWOK's stages do not. Without this, pods left Terminating would keep their GPUs from every later test.
    for job in custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]:
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job["metadata"]["name"])
    for pod in core.list_namespaced_pod(namespace).items:
        kept = [f for f in pod.metadata.finalizers or [] if not f.startswith("kueue.x-k8s.io/")]
        try:
            core.patch_namespaced_pod(pod.metadata.name, namespace, {"metadata": {"finalizers": kept or None}})
        except ApiException as e:
            if e.status != 404:  # gone already: the garbage collector was quicker
                raise
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, timeout=60, what="the queue's pods gone")
    for path in (f"clusterqueues/{namespace}-gpus", f"resourceflavors/{namespace}-flavor"):
        with contextlib.suppress(OSError):
            cluster.api("DELETE", f"/apis/{KUEUE}/{path}")


def submit(custom, namespace: str, name: str, gpus: int, queue: str) -> None:
    body = make_job(name).nodes(2).gpus(gpus).spec("scheduling.queueName", queue).obj()
    body["metadata"] = {"name": name}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def pods_of(core, namespace: str, name: str) -> list:
    return core.list_namespaced_pod(namespace, label_selector=training_pods(name)).items


def gated(pod) -> bool:
    return any(g.name == GATE for g in pod.spec.scheduling_gates or [])


def test_kueue_admits_a_jobs_pods_together_or_not_at_all(cluster, kueue, queue, namespace, core, custom, operator):
    # 2 nodes x 4 GPUs fills the 8-GPU queue: both pods are admitted together and run.
    submit(custom, namespace, "first", 4, queue)

    def both_running(name):
        pods = pods_of(core, namespace, name)
        return len(pods) == 2 and all(p.status.phase == "Running" and not gated(p) for p in pods) and pods

    wait_for(lambda: both_running("first"), timeout=60, what="first job admitted and running")
    workloads = cluster.api("GET", f"/apis/{KUEUE}/namespaces/{namespace}/workloads")["items"]
    assert len(workloads) == 1, [w["metadata"]["name"] for w in workloads]  # one workload for the whole gang
    admission = workloads[0]["status"]["admission"]
    assert admission["podSetAssignments"][0]["count"] == 2, admission

    # A second job of the same size does not fit: Kueue holds both of its pods at the gate, none runs.
    submit(custom, namespace, "second", 4, queue)
    wait_for(lambda: len(pods_of(core, namespace, "second")) == 2, timeout=30, what="second job's pods")
    for _ in range(10):  # the whole time the first job holds the quota
        pods = pods_of(core, namespace, "second")
        assert all(gated(p) and p.status.phase == "Pending" for p in pods), [(p.metadata.name, p.status.phase)
                                                                               for p in pods]  # fmt: skip
        time.sleep(0.5)
    status = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "second")["status"]
    assert status["phase"] in ("Pending", "Starting") and status.get("restarts", 0) == 0, status

    # The first job finishes and frees its quota: the second is admitted, both of its pods at once.
    for p in pods_of(core, namespace, "first"):
        core.patch_namespaced_pod(p.metadata.name, namespace,
                                  {"metadata": {"annotations": {"kwok.sharded.dev/exit-code": "0"}}})  # fmt: skip
    wait_for(lambda: both_running("second"), timeout=90, what="second job admitted once the first finished")
    first = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "first")["status"]
    assert first["phase"] == "Succeeded"
