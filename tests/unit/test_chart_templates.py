"""The Helm chart rendered by the real helm binary: what each value changes, and what it must never grant."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import CRD_FILE, ROOT

CHART = ROOT / "charts" / "sharded-training-operator"


@pytest.fixture(scope="module")
def helm() -> str:
    bin_dir = (
        os.environ.get("SHARDED_BIN_DIR")
        or subprocess.run(
            ["bash", str(ROOT / "hack" / "build-binaries.sh")], check=True, capture_output=True, text=True
        ).stdout.split()[-1]
    )
    return str(Path(bin_dir) / "helm")


def render(helm: str, *sets: str) -> list[dict]:
    args = [helm, "template", "op", str(CHART), "-n", "ops", "--kube-version", "1.36.3"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs, kind, namespace=None):
    return [d for d in docs if d["kind"] == kind and (namespace is None or d["metadata"].get("namespace") == namespace)]


def env_of(docs) -> dict:
    container = find(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_helm_lint_passes(helm):
    subprocess.run([helm, "lint", "--strict", str(CHART)], check=True, capture_output=True)


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / CRD_FILE.name).read_text() == CRD_FILE.read_text(), "copy crds/ into the chart"


def test_defaults_are_cluster_wide_and_secure(helm):
    docs = render(helm)
    cluster_rules = find(docs, "ClusterRole")[0]["rules"]
    assert any("pods" in r["resources"] for r in cluster_rules)
    assert not find(docs, "Role")
    pod = find(docs, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = env_of(docs)
    assert env["SHARDED_OPERATOR_NAMESPACES"] == ""
    assert env["SHARDED_OPERATOR_PROGRESS_URL"] == "http://op-sharded-training-operator.ops.svc:8080/progress"
    assert not find(docs, "ServiceMonitor")


def test_watch_namespaces_get_roles_and_the_cluster_role_shrinks(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in find(docs, "RoleBinding")) == ["team-a", "team-b"]
    cluster_resources = {res for r in find(docs, "ClusterRole")[0]["rules"] for res in r["resources"]}
    assert "pods" not in cluster_resources and "nodes" in cluster_resources
    assert env_of(docs)["SHARDED_OPERATOR_NAMESPACES"] == "team-a,team-b"


def test_no_rule_grants_secrets_or_wildcards(helm):
    for docs in (render(helm), render(helm, "watchNamespaces={a}")):
        for role in find(docs, "ClusterRole") + find(docs, "Role"):
            for rule in role["rules"]:
                assert "secrets" not in rule["resources"] and "*" not in rule["resources"]
                assert "*" not in rule["verbs"] and "*" not in rule["apiGroups"]


def test_service_monitor_and_peering(helm):
    docs = render(helm, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")
    sm = find(docs, "ServiceMonitor")[0]
    assert sm["metadata"]["labels"]["release"] == "prom" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    docs = render(helm, "replicaCount=2", "peering.enabled=true")
    assert find(docs, "ClusterKopfPeering")
    assert env_of(docs)["SHARDED_OPERATOR_PEERING"] == "op-sharded-training-operator"
    assert find(docs, "Deployment")[0]["spec"]["replicas"] == 2


@pytest.mark.parametrize(
    "bad,message",
    [
        ("replicaCount=2", "replicaCount > 1 needs peering.enabled=true"),
        ("metrics.port=80", "/metrics/port"),
        ("operator.logFormat=xml", "/operator/logFormat"),
        ("watchNamespace=a", "watchNamespace"),  # a typo is an error, not silently ignored
    ],
)
def test_bad_values_are_refused(helm, bad, message):
    with pytest.raises(subprocess.CalledProcessError) as exc:
        render(helm, bad)
    assert message in exc.value.stderr
