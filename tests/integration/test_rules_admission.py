"""One source per rule, checked against the real API server: every rule example and every quantity string gets
the same verdict from admission as from the Python check."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from localstack.stack import install_crd
from sharded_api.loading import format_validation_error
from sharded_api.quantity import is_quantity
from sharded_operator.api.models import GROUP, PLURAL, VERSION, ShardedTrainingJob
from support.manifests import load_example, mutate
from support.quantities import QUANTITIES
from support.rule_cases import rule_cases

pytestmark = pytest.mark.integration
CASES = rule_cases()
PROBE_GROUP, PROBE_PLURAL = "probes.sharded.dev", "quantityprobes"


def admitted(custom, namespace, group, plural, body) -> tuple[bool, str]:
    """Whether the API server admits `body` (dry run: nothing is stored), and its message if not."""
    try:
        custom.create_namespaced_custom_object(group, VERSION, namespace, plural, body, dry_run="All")
    except ApiException as e:
        assert e.status in (400, 422), e.body
        return False, json.loads(e.body)["message"]
    return True, ""


def python_verdict(job: dict) -> tuple[bool, str]:
    try:
        ShardedTrainingJob.model_validate(job)
    except ValidationError as e:
        return False, format_validation_error(e)
    return True, ""


@pytest.mark.parametrize("case,rule,job,holds", CASES, ids=[c[0] for c in CASES])
def test_admission_and_the_python_check_agree_on_every_rule_example(custom, crd_installed, namespace, case, rule,
                                                                    job, holds):  # fmt: skip
    ok, message = admitted(custom, namespace, GROUP, PLURAL, job)
    py_ok, py_message = python_verdict(job)
    assert (ok, py_ok) == (holds, holds), f"server: {message or 'admitted'}; python: {py_message or 'valid'}"
    if not holds:
        assert rule.message in message and rule.message in py_message


@pytest.fixture(scope="module")
def quantity_probe(cluster):
    """A CRD whose only rule is isQuantity: asks the API server's own parser about a string."""
    install_crd(
        cluster.kubeconfig,
        {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{PROBE_PLURAL}.{PROBE_GROUP}"},
            "spec": {
                "group": PROBE_GROUP,
                "scope": "Namespaced",
                "names": {"kind": "QuantityProbe", "plural": PROBE_PLURAL},
                "versions": [
                    {
                        "name": VERSION, "served": True, "storage": True,
                        "schema": {"openAPIV3Schema": {"type": "object", "properties": {"value": {
                            "type": "string", "maxLength": 64,
                            "x-kubernetes-validations": [{"rule": "isQuantity(self)", "message": "not a quantity"}],
                        }}}},
                    }
                ],
            },
        },
    )  # fmt: skip


@pytest.mark.parametrize("text,accepted", QUANTITIES, ids=[repr(q) for q, _ in QUANTITIES])
def test_the_parser_agrees_with_the_api_servers_is_quantity(custom, quantity_probe, namespace, text, accepted):
    probe = {"apiVersion": f"{PROBE_GROUP}/{VERSION}", "kind": "QuantityProbe", "metadata": {"name": "p"}}
    probe["value"] = text
    ok, message = admitted(custom, namespace, PROBE_GROUP, PROBE_PLURAL, probe)
    assert ok is accepted, f"API server: {message or 'admitted'}; table says {accepted}"
    assert is_quantity(text) is ok


@pytest.mark.parametrize("memory", [q for q, _ in QUANTITIES] + [4, 0, -1], ids=repr)
def test_a_memory_quantity_gets_the_same_verdict_from_admission_and_the_models(custom, crd_installed, namespace,
                                                                               memory):  # fmt: skip
    job = mutate(load_example(), {"spec.resources": {"memory": memory}})
    ok, message = admitted(custom, namespace, GROUP, PLURAL, job)
    py_ok, py_message = python_verdict(job)
    assert ok == py_ok, f"server: {message or 'admitted'}; python: {py_message or 'valid'}"
