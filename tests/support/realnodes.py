"""What the realnode tier's modules share (a pytest plugin of tests/conftest.py): a control plane per module
with two nodes run by the real kubelet (a node starts in seconds, its images kept between runs by
localstack/nodeimages.py; per module, so that idle kubelets do not run on beside the rest of the lane), a
restricted namespace, and a pod's log as `kubectl logs` reads it."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from localstack import cluster as localcluster
from localstack.nodeimages import probe_image
from localstack.realnode import RealNode

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}  # fmt: skip


def logs(node: RealNode, ns: str, name: str, *extra: str) -> str:
    """A container's log as `kubectl logs` reads it: through the API server, from the kubelet's TLS server."""
    cluster = node.cluster
    out = subprocess.run([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "-n", ns,
                          "logs", name, *extra], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def restricted_namespace(node: RealNode) -> str:
    """A new namespace enforcing Pod Security `restricted`, as a multi-tenant cluster's are, once its default
    ServiceAccount exists: the API server's admission refuses any pod of the operator's that asks for more."""
    name = f"rn-{uuid.uuid4().hex[:6]}"
    node.cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": name, "labels": RESTRICTED}})
    deadline = time.monotonic() + 30
    while not node.cluster.api("GET", f"/api/v1/namespaces/{name}/serviceaccounts")["items"]:
        assert time.monotonic() < deadline, "the default ServiceAccount was not made"
        time.sleep(0.2)
    return name


@pytest.fixture(scope="module")
def node():
    with localcluster.running_cluster(gpu_nodes=0) as cluster:
        real = RealNode(cluster, 1)
        try:
            yield real.start([probe_image()])
        finally:
            real.stop()


@pytest.fixture(scope="module")
def second_node(node):
    """Another real node of the same cluster: its own kubelet, containerd and pod subnet."""
    real = RealNode(node.cluster, 2)
    try:
        yield real.start([probe_image()])
    finally:
        real.stop()
