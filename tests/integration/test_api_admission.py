"""The CRD installed in the real API server accepts the examples and refuses malformed jobs at admission."""

from __future__ import annotations

import json
import subprocess

import pytest
from kubernetes.client.rest import ApiException

from sharded_operator.api.models import GROUP, PLURAL, VERSION
from support.manifests import DELETE, EXAMPLES, MALFORMED, load_example, mutate

pytestmark = pytest.mark.integration


def create(custom, namespace, body):
    return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, field_validation="Strict")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_is_accepted(custom, crd_installed, namespace, path):
    import yaml

    body = yaml.safe_load(path.read_text())
    created = create(custom, namespace, body)
    assert created["metadata"]["uid"]
    # Scalar defaults inside objects the author wrote are filled in by the API server from the schema.
    assert created["spec"]["checkpoint"]["resume"] is True
    assert created["spec"]["checkpoint"]["mountPath"] == "/checkpoints"


@pytest.mark.parametrize("case,changes,field", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_job_is_refused_naming_the_field(custom, crd_installed, namespace, case, changes, field):
    with pytest.raises(ApiException) as exc:
        create(custom, namespace, mutate(load_example(), changes))
    assert exc.value.status in (400, 422), exc.value.body
    message = json.loads(exc.value.body)["message"]
    assert field in message, message


def test_malformed_job_reports_every_problem_at_once(custom, crd_installed, namespace):
    with pytest.raises(ApiException) as exc:
        create(custom, namespace, mutate(load_example(), {"spec.nodes": 0, "spec.trainer.steps": 0}))
    message = json.loads(exc.value.body)["message"]
    assert "spec.nodes" in message and "spec.trainer.steps" in message


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"spec.strategy.type": "zero2"}, "spec.strategy.type"),
        ({"spec.procsPerNode": 1}, "spec.procsPerNode"),
        ({"spec.checkpoint.volumeClaim.size": "2Gi"}, "spec.checkpoint.volumeClaim"),
    ],
    ids=["strategy", "procs-per-node", "checkpoint-claim"],
)
def test_fields_that_define_the_run_are_immutable(custom, crd_installed, namespace, changes, field):
    create(custom, namespace, load_example())
    with pytest.raises(ApiException) as exc:
        edit(custom, namespace, "quickstart", changes)
    message = json.loads(exc.value.body)["message"]
    assert field in message and "immutable" in message, message


def test_mutable_fields_can_change(custom, crd_installed, namespace):
    create(custom, namespace, load_example())
    after = edit(custom, namespace, "quickstart", {"spec.runPolicy": {"suspend": True}, "spec.trainer.steps": 80})
    assert after["spec"]["runPolicy"]["suspend"] is True


def test_kubectl_explain_shows_the_field_descriptions(cluster, crd_installed):
    def explain(field):
        out = subprocess.run(
            [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "explain", field],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        return " ".join(out)

    assert "nodes x processes training one model with FSDP2 or ZeRO-2" in explain("stj.spec")
    ckpt = explain("stj.spec.checkpoint.existingClaim")
    assert "existing PersistentVolumeClaim" in ckpt
    assert "one switch between FSDP2 and ZeRO-2" in explain("stj.spec.strategy")


def test_short_name_and_printer_columns(cluster, crd_installed, custom, namespace):
    create(custom, namespace, load_example())
    out = subprocess.run(
        [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "get", "stj", "-n", namespace],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    header = out.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "READY", "NODES", "DESIRED", "STRATEGY", "STEP", "RESTARTS", "CHECKPOINT", "AGE"]
    assert out.splitlines()[1].split()[0] == "quickstart"


def edit(custom, namespace: str, name: str, changes: dict) -> dict:
    """Replace the job with `changes` applied to it as it is now: an operator writing its status in between
    (a new resourceVersion, 409) is read again; admission's own refusals are raised."""
    for _ in range(20):
        current = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        try:
            body = mutate(current, changes)
            return custom.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, body)
        except ApiException as e:
            if e.status != 409:
                raise
    raise AssertionError(f"{name} kept changing under 20 replaces")


def test_nodes_change_only_while_suspended(custom, crd_installed, namespace):
    create(custom, namespace, load_example())
    with pytest.raises(ApiException) as exc:
        edit(custom, namespace, "quickstart", {"spec.nodes": 3})
    assert "nodes can change only while the job is suspended" in json.loads(exc.value.body)["message"]
    edit(custom, namespace, "quickstart", {"spec.runPolicy": {"suspend": True}})
    resized = edit(custom, namespace, "quickstart", {"spec.nodes": 3})
    assert resized["spec"]["nodes"] == 3
    # An elastic job resizes while it runs, within its bounds (the spec's own rule); taking elastic away at the
    # same time is a fixed-size change and refused.
    elastic = {"spec.elastic": {"minNodes": 1, "maxNodes": 4}, "spec.runPolicy": {"suspend": False}, "spec.nodes": 2}
    edit(custom, namespace, "quickstart", elastic)
    grown = edit(custom, namespace, "quickstart", {"spec.nodes": 4})
    assert grown["spec"]["nodes"] == 4
    for bad, message in [
        ({"spec.nodes": 5}, "must lie between elastic.minNodes and elastic.maxNodes"),
        ({"spec.nodes": 3, "spec.elastic": DELETE}, "nodes can change only while the job is suspended"),
    ]:
        with pytest.raises(ApiException) as exc:
            edit(custom, namespace, "quickstart", bad)
        assert message in json.loads(exc.value.body)["message"]
