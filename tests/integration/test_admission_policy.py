"""The chart's ValidatingAdmissionPolicy on the real API server, with two users: one who may create pods in
the namespace and one who may only create ShardedTrainingJobs. A job must not be a way around pod policy."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from conftest import ROOT, wait_for
from sharded_operator.api.allowlist import Allow
from sharded_operator.api.models import GROUP, PLURAL, VERSION
from sharded_operator.api.overrides import ROWS, outside
from support.jobs import make_job

pytestmark = pytest.mark.integration
CHART = ROOT / "charts" / "sharded-training-operator"


@pytest.fixture
def policy(cluster, api_client):
    """The policy and its binding exactly as the chart renders them."""
    render = [str(cluster.bin_dir / "helm"), "template", "op", str(CHART), "-n", "ops",
              "--kube-version", "1.36.3", "--show-only", "templates/admissionpolicy.yaml"]  # fmt: skip
    out = subprocess.run(render, check=True, capture_output=True, text=True).stdout
    policy, binding = [d for d in yaml.safe_load_all(out) if d]
    admission = client.AdmissionregistrationV1Api(api_client)
    admission.create_validating_admission_policy(policy)
    admission.create_validating_admission_policy_binding(binding)
    yield policy
    admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
    admission.delete_validating_admission_policy(policy["metadata"]["name"])


def as_user(cluster, user: str) -> client.CustomObjectsApi:
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    api.set_default_header("Impersonate-User", user)
    return client.CustomObjectsApi(api)


@pytest.fixture
def users(cluster, core, namespace):
    """alice may create jobs; bob may create jobs and pods."""
    rbac = client.RbacAuthorizationV1Api(core.api_client)
    roles = {
        "submit-jobs": [{"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["create", "get"]}],
        "create-pods": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}],
    }
    for name, rules in roles.items():
        rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": rules})
    for user, granted in {"alice": ["submit-jobs"], "bob": ["submit-jobs", "create-pods"]}.items():
        for role in granted:
            rbac.create_namespaced_role_binding(namespace, {
                "metadata": {"name": f"{user}-{role}"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            })  # fmt: skip
    return {user: as_user(cluster, user) for user in ("alice", "bob")}


CASES = [(row, example) for row in ROWS for example in row.risky]
SAFE = [(row, example) for row in ROWS for example in row.safe]


def submit(api, namespace: str, name: str, example: dict | None = None) -> dict:
    job = make_job(name)
    for path, value in (example or {}).items():
        job = job.spec(path, value)
    body = job.obj()
    body["metadata"] = {"name": name}
    return api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def test_leaving_the_pod_allowlist_needs_the_right_to_create_pods(policy, users, namespace, operator):
    """Every attack of the allowlist's table, as a user without pod rights: refused at admission naming the
    field; the same manifest allowed for a user with them; and the operator's Python check agrees with the
    API server's CEL on every example, inside and outside."""
    alice, bob = users["alice"], users["bob"]

    def refused(example, n=[0]) -> str:  # noqa: B006 - a counter for unique names
        n[0] += 1
        try:
            submit(alice, namespace, f"a{n[0]}", example)
        except ApiException as e:
            return json.loads(e.body)["message"]
        return ""

    # The policy takes effect once the API server has loaded it.
    wait_for(lambda: refused(CASES[0][1]), timeout=30, what="the policy in force")
    for row, example in CASES:
        message = refused(example)
        assert row.field in message and "create pods" in message, (row.name, example, message)
        assert [r.name for r in outside(spec_of(example), Allow())] == [row.name]
    # What a plain pod of the namespace gets, anyone who may submit a job gets.
    assert submit(alice, namespace, "plain")["metadata"]["name"] == "plain"
    ib = {"resources.gpusPerNode": 8, "network": {"infiniband": {"enabled": True}, "hostNetwork": True}}
    assert submit(alice, namespace, "ib", ib)["metadata"]["name"] == "ib"
    for i, (row, example) in enumerate(SAFE):
        assert submit(alice, namespace, f"s{i}", example)["metadata"]["name"] == f"s{i}", row.name
        assert outside(spec_of(example), Allow()) == []
    # bob could create such a pod himself: his jobs may ask for it.
    for i, (row, example) in enumerate(CASES):
        assert submit(bob, namespace, f"b{i}", example)["metadata"]["name"] == f"b{i}", row.name


def spec_of(example: dict):
    job = make_job()
    for path, value in example.items():
        job = job.spec(path, value)
    return job.model().spec
