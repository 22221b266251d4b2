"""The local control plane is a real Kubernetes: scheduling, GPUs, garbage collection, validation."""

from __future__ import annotations

import subprocess

import pytest
from kubernetes.client.rest import ApiException

from conftest import wait_for

pytestmark = pytest.mark.integration


def gpu_pod(name: str, gpus: int, annotations: dict | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "busybox",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
    }


def test_gpu_pod_is_scheduled_on_a_fake_gpu_node_and_runs(core, namespace):
    core.create_namespaced_pod(namespace, gpu_pod("two-gpus", 2))
    pod = wait_for(
        lambda: (p := core.read_namespaced_pod("two-gpus", namespace)).status.phase == "Running" and p,
        timeout=30,
        what="pod Running",
    )
    assert pod.spec.node_name.startswith("gpu-node-")
    node = core.read_node(pod.spec.node_name)
    assert node.status.allocatable["nvidia.com/gpu"] == "8"
    assert pod.status.pod_ip  # KWOK assigned an address from the pod CIDR


def test_pod_asking_more_gpus_than_any_node_stays_pending_with_the_schedulers_reason(core, namespace):
    core.create_namespaced_pod(namespace, gpu_pod("too-many", 9))

    def unschedulable():
        pod = core.read_namespaced_pod("too-many", namespace)
        cond = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
        return cond and cond.status == "False" and cond

    cond = wait_for(unschedulable, timeout=30, what="PodScheduled=False")
    assert cond.reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in cond.message
    assert core.read_namespaced_pod("too-many", namespace).status.phase == "Pending"


def test_deleting_an_owner_garbage_collects_its_dependents(core, namespace):
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}, "data": {}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "dependent", "ownerReferences": [ref]}, "data": {}}
    )
    core.delete_namespaced_config_map("owner", namespace)

    def gone():
        try:
            core.read_namespaced_config_map("dependent", namespace)
        except ApiException as e:
            return e.status == 404
        return False

    wait_for(gone, timeout=60, what="dependent garbage-collected")


def test_api_server_rejects_an_invalid_object(core, namespace):
    bad = gpu_pod("Not_A_Valid_Name", 1)
    with pytest.raises(ApiException) as exc:
        core.create_namespaced_pod(namespace, bad)
    assert exc.value.status == 422
    assert "metadata.name" in exc.value.body


def test_kwok_stage_ends_an_annotated_pod_with_its_exit_code(core, namespace):
    """The pod-exit stage tests use to play out a trainer's failure: exit code and reason land in status."""
    core.create_namespaced_pod(namespace, gpu_pod("exits", 1))
    wait_for(lambda: core.read_namespaced_pod("exits", namespace).status.phase == "Running", what="Running")
    core.patch_namespaced_pod(
        "exits",
        namespace,
        {"metadata": {"annotations": {"kwok.sharded.dev/exit-code": "137", "kwok.sharded.dev/reason": "OOMKilled"}}},
    )
    pod = wait_for(
        lambda: (p := core.read_namespaced_pod("exits", namespace)).status.phase == "Failed" and p,
        what="pod Failed",
    )
    term = pod.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason) == (137, "OOMKilled")


def test_kubectl_from_the_build_talks_to_the_cluster(cluster):
    out = subprocess.run(
        [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "get", "nodes", "-o", "name"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert out.split() == [f"node/gpu-node-{i}" for i in range(4)]


def test_a_crd_installed_is_in_discovery_before_install_crd_returns(cluster, api_client):
    """A controller started right after `install_crd` maps its kinds through the aggregated discovery
    document; one that read it before the CRD was listed exits with `no matches for kind`."""
    from kubernetes import client

    from localstack.stack import discovered_versions, install_crd

    group, plural = "probe.sharded.dev", "discoveryprobes"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group, "scope": "Namespaced",
            "names": {"plural": plural, "singular": "discoveryprobe", "kind": "DiscoveryProbe"},
            "versions": [{"name": name, "served": True, "storage": name == "v1", "schema": {
                "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}
                for name in ("v1", "v1beta1")],
        },
    }  # fmt: skip
    try:
        install_crd(cluster.kubeconfig, crd)
        assert discovered_versions(api_client, group, plural) == {"v1", "v1beta1"}
        # kubectl maps the resource by the same document, with no retry of its own.
        out = subprocess.run(
            [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "get",
             f"{plural}.v1beta1.{group}", "-A", "-o", "name"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    finally:
        client.ApiextensionsV1Api(api_client).delete_custom_resource_definition(crd["metadata"]["name"])
    assert discovered_versions(api_client, "kueue.x-k8s.io.invalid", "workloads") == set()
