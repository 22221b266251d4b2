"""The pieces of `make kind-e2e` that decide something: the runtime that lets privileged containers start on a
host whose capability bounding set is short, the node image's manifests, and kind's cluster configuration.
`make kind-e2e` itself (a kind cluster, the chart, the quickstart to Succeeded) runs outside the suite."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys

import kindnode
import pytest
import yaml

import images

CAPFILTER = images.CAPFILTER


def _capfilter():
    loader = importlib.machinery.SourceFileLoader("runc_capfilter", str(CAPFILTER))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def test_the_bounding_set_is_read_from_the_status_mask():
    capfilter = _capfilter()
    # The mask of a sandbox that withholds CAP_SYS_RESOURCE (bit 24) and nothing else.
    allowed = capfilter.bounding_set("Name:\tx\nCapBnd:\t000001fffeffffff\nCapAmb:\t0\n")
    assert "CAP_SYS_RESOURCE" not in allowed
    assert {"CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_CHECKPOINT_RESTORE", "CAP_CHOWN"} <= allowed
    assert len(allowed) == 40
    assert capfilter.bounding_set("CapBnd:\t0000000000000001\n") == {"CAP_CHOWN"}


def test_only_capabilities_outside_the_set_are_dropped_from_every_list():
    capfilter = _capfilter()
    process = {"capabilities": {kind: ["CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_KILL"]
                                for kind in ("bounding", "effective", "permitted", "inheritable")},
               "args": ["sh"]}  # fmt: skip
    dropped = capfilter.filter_process(process, {"CAP_SYS_ADMIN", "CAP_KILL"})
    assert dropped == ["CAP_SYS_RESOURCE"]
    assert all(caps == ["CAP_SYS_ADMIN", "CAP_KILL"] for caps in process["capabilities"].values())
    assert capfilter.filter_process({"args": ["sh"]}, set()) == []  # no capabilities: nothing to do


@pytest.fixture
def fake_runc(tmp_path):
    """A `runc` first on PATH that prints its arguments, for the filter to exec into."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    runc = bin_dir / "runc"
    runc.write_text('#!/bin/sh\necho "runc $*"\n')
    runc.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_create_and_exec_reach_runc_with_only_what_this_host_can_grant(tmp_path, fake_runc):
    """The filter run as dockerd runs it: a bundle's config.json (create) and a process file (exec) asking for
    a capability no kernel has lose it and keep the rest of what this host's bounding set holds."""
    capfilter = _capfilter()
    with open("/proc/self/status") as f:
        here = capfilter.bounding_set(f.read())
    asked = ["CAP_CHOWN", "CAP_SYS_RESOURCE", "CAP_NOT_A_CAPABILITY"]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {
        "args": ["sh"], "capabilities": {"bounding": asked, "effective": asked}}}))  # fmt: skip
    (tmp_path / "process.json").write_text(json.dumps({"args": ["ls"], "capabilities": {"permitted": asked}}))

    def run(*args: str) -> str:
        out = subprocess.run([sys.executable, str(CAPFILTER), *args], env=fake_runc, capture_output=True, text=True,
                             check=True)  # fmt: skip
        return out.stdout

    argv = ["--root", "/run/x", "create", "--bundle", str(bundle), "ctr1"]
    assert run(*argv) == f"runc {' '.join(argv)}\n"
    expected = [c for c in asked if c in here]
    assert "CAP_NOT_A_CAPABILITY" not in expected and "CAP_CHOWN" in expected
    spec = json.loads((bundle / "config.json").read_text())
    assert spec["process"]["capabilities"] == {"bounding": expected, "effective": expected}
    assert spec["ociVersion"] == "1.0.2"
    run("exec", "--process", str(tmp_path / "process.json"), "ctr1")
    assert json.loads((tmp_path / "process.json").read_text())["capabilities"] == {"permitted": expected}


def test_dockerd_gets_the_filter_as_its_default_runtime_only_where_the_set_is_short(monkeypatch, tmp_path):
    monkeypatch.setattr(images, "CACHE", tmp_path)
    monkeypatch.setattr(images, "bounding_set_complete", lambda: True)
    assert images.dockerd_runtime_args() == []
    monkeypatch.setattr(images, "bounding_set_complete", lambda: False)
    args = images.dockerd_runtime_args()
    assert args == ["--add-runtime", f"capfilter={tmp_path / 'runc-capfilter'}", "--default-runtime", "capfilter"]
    assert os.access(tmp_path / "runc-capfilter", os.X_OK)
    assert (tmp_path / "runc-capfilter").read_bytes() == CAPFILTER.read_bytes()


def _storage_manifest(version: str) -> str:
    """The parts of local-path-provisioner's deploy/local-path-storage.yaml the node image rewrites."""
    return f"""apiVersion: apps/v1
kind: Deployment
spec:
  template:
    spec:
      containers:
        - name: local-path-provisioner
          image: rancher/local-path-provisioner:{version}
          imagePullPolicy: IfNotPresent
---
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: local-path
provisioner: rancher.io/local-path
---
kind: ConfigMap
data:
  helperPod.yaml: |-
    spec:
      containers:
      - name: helper-pod
        image: busybox
        imagePullPolicy: IfNotPresent
"""


def test_the_manifests_name_only_local_images_and_the_default_class_is_standard(tmp_path):
    bin_dir, rootfs = tmp_path / "bin", tmp_path / "rootfs"
    bin_dir.mkdir()
    (bin_dir / "local-path-storage.yaml").write_text(
        _storage_manifest(kindnode.VERSIONS["LOCAL_PATH_PROVISIONER_VERSION"])
    )
    kindnode.manifests(rootfs, bin_dir, "sharded-local/kind-components:abc")
    storage = list(yaml.safe_load_all((rootfs / "kind/manifests/default-storage.yaml").read_text()))
    container = storage[0]["spec"]["template"]["spec"]["containers"][0]
    assert (container["image"], container["imagePullPolicy"]) == ("sharded-local/kind-components:abc", "Never")
    assert storage[1]["metadata"] == {"name": "standard", "annotations": {
        "storageclass.kubernetes.io/is-default-class": "true"}}  # fmt: skip
    helper = yaml.safe_load(storage[2]["data"]["helperPod.yaml"])["spec"]["containers"][0]
    assert helper["image"] == "sharded-local/kind-components:abc"
    cni = list(yaml.safe_load_all((rootfs / "kind/manifests/default-cni.yaml").read_text()))
    daemonset = next(d for d in cni if d["kind"] == "DaemonSet")
    assert daemonset["spec"]["template"]["spec"]["containers"][0]["image"] == "sharded-local/kind-components:abc"
    assert "COMPONENTS_IMAGE" not in (rootfs / "kind/manifests/default-cni.yaml").read_text()


def test_a_provisioner_manifest_that_changed_shape_stops_the_build_naming_what_is_missing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "local-path-storage.yaml").write_text(_storage_manifest("v9.9.9"))
    with pytest.raises(RuntimeError, match="has no 'image: rancher/local-path-provisioner:v0"):
        kindnode.manifests(tmp_path / "rootfs", bin_dir, "img")


@pytest.mark.parametrize("short_set", [False, True])
def test_the_cluster_configuration_points_kubeadm_at_the_local_images(monkeypatch, tmp_path, short_set):
    monkeypatch.setattr(images, "CACHE", tmp_path)
    monkeypatch.setattr(images, "bounding_set_complete", lambda: not short_set)
    config = yaml.safe_load(kindnode.cluster_config("key").read_text())
    assert config["kind"] == "Cluster" and config["nodes"] == [{"role": "control-plane"}]
    patches = {p["kind"]: p for p in map(yaml.safe_load, config["kubeadmConfigPatches"])}
    cluster = patches["ClusterConfiguration"]
    assert cluster["imageRepository"] == "sharded-local"
    assert cluster["etcd"]["local"]["imageTag"] == kindnode.VERSIONS["ETCD_VERSION"].lstrip("v")
    assert cluster["dns"]["imageTag"] == kindnode.VERSIONS["COREDNS_VERSION"]
    assert ("KubeletConfiguration" in patches) == (not os.path.exists("/sys/fs/cgroup/cgroup.controllers"))
    oom = "restrict_oom_score_adj = true" in "".join(config.get("containerdConfigPatches", []))
    assert oom == short_set


def test_kind_stops_before_any_cluster_when_dockerd_cannot_run_privileged_containers(monkeypatch):
    """A dockerd started by something else, without the filter, on a host whose bounding set is short: every
    kind node would fail in runc, so the run stops first, saying what to do."""
    monkeypatch.setattr(images, "ensure_dockerd", lambda: None)
    monkeypatch.setattr(images, "bounding_set_complete", lambda: False)
    monkeypatch.setattr(images, "docker", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="runc\n"))
    with pytest.raises(SystemExit, match="default runtime is 'runc': stop dockerd and run this again"):
        kindnode.ensure_privileged_runs()
    monkeypatch.setattr(images, "docker", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout="capfilter\n"))
    kindnode.ensure_privileged_runs()  # the filter in place: on to the cluster
    monkeypatch.setattr(images, "bounding_set_complete", lambda: True)
    monkeypatch.setattr(images, "docker", lambda *a, **k: pytest.fail("a complete set needs no runtime check"))
    kindnode.ensure_privileged_runs()
