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
    assert (CHART / "files" / "crds" / CRD_FILE.name).read_text() == CRD_FILE.read_text(), "run make crds"


def test_defaults_are_cluster_wide_and_secure(helm):
    docs = render(helm)
    cluster_rules = find(docs, "ClusterRole")[0]["rules"]
    assert any("pods" in r["resources"] for r in cluster_rules)
    assert [r["metadata"]["name"] for r in find(docs, "Role")] == ["op-sharded-training-operator-lease"]
    pod = find(docs, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = env_of(docs)
    assert env["SHARDED_OPERATOR_NAMESPACES"] == ""
    assert env["SHARDED_OPERATOR_PROGRESS_URL"] == "http://op-sharded-training-operator.ops.svc:8081/progress"
    assert {p["name"]: p["port"] for p in find(docs, "Service")[0]["spec"]["ports"]} == {"http": 8080, "progress": 8081}
    assert not find(docs, "ServiceMonitor")


def test_watch_namespaces_get_roles_and_the_cluster_role_shrinks(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    roles = [r for r in find(docs, "Role") if not r["metadata"]["name"].endswith("-lease")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    bindings = [b for b in find(docs, "RoleBinding") if not b["metadata"]["name"].endswith("-lease")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    cluster_resources = {res for r in find(docs, "ClusterRole")[0]["rules"] for res in r["resources"]}
    assert "pods" not in cluster_resources and "nodes" in cluster_resources
    assert env_of(docs)["SHARDED_OPERATOR_NAMESPACES"] == "team-a,team-b"


def test_no_rule_grants_secrets_or_wildcards(helm):
    for docs in (render(helm), render(helm, "watchNamespaces={a}")):
        for role in find(docs, "ClusterRole") + find(docs, "Role"):
            for rule in role["rules"]:
                assert "secrets" not in rule["resources"] and "*" not in rule["resources"]
                assert "*" not in rule["verbs"] and "*" not in rule["apiGroups"]


def test_service_monitor_and_replicas_electing_through_a_lease(helm):
    docs = render(helm, "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")
    sm = find(docs, "ServiceMonitor")[0]
    assert sm["metadata"]["labels"]["release"] == "prom" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["spec"]["endpoints"][0]["honorLabels"]  # the job's namespace label, not the operator pod's
    docs = render(helm, "replicaCount=2")
    env = env_of(docs)
    assert env["SHARDED_OPERATOR_LEASE_NAME"] == "op-sharded-training-operator"
    assert env["SHARDED_OPERATOR_LEASE_NAMESPACE"] == "ops"
    container = find(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    identity = next(e for e in container["env"] if e["name"] == "SHARDED_OPERATOR_IDENTITY")
    assert identity["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"  # distinct per replica
    assert find(docs, "Deployment")[0]["spec"]["replicas"] == 2
    [lease] = [r for r in find(docs, "Role", "ops") if r["metadata"]["name"].endswith("-lease")]
    assert lease["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                               "verbs": ["get", "create", "update"]}]  # fmt: skip


def test_the_network_policy_admits_progress_only_from_training_pods_and_metrics_from_monitoring(helm):
    docs = render(helm)
    [policy] = find(docs, "NetworkPolicy")
    selector = find(docs, "Deployment")[0]["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    progress, metrics = policy["spec"]["ingress"]
    assert progress["ports"] == [{"protocol": "TCP", "port": 8081}]
    assert progress["from"] == [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [
        {"key": "training.sharded.dev/job-name", "operator": "Exists"}]}}]  # fmt: skip
    assert metrics["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert metrics["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    other = render(helm, "networkPolicy.metricsFrom.matchLabels.team=obs", "progress.port=9000")
    [policy] = find(other, "NetworkPolicy")
    assert policy["spec"]["ingress"][0]["ports"][0]["port"] == 9000
    assert policy["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"]["team"] == "obs"
    assert not find(render(helm, "networkPolicy.enabled=false"), "NetworkPolicy")


def test_the_admission_policy_checks_the_submitter_for_each_allowlist_row(helm):
    from sharded_operator.api.allowlist import Allow
    from sharded_operator.api.overrides import ROWS

    [policy] = find(render(helm), "ValidatingAdmissionPolicy")
    [binding] = find(render(helm), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert [v["message"] for v in policy["spec"]["validations"]] == [row.message() for row in ROWS]
    assert all(v["expression"].startswith("variables.canCreatePods || ") for v in policy["spec"]["validations"])
    # The chart's allowlist parameters reach the policy's variables and the operator's settings alike.
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert {k: variables[k] for k in Allow().variables()} == Allow().variables()
    sets = ("podPolicy.annotationPrefixes={prometheus.io/}", "podPolicy.gpuResourceNames={amd.com/gpu}")
    [custom] = find(render(helm, *sets), "ValidatingAdmissionPolicy")
    variables = {v["name"]: v["expression"] for v in custom["spec"]["variables"]}
    assert variables["annotationPrefixes"] == '["prometheus.io/"]' and variables["gpuResources"] == '["amd.com/gpu"]'
    env = env_of(render(helm, "forbidPodOverrides={volumes,labels}", *sets))
    assert env["SHARDED_OPERATOR_FORBID_POD_OVERRIDES"] == "volumes,labels"
    assert env["SHARDED_OPERATOR_ANNOTATION_PREFIXES"] == "prometheus.io/"
    assert env["SHARDED_OPERATOR_GPU_RESOURCE_NAMES"] == "amd.com/gpu"
    assert env["SHARDED_OPERATOR_RDMA_RESOURCE_NAMES"] == "rdma/ib"


def test_the_charts_allowlist_values_name_exactly_the_tables_rows():
    """values.schema.json, values.yaml's comment and the generated policy file follow overrides.py."""
    import json

    from sharded_operator.api import overrides

    chart = ROOT / "charts" / "sharded-training-operator"
    schema = json.loads((chart / "values.schema.json").read_text())
    assert schema["properties"]["forbidPodOverrides"]["items"]["enum"] == list(overrides.NAMES)
    values = (chart / "values.yaml").read_text()
    comment = values[values.index("# -- Rows of the pod allowlist") : values.index("forbidPodOverrides: []")]
    assert [n for n in overrides.NAMES if n not in comment] == []
    assert (chart / "files" / "pod-overrides.yaml").read_text() == overrides.render(), "run `make crds`"


@pytest.mark.parametrize(
    "bad,message",
    [
        ("forbidPodOverrides={hostIPC}", "forbidPodOverrides"),
        ("podPolicy.gpuResourceName=x", "podPolicy"),
        ("metrics.port=80", "/metrics/port"),
        ("operator.logFormat=xml", "/operator/logFormat"),
        ("watchNamespace=a", "watchNamespace"),  # a typo is an error, not silently ignored
    ],
)
def test_bad_values_are_refused(helm, bad, message):
    with pytest.raises(subprocess.CalledProcessError) as exc:
        render(helm, bad)
    assert message in exc.value.stderr


def test_the_dashboard_and_alerts_query_only_series_the_operator_exports(helm):
    """Every metric name and label the dashboard and the alert rules use is one the operator exports."""
    import json
    import re

    from sharded_operator.run.jobmetrics import LABELS, METRIC_NAMES

    assert not find(render(helm), "PrometheusRule") and not find(render(helm), "ConfigMap")
    docs = render(helm, "metrics.prometheusRule.enabled=true", "metrics.prometheusRule.labels.release=prom",
                  "metrics.prometheusRule.hungMinutes=30", "metrics.dashboard.enabled=true",
                  "metrics.dashboard.namespace=monitoring", "metrics.maxJobs=50")  # fmt: skip
    assert env_of(docs)["SHARDED_OPERATOR_METRICS_MAX_JOBS"] == "50"
    [rule] = find(docs, "PrometheusRule", "ops")
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    assert set(alerts) == {f"ShardedTraining{a}" for a in ("JobHung", "CheckpointStale", "RestartsClimbing")}
    assert "[30m]" in alerts["ShardedTrainingJobHung"]["expr"]
    [board] = find(docs, "ConfigMap", "monitoring")
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(board["data"]["sharded-training.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    exprs += [r["expr"] for r in alerts.values()]
    used = {m for e in exprs for m in re.findall(r"\bsharded_[a-z_]+", e)}
    assert used and used <= set(METRIC_NAMES), used - set(METRIC_NAMES)
    labels = {m for e in exprs for m in re.findall(r"([a-z_]+)\s*(?:=~|!=|=)\s*\"", e)}
    labels |= {m for e in exprs for m in re.findall(r"on\(([^)]*)\)", e) for m in m.replace(" ", "").split(",")}
    assert labels <= {*LABELS, "phase"}, labels


def test_the_chart_follows_the_conventions_charts_are_written_with(helm):
    docs = render(helm, "fullnameOverride=ops-operator", "podAnnotations.team=ml", "podLabels.tier=control",
                  "extraEnv[0].name=HTTPS_PROXY", "extraEnv[0].value=http://proxy:3128",
                  "extraVolumes[0].name=ca", "extraVolumes[0].configMap.name=corp-ca",
                  "extraVolumeMounts[0].name=ca", "extraVolumeMounts[0].mountPath=/etc/ssl/corp",
                  "livenessProbe.periodSeconds=60", "readinessProbe.failureThreshold=9",
                  "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.namespace=monitoring",
                  "metrics.serviceMonitor.relabelings[0].action=labeldrop",
                  "metrics.serviceMonitor.relabelings[0].regex=pod", "global.imageRegistry=r.example.com")  # fmt: skip
    [dep] = find(docs, "Deployment")
    assert dep["metadata"]["name"] == "ops-operator"
    pod = dep["spec"]["template"]
    assert pod["metadata"]["annotations"] == {"team": "ml"} and pod["metadata"]["labels"]["tier"] == "control"
    container = pod["spec"]["containers"][0]
    assert env_of(docs)["HTTPS_PROXY"] == "http://proxy:3128"
    assert {"name": "ca", "configMap": {"name": "corp-ca"}} in pod["spec"]["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ssl/corp"} in container["volumeMounts"]
    assert container["livenessProbe"]["periodSeconds"] == 60 and container["readinessProbe"]["failureThreshold"] == 9
    [sm] = find(docs, "ServiceMonitor", "monitoring")
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}
    assert sm["spec"]["endpoints"][0]["relabelings"] == [{"action": "labeldrop", "regex": "pod"}]
    # A budget for the operator's own pods only: they carry its selector labels, training pods never do.
    [pdb] = find(docs, "PodDisruptionBudget", "ops")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    named = render(helm, "nameOverride=trainops")
    assert find(named, "Deployment")[0]["metadata"]["name"] == "op-trainops"


def test_rbac_and_crds_can_be_left_to_the_cluster_admin(helm):
    kinds = {d["kind"] for d in render(helm, "rbac.create=false", "crds.install=false")}
    assert not kinds & {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "CustomResourceDefinition"}
    assert "Deployment" in kinds
    [crd] = find(render(helm), "CustomResourceDefinition")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # uninstall must not delete jobs
    assert crd["spec"] == yaml.safe_load(CRD_FILE.read_text())["spec"]  # the generated CRD, whole
    [crd] = find(render(helm, "crds.keep=false"), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in crd["metadata"]["annotations"]
