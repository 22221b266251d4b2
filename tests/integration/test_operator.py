"""The operator against the real control plane: KWOK GPU nodes run the pods, annotations end them."""

from __future__ import annotations

import datetime as dt
import logging
import subprocess
import time
import urllib.request
import uuid

import pytest
from kubernetes.client.rest import ApiException

from conftest import STUCK, wait_for
from sharded_api.contract import iso
from sharded_operator.api.models import (
    ANNOTATION_CREATED_BY,
    GROUP,
    LABEL_JOB,
    PLURAL,
    VERSION,
)
from support.jobs import make_job
from support.ops import Ops

pytestmark = pytest.mark.integration


@pytest.fixture
def ops(core, custom, namespace, operator):
    return Ops(core, custom, namespace)


def gpu_job(nodes=2, gpus=4):
    return make_job("j").nodes(nodes).gpus(gpus).spec("failurePolicy.backoffLimit", 2)


def kubectl_wait(cluster, ops, condition: str) -> subprocess.CompletedProcess:
    """`kubectl wait` as users script it for Jobs and JobSets: it returns at once when the condition holds."""
    cmd = [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "-n", ops.ns, "wait",
           f"--for=condition={condition}", "stj/j", "--timeout=20s"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_job_runs_on_gpu_nodes_and_succeeds(ops, core, cluster):
    ops.create(gpu_job(nodes=3))
    pods = ops.wait_running_attempt(1, 3)
    for p in pods:
        assert p.spec.node_name.startswith("gpu-node-")
        assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "4"
    assert {p.spec.node_name for p in pods}.__len__() >= 1
    svc = core.read_namespaced_service("j", ops.ns)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses
    config = pods[0].spec.volumes[0].config_map.name
    assert config.startswith("j-config-") and core.read_namespaced_config_map(config, ops.ns).data["trainer.yaml"]
    status = ops.status()
    assert status["ready"] == "3/3" and status["attempt"] == 1
    for p in pods:
        ops.exit(p.metadata.name, 0)
    status = ops.wait_phase("Succeeded")
    assert status["completionTime"] and status["restarts"] == 0
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds["Succeeded"] == conds["Complete"] == "True" and conds["Running"] == "False"
    waited = kubectl_wait(cluster, ops, "Complete")
    assert waited.returncode == 0 and "condition met" in waited.stdout, waited.stderr


def test_retryable_failure_restarts_the_whole_gang_as_a_new_attempt(ops):
    ops.create(gpu_job())
    first = ops.wait_running_attempt(1, 2)
    first_uids = {p.metadata.uid for p in first}
    ops.exit("j-1", 137, "OOMKilled")
    second = ops.wait_running_attempt(2, 2)
    assert first_uids.isdisjoint({p.metadata.uid for p in second})  # fresh pods, node 0 included
    env = {e.name: e.value for e in second[0].spec.containers[0].env}
    assert env["PET_RDZV_ID"].endswith("-2")
    status = ops.status()
    assert status["restarts"] == 1
    failure = status["lastFailure"]
    assert failure["pod"] == "j-1" and failure["nodeRank"] == 1 and failure["exitCode"] == 137
    assert failure["reason"] == "OOMKilled" and failure["node"].startswith("gpu-node-")


def test_permanent_exit_code_fails_the_job_with_the_reason(ops):
    ops.create(gpu_job().spec("failurePolicy.permanentExitCodes", [2, 42]))
    ops.wait_running_attempt(1, 2)
    ops.exit("j-0", 42)
    status = ops.wait_phase("Failed")
    assert status["lastFailure"]["exitCode"] == 42 and status["restarts"] == 0
    assert "permanent" in status["message"]
    # cleanPodPolicy Running: the survivor is deleted once the job has ended
    wait_for(
        lambda: all(p.metadata.name != "j-1" or p.metadata.deletion_timestamp for p in ops.pods()), what="j-1 gone"
    )


def test_backoff_limit_exhausted_fails_the_job(ops):
    ops.create(gpu_job().spec("failurePolicy.backoffLimit", 1))
    ops.wait_running_attempt(1, 2)
    ops.exit("j-0", 1)
    ops.wait_running_attempt(2, 2)
    ops.exit("j-0", 1)
    status = ops.wait_phase("Failed")
    assert status["restarts"] == 1
    assert next(c for c in status["conditions"] if c["type"] == "Failed")["reason"] == "BackoffLimitExceeded"


def test_node_loss_restarts_the_gang_on_remaining_nodes(ops, cluster, core):
    ops.create(gpu_job())
    pods = ops.wait_running_attempt(1, 2)
    lost = pods[1].spec.node_name
    core.delete_node(lost)
    try:
        second = ops.wait_running_attempt(2, 2)
        assert lost not in {p.spec.node_name for p in second}
        status = ops.status()
        assert status["lastFailure"]["reason"] in ("NodeLost", "DisruptionTarget"), status["lastFailure"]
        assert (status["restarts"], status["disruptions"]) == (0, 1)  # a disruption, not a failure
    finally:
        cluster.add_gpu_node(lost)


def test_a_node_that_stops_reporting_is_lost_and_its_stuck_pod_is_forced_out(ops, core):
    """A node whose kubelet died: Ready went Unknown and nothing will confirm its pods' deletion. The
    attempt restarts elsewhere as a disruption, and the pod left Terminating past its grace (the operator
    deletes with a grace of 3 s here) is force-deleted so the next attempt can have its name."""
    ops.create(gpu_job().spec("failurePolicy.nodeLostSeconds", 10))
    victim = next(p for p in ops.wait_running_attempt(1, 2) if p.metadata.name == "j-1")
    lost = victim.spec.node_name
    core.patch_namespaced_pod("j-1", ops.ns, {"metadata": {"annotations": {STUCK: "true"}}})
    down = {"metadata": {"annotations": {"kwok.sharded.dev/down": "true"}}, "spec": {"unschedulable": True}}
    core.patch_node(lost, down)
    since = iso(dt.datetime.now(dt.UTC) - dt.timedelta(seconds=30))  # it stopped reporting 30 s ago
    core.patch_node_status(lost, {"status": {"conditions": [{
        "type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting.",
        "lastHeartbeatTime": since, "lastTransitionTime": since,
    }]}})  # fmt: skip
    try:
        second = ops.wait_running_attempt(2, 2, timeout=90)
        assert lost not in {p.spec.node_name for p in second}
        status = ops.status()
        assert status["lastFailure"]["reason"] == "NodeLost" and "not been Ready" in status["lastFailure"]["message"]
        assert (status["restarts"], status["disruptions"]) == (0, 1)
        reasons = [e.reason for e in core.list_namespaced_event(ops.ns).items]
        assert "ForceDeleted" in reasons
    finally:
        up = {"metadata": {"annotations": {"kwok.sharded.dev/down": None}}, "spec": {"unschedulable": False}}
        core.patch_node(lost, up)


def test_a_job_created_again_under_its_name_waits_out_the_old_pods_and_never_adopts_them(ops, core, custom):
    ops.create(gpu_job())
    old_uid = ops.job()["metadata"]["uid"]
    for pod in ops.wait_running_attempt(1, 2):  # the old job's pods will outlive it, Terminating
        stuck = {"metadata": {"annotations": {STUCK: "1"}}}
        core.patch_namespaced_pod(pod.metadata.name, ops.ns, stuck)
    custom.delete_namespaced_custom_object(GROUP, VERSION, ops.ns, PLURAL, "j", propagation_policy="Background")
    wait_for(lambda: all(p.metadata.deletion_timestamp for p in ops.pods()), what="the old pods terminating")
    ops.create(gpu_job())
    new_uid = ops.job()["metadata"]["uid"]
    assert new_uid != old_uid
    status = wait_for(lambda: (s := ops.status()) and "of a deleted job of the same name" in s.get("message", "") and s,
                      what="the new job waiting for the old pods")  # fmt: skip
    time.sleep(3)  # several reconciles: still waiting, nothing counted, no pod of its own yet
    status = ops.status()
    assert (status["attempt"], status["restarts"], status.get("disruptions", 0)) == (1, 0, 0)
    assert all(p.metadata.owner_references[0].uid == old_uid for p in ops.pods())
    for pod in ops.pods():  # the old pods finally go
        core.delete_namespaced_pod(pod.metadata.name, ops.ns, grace_period_seconds=0)
    second = ops.wait_running_attempt(1, 2)
    assert {p.metadata.owner_references[0].uid for p in second} == {new_uid}
    assert ops.status()["restarts"] == 0


def test_an_eviction_restarts_the_gang_without_using_the_failure_budget(ops, core):
    """The Eviction API marks the pod DisruptionTarget before deleting it, as a drain or preemption does."""
    from kubernetes import client

    ops.create(gpu_job().spec("failurePolicy.backoffLimit", 0))
    ops.wait_running_attempt(1, 2)
    core.create_namespaced_pod_eviction(
        "j-1", ops.ns, client.V1Eviction(metadata=client.V1ObjectMeta(name="j-1", namespace=ops.ns))
    )
    ops.wait_running_attempt(2, 2)
    status = ops.status()
    assert (status["restarts"], status["disruptions"], status["phase"]) == (0, 1, "Running")
    assert status["lastFailure"]["reason"] == "DisruptionTarget" and status["lastFailure"]["pod"] == "j-1"
    assert "Eviction" in status["lastFailure"]["message"]


def test_an_eviction_while_the_operator_is_down_is_a_disruption_not_a_failure(ops, core, operator):
    """No replica saw the pod go (no deletion event, no DisruptionTarget to read): the job does not pay for
    the operator's outage with its backoffLimit."""
    from kubernetes import client

    ops.create(gpu_job().spec("failurePolicy.backoffLimit", 0))
    ops.wait_running_attempt(1, 2)
    operator.kill()
    try:
        core.create_namespaced_pod_eviction(
            "j-1", ops.ns, client.V1Eviction(metadata=client.V1ObjectMeta(name="j-1", namespace=ops.ns))
        )
        wait_for(lambda: "j-1" not in {p.metadata.name for p in ops.pods()}, timeout=30, what="j-1 gone")
    finally:
        operator.start()
    ops.wait_running_attempt(2, 2)
    status = ops.status()
    assert (status["restarts"], status["disruptions"], status["phase"]) == (0, 1, "Running")
    assert status["lastFailure"]["reason"] == "PodVanished" and status["lastFailure"]["pod"] == "j-1"


def test_a_pod_the_api_server_refuses_shows_in_a_condition_and_one_event(ops, core):
    """An invalid pod label passes the job's admission (labels are free-form there) but not the pod's."""
    ops.create(gpu_job().spec("pod", {"labels": {"team": "-not a label value-"}}))
    status = wait_for(
        lambda: (s := ops.status()) and any(c["type"] == "CreateRefused" and c["status"] == "True"
                                            for c in s.get("conditions", [])) and s,
        what="the CreateRefused condition",
    )  # fmt: skip
    cond = next(c for c in status["conditions"] if c["type"] == "CreateRefused")
    assert cond["reason"] == "Invalid" and "metadata.labels" in cond["message"], cond
    assert "refused" in status["message"]
    time.sleep(7)  # several reconciles later, past the grace for missing pods: still one event, not a failure
    events = [e for e in core.list_namespaced_event(ops.ns).items if e.reason == "FailedCreate"]
    assert len(events) == 1 and "metadata.labels" in events[0].message
    status = ops.status()
    assert not ops.pods() and (status["phase"], status["attempt"], status["restarts"]) == ("Pending", 1, 0), status


def test_suspend_deletes_pods_and_resume_brings_them_back(ops, cluster):
    ops.create(gpu_job())
    ops.wait_running_attempt(1, 2)
    ops.patch_spec({"runPolicy": {"suspend": True}})
    waited = kubectl_wait(cluster, ops, "Suspended")
    assert waited.returncode == 0 and "condition met" in waited.stdout, waited.stderr
    ops.wait_phase("Suspended")
    assert {c["type"]: c["status"] for c in ops.status()["conditions"]}["Complete"] == "False"
    wait_for(lambda: not ops.pods(), timeout=30, what="pods deleted")
    ops.patch_spec({"runPolicy": {"suspend": False}})
    ops.wait_running_attempt(2, 2)
    assert ops.status()["restarts"] == 0  # a suspension is not a failure


def test_a_job_waits_out_the_claim_of_a_deleted_job_of_its_name_and_records_its_uid_on_its_own(ops, core):
    # An earlier job's claim (not retained) still being deleted: pods mounting it would never start.
    hold = "test.sharded.dev/hold"
    claim = {"metadata": {"name": "j-checkpoints", "finalizers": [hold]},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
    core.create_namespaced_persistent_volume_claim(ops.ns, claim)
    core.delete_namespaced_persistent_volume_claim("j-checkpoints", ops.ns)
    ops.create(gpu_job().spec("checkpoint", {"volumeClaim": {"size": "1Gi", "retainOnDelete": False}}))
    wait_for(lambda: "PersistentVolumeClaim j-checkpoints of a deleted job" in ops.status().get("message", ""),
             what="the job waiting for the old claim")  # fmt: skip
    time.sleep(7)  # past the grace after which a started attempt's missing pod is a failure
    status = ops.status()
    assert not ops.pods() and (status["phase"], status["attempt"], status["restarts"]) == ("Pending", 1, 0), status
    core.patch_namespaced_persistent_volume_claim("j-checkpoints", ops.ns, {"metadata": {"finalizers": None}})
    ops.wait_running_attempt(1, 2)
    assert ops.status()["restarts"] == 0  # waiting was not a failure
    uid = ops.job()["metadata"]["uid"]
    meta = core.read_namespaced_persistent_volume_claim("j-checkpoints", ops.ns).metadata
    assert meta.annotations[ANNOTATION_CREATED_BY] == uid and meta.owner_references[0].uid == uid


def test_deleting_the_job_garbage_collects_children_but_keeps_the_checkpoint_claim(ops, core, custom):
    ops.create(gpu_job().spec("checkpoint", {"volumeClaim": {"size": "1Gi"}}))
    ops.wait_running_attempt(1, 2)
    assert core.read_namespaced_persistent_volume_claim("j-checkpoints", ops.ns).status.phase == "Bound"
    custom.delete_namespaced_custom_object(GROUP, VERSION, ops.ns, PLURAL, "j")

    def gone():
        try:
            core.read_namespaced_service("j", ops.ns)
            return False
        except ApiException as e:
            return (
                e.status == 404
                and not ops.pods()
                and not core.list_namespaced_config_map(ops.ns, label_selector=f"{LABEL_JOB}=j").items
            )

    wait_for(gone, timeout=60, what="children garbage-collected")
    assert core.read_namespaced_persistent_volume_claim("j-checkpoints", ops.ns)  # the user's checkpoints stay


def test_operator_killed_mid_reconcile_creates_no_duplicates(ops, operator):
    ops.create(gpu_job(nodes=4, gpus=2))
    wait_for(lambda: len(ops.pods()) >= 1, timeout=30, what="first pod")
    operator.kill()  # somewhere between creating pods and writing status
    operator.start()
    pods = ops.wait_running_attempt(1, 4)
    assert sorted(p.metadata.name for p in pods) == ["j-0", "j-1", "j-2", "j-3"]
    assert len(ops.pods()) == 4
    status = ops.status()
    assert status["attempt"] == 1 and status["restarts"] == 0


def test_a_job_can_be_deleted_while_the_operator_is_down(ops, operator, custom):
    """No finalizer holds a job: kubectl delete stj completes whether or not the operator runs."""
    ops.create(gpu_job())
    ops.wait_running_attempt(1, 2)
    assert not ops.job()["metadata"].get("finalizers")
    operator.kill()
    try:
        custom.delete_namespaced_custom_object(GROUP, VERSION, ops.ns, PLURAL, "j")

        def gone():
            try:
                ops.job()
            except ApiException as e:
                return e.status == 404
            return False

        wait_for(gone, timeout=15, what="the job to be gone with the operator down")
    finally:
        operator.start()


def test_a_pod_no_node_can_take_explains_itself_and_raises_a_condition_after_the_timeout(ops, core):
    ops.create(gpu_job(gpus=16).spec("failurePolicy.schedulingTimeoutSeconds", 3))  # nodes have 8 GPUs
    status = wait_for(lambda: (s := ops.status()) and "Insufficient nvidia.com/gpu" in s.get("message", "") and s,
                      what="the scheduler's reason in status")  # fmt: skip
    assert status["phase"] == "Starting"
    cond = wait_for(lambda: next((c for c in ops.status().get("conditions", [])
                                  if c["type"] == "PodsStuck" and c["status"] == "True"), None),
                    what="the PodsStuck condition")  # fmt: skip
    assert cond["reason"] == "Unschedulable"
    time.sleep(2)
    assert len([e for e in core.list_namespaced_event(ops.ns).items if e.reason == "PodsStuck"]) == 1


def test_a_trainer_edit_takes_effect_at_the_next_attempt_never_under_a_running_one(ops, core):
    ops.create(gpu_job())
    first = ops.wait_running_attempt(1, 2)
    old = first[0].spec.volumes[0].config_map.name
    ops.patch_spec({"trainer": {"steps": 77}})
    time.sleep(2)  # several reconciles: the running pods keep the config they started with
    assert {p.spec.volumes[0].config_map.name for p in ops.pods()} == {old}
    assert "steps: 10" in core.read_namespaced_config_map(old, ops.ns).data["trainer.yaml"]
    ops.exit("j-1", 1)
    second = ops.wait_running_attempt(2, 2)
    new = {p.spec.volumes[0].config_map.name for p in second}
    assert len(new) == 1 and old not in new
    assert "steps: 77" in core.read_namespaced_config_map(new.pop(), ops.ns).data["trainer.yaml"]


def test_a_suspended_job_resumes_with_its_new_node_count(ops):
    ops.create(gpu_job(nodes=2))
    ops.wait_running_attempt(1, 2)
    ops.patch_spec({"runPolicy": {"suspend": True}})
    ops.wait_phase("Suspended")
    ops.patch_spec({"nodes": 3})
    ops.patch_spec({"runPolicy": {"suspend": False}})
    pods = ops.wait_running_attempt(2, 3)
    assert sorted(p.metadata.name for p in pods) == ["j-0", "j-1", "j-2"]
    assert ops.status()["ready"] == "3/3" and ops.status()["restarts"] == 0


def test_a_status_written_for_a_replaced_job_never_lands_on_its_successor(ops, custom, cluster):
    """Reconcile reads a job, decides, then writes its status: if the job was deleted and created again under
    its name in between, that write must not land on the new object (the API server checks the UID)."""
    from sharded_operator.run.k8s import Kube

    ops.create(gpu_job())
    old_uid = ops.job()["metadata"]["uid"]
    custom.delete_namespaced_custom_object(GROUP, VERSION, ops.ns, PLURAL, "j")
    ops.create(gpu_job())
    kube = Kube.connect(str(cluster.kubeconfig))
    assert kube.patch_status(ops.ns, "j", {"phase": "Failed", "restarts": 7}, uid=old_uid) is None
    assert ops.status().get("restarts", 0) == 0


def test_a_decision_written_over_an_older_version_of_the_job_is_refused_by_the_api_server(ops, cluster):
    """The fence under every reconcile's status write: the API server refuses a write over a version that is
    no longer the job's (409), and the operator reads the job again instead of landing it."""
    from sharded_operator.run.apicalls import Stale
    from sharded_operator.run.k8s import Kube

    ops.create(gpu_job().spec("runPolicy.suspend", True))
    # The operator's first status write first: before it the job has no status to add a field to (422), and
    # a loaded machine can take longer to start reconciling than this test takes to race it.
    wait_for(lambda: ops.status().get("phase") == "Suspended", what="the operator's first status")
    job = ops.job()
    uid, seen = job["metadata"]["uid"], job["metadata"]["resourceVersion"]
    ops.patch_spec({"runPolicy": {"suspend": True}, "failurePolicy": {"backoffLimit": 5}})  # any change
    wait_for(lambda: ops.job()["metadata"]["resourceVersion"] != seen, what="a newer version")
    kube = Kube.connect(str(cluster.kubeconfig))
    with pytest.raises(Stale):
        kube.patch_status(ops.ns, "j", {"restarts": 7}, uid=uid, resource_version=seen)
    assert ops.status().get("restarts", 0) == 0
    for _ in range(5):  # the operator may write the job's status in between: then the fence refuses ours too
        now = ops.job()["metadata"]["resourceVersion"]
        try:
            written = kube.patch_status(ops.ns, "j", {"restarts": 3}, uid=uid, before={}, resource_version=now)
            break
        except Stale:
            time.sleep(0.5)
    assert written and written.resource_version not in (None, now)  # over the current version: it lands


def test_an_event_the_api_server_refuses_is_dropped_not_raised_into_the_reconcile(core, cluster, caplog):
    """A namespace being deleted takes no new objects, events included, while the operator still reconciles
    its jobs there (their pods stop, their status changes): the event is logged and dropped."""
    from sharded_operator.run.k8s import Kube

    ns = f"terminating-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    held = {"metadata": {"name": "held", "finalizers": [f"{GROUP}/test-hold"]}}
    core.create_namespaced_config_map(ns, held)  # keeps the namespace Terminating until released
    core.delete_namespace(ns)
    try:
        wait_for(lambda: core.read_namespace(ns).status.phase == "Terminating", what="namespace terminating")
        job = {"metadata": {"name": "j", "namespace": ns, "uid": str(uuid.uuid4())}}
        with caplog.at_level(logging.WARNING, logger="sharded_operator.run.k8s"):
            Kube.connect(str(cluster.kubeconfig)).event(job, "Normal", "Running", "every pod is running")
        assert f"event Running on {ns}/j dropped: 403" in caplog.text, caplog.text
    finally:
        core.patch_namespaced_config_map("held", ns, {"metadata": {"finalizers": None}})


def test_a_delete_decided_for_one_pod_never_removes_a_newer_pod_of_the_same_name(ops, core, cluster):
    """Pod names are reused by every attempt: a delete decided from a listing of the old pod, landing after
    the next attempt's pod took the name, must leave that pod alone (the API server checks the UID)."""
    from sharded_operator.run.k8s import Kube

    ops.create(gpu_job())
    ops.wait_running_attempt(1, 2)
    old_uid = core.read_namespaced_pod("j-0", ops.ns).metadata.uid
    ops.exit("j-1", 1)  # a retryable failure: attempt 2 takes the names j-0 and j-1 again
    ops.wait_running_attempt(2, 2)
    new = core.read_namespaced_pod("j-0", ops.ns)
    assert new.metadata.uid != old_uid
    Kube.connect(str(cluster.kubeconfig)).delete_pod(ops.ns, "j-0", 0, uid=old_uid)  # the stale decision: a no-op
    assert core.read_namespaced_pod("j-0", ops.ns).metadata.uid == new.metadata.uid
    assert ops.status()["attempt"] == 2 and ops.status()["restarts"] == 1


def test_missing_gang_scheduler_fails_the_job_with_a_clear_message(ops):
    ops.create(gpu_job().spec("scheduling", {"gang": {"enabled": True, "provider": "volcano"}}))
    status = ops.wait_phase("Failed")
    assert "scheduling.volcano.sh/v1beta1 PodGroup is not installed" in status["message"]
    assert not ops.pods()


def test_metrics_endpoint_reports_the_runs(ops, operator):
    ops.create(gpu_job())
    ops.wait_running_attempt(1, 2)
    ops.exit("j-0", 1)
    ops.wait_running_attempt(2, 2)
    with urllib.request.urlopen(f"{operator.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sharded_")
    }
    assert values[f'sharded_job_restarts_total{{namespace="{ops.ns}"}}'] >= 1
    assert values['sharded_job_failures_total{reason="Error"}'] >= 1
    assert values['sharded_jobs{phase="Running"}'] >= 1
    assert values["sharded_pods_created_total"] >= 4
    assert values["sharded_reconcile_duration_seconds_count"] > 0


def api_requests(operator) -> dict[str, float]:
    with urllib.request.urlopen(f"{operator.url}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    counted = [line.rsplit(" ", 1) for line in lines if line.startswith("sharded_api_requests_total")]
    return {series: float(value) for series, value in counted}


def test_a_running_job_at_rest_costs_no_api_request_and_its_pod_events_no_read(ops, operator, core):
    """Reconciles read the watched view, not the API server: with nothing changing the operator sends no
    request at all, and a pod event (a label edited) is looked at without a GET or a LIST."""

    # Earlier tests' namespaces going away are not at rest where they still hold jobs or their pods: the
    # jobs lose their pods, restart, are refused.
    def busy_terminating() -> list:
        return [n for n in core.list_namespace().items if n.status.phase == "Terminating" and (
            ops.custom.list_namespaced_custom_object(GROUP, VERSION, n.metadata.name, PLURAL)["items"]
            or core.list_namespaced_pod(n.metadata.name, label_selector=LABEL_JOB).items)]  # fmt: skip

    deadline = time.monotonic() + 180
    while (left := busy_terminating()) and time.monotonic() < deadline:
        time.sleep(0.5)
    # What holds each one up, in the namespace controller's words (content or finalizers remaining).
    assert not left, {n.metadata.name: [c.message for c in n.status.conditions or [] if c.status == "True"]
                      for n in left}  # fmt: skip
    ops.create(gpu_job())
    ops.wait_running_attempt(1, 2)
    time.sleep(3)  # the last status write of the start
    before = api_requests(operator)
    assert before, "the operator counts its requests"
    time.sleep(10)
    core.patch_namespaced_pod("j-0", ops.ns, {"metadata": {"labels": {"touched": "yes"}}})
    time.sleep(3)
    after = api_requests(operator)
    assert after == before, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k)}


def test_pods_are_admitted_where_pod_security_is_restricted_and_infiniband_says_why_not(ops, core):
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    core.patch_namespace(ops.ns, {"metadata": {"labels": labels}})
    ops.create(gpu_job())
    ops.wait_running_attempt(1, 2)  # the default pods pass `restricted`
    ib = gpu_job().spec("network.infiniband", {"enabled": True})
    body = ib.obj()
    body["metadata"] = {"name": "ib"}
    ops.custom.create_namespaced_custom_object(GROUP, VERSION, ops.ns, PLURAL, body)
    status = wait_for(lambda: (s := ops.status("ib")).get("phase") == "Pending" and "refused" in s.get("message", "")
                      and s, what="the InfiniBand job refused by Pod Security")  # fmt: skip
    assert "IPC_LOCK" in status["message"] or "capabilities" in status["message"], status["message"]


def test_two_host_network_jobs_share_nodes_each_on_a_port_of_its_own(ops, core):
    """InfiniBand jobs on the host network bind their rendezvous port on the node: each job gets its own
    from the operator's range, declared as a hostPort, so two of them can share nodes without colliding."""
    two_nodes = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                               "values": ["gpu-node-0", "gpu-node-1"]}]}]}}}  # fmt: skip
    for name in ("a", "b"):
        job = (gpu_job(nodes=2, gpus=4).spec("network", {"hostNetwork": True, "infiniband": {"enabled": True}})
               .spec("scheduling.affinity", two_nodes))  # fmt: skip
        body = job.obj()
        body["metadata"] = {"name": name}
        ops.custom.create_namespaced_custom_object(GROUP, VERSION, ops.ns, PLURAL, body)
    a, b = (ops.wait_running_attempt(1, 2, name=n) for n in ("a", "b"))
    ports = {n: ops.status(n)["hostPort"] for n in ("a", "b")}
    assert ports["a"] != ports["b"] and all(29500 <= p <= 30499 for p in ports.values()), ports
    for name, pods in (("a", a), ("b", b)):
        assert {p.spec.node_name for p in pods} == {"gpu-node-0", "gpu-node-1"}
        for pod in pods:
            [port] = pod.spec.containers[0].ports
            assert port.host_port == port.container_port == ports[name] and pod.spec.host_network


def test_added_containers_pull_secrets_runtime_class_and_limits_reach_pods_the_api_server_accepts(ops, api_client):
    """What the builder writes is a valid pod to the real API server (native sidecars, a RuntimeClass that the
    RuntimeClass admission plugin resolves, limits above requests)."""
    from kubernetes import client

    node = client.NodeV1Api(api_client)
    try:
        node.create_runtime_class({"metadata": {"name": "gpu-runtime"}, "handler": "nvidia"})
    except ApiException as e:
        if e.status != 409:
            raise
    ops.create(
        gpu_job()
        .spec("resources.cpu", "2")
        .spec("resources.cpuLimit", "4")
        .spec("resources.memory", "4Gi")
        .spec("pod.imagePullSecrets", ["regcred"])
        .spec("pod.runtimeClassName", "gpu-runtime")
        .spec("pod.initContainers", [{"name": "fetch", "image": "busybox", "command": ["true"]}])
        .spec("pod.sidecars", [{"name": "ship", "image": "fluent-bit"}])
    )
    pods = ops.wait_running_attempt(1, 2)
    spec = pods[0].spec
    assert [c.name for c in spec.init_containers] == ["fetch", "ship"]
    assert spec.init_containers[1].restart_policy == "Always" and spec.init_containers[0].restart_policy is None
    assert spec.runtime_class_name == "gpu-runtime" and spec.image_pull_secrets[0].name == "regcred"
    trainer = spec.containers[0].resources
    assert (trainer.requests["cpu"], trainer.limits["cpu"], trainer.limits["memory"]) == ("2", "4", "4Gi")
    assert pods[0].status.qos_class == "Burstable"


def test_a_failed_pod_is_replaced_alone_and_a_lost_store_restarts_the_gang(ops, core):
    """The operator's in-place decisions against the real API server (KWOK pods, no trainer): only the failed
    pod is recreated, in the same attempt; the rendezvous store pod is made with the pods, and losing it while
    they run restarts the gang as a disruption, with a new store."""

    def store():
        found = core.list_namespaced_pod(ops.ns, field_selector="metadata.name=j-rdzv").items
        return found[0] if found and found[0].status.phase == "Running" else None

    ops.create(gpu_job().spec("failurePolicy.inPlaceRestarts", 2))
    pods = ops.wait_running_attempt(1, 2)
    first = wait_for(store, what="the store pod")
    assert first.metadata.labels["training.sharded.dev/role"] == "rendezvous" and first.metadata.owner_references
    uids = {p.metadata.name: p.metadata.uid for p in pods}
    ops.exit("j-1", 1)

    def replaced():
        now = {p.metadata.name: p.metadata.uid for p in ops.pods() if p.status.phase == "Running"}
        return len(now) == 2 and now["j-1"] != uids["j-1"] and now

    now = wait_for(replaced, what="j-1 replaced alone")
    status = wait_for(lambda: (s := ops.status())["recovery"]["pending"] == [] and s, what="nothing pending")
    assert now["j-0"] == uids["j-0"] and status["attempt"] == 1 and status["restarts"] == 0
    assert status["podReplacements"] == 1 and status["recovery"]["retired"] == []
    assert store().metadata.uid == first.metadata.uid

    core.delete_namespaced_pod("j-rdzv", ops.ns, grace_period_seconds=0)
    ops.wait_running_attempt(2, 2)
    status = ops.status()
    assert status["lastFailure"]["reason"] == "RendezvousLost" and status["disruptions"] == 1
    assert status["restarts"] == 0
    assert wait_for(store, what="a new store").metadata.uid != first.metadata.uid


def test_an_elastic_job_is_resized_by_editing_nodes(ops):
    ops.create(gpu_job(nodes=3).spec("elastic", {"minNodes": 2, "maxNodes": 3}))
    pods = ops.wait_running_attempt(1, 3)
    kept = {p.metadata.name: p.metadata.uid for p in pods if p.metadata.name != "j-2"}
    ops.patch_spec({"nodes": 2})
    wait_for(lambda: [p.metadata.name for p in ops.pods()] == ["j-0", "j-1"], what="j-2 deleted")
    assert {p.metadata.name: p.metadata.uid for p in ops.pods()} == kept
    assert ops.status()["desiredNodes"] == 2 and ops.status()["attempt"] == 1
    ops.patch_spec({"nodes": 3})
    pods = ops.wait_running_attempt(1, 3)
    assert {p.metadata.name: p.metadata.uid for p in pods if p.metadata.name != "j-2"} == kept
    status = ops.status()
    assert status["desiredNodes"] == 3 and status["attempt"] == 1 and status["podReplacements"] == 0


def test_an_eviction_seen_only_by_the_next_replica_past_the_in_place_budget_restarts_the_gang(ops, core, operator):
    """A pod evicted just before the operator dies is still Terminating (its grace) when the next replica
    lists it, with the eviction's DisruptionTarget: with the in-place budget spent, that replica restarts the
    gang as a disruption instead of waiting for the pod to go."""
    from kubernetes import client

    def evict(name: str) -> None:
        core.create_namespaced_pod_eviction(
            name, ops.ns, client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=ops.ns))
        )

    job = gpu_job().spec("failurePolicy.inPlaceRestarts", 1).spec("failurePolicy.inPlaceTimeoutSeconds", 86400)
    ops.create(job.spec("runPolicy.terminationGraceSeconds", 15))
    pods = ops.wait_running_attempt(1, 2)
    uid = {p.metadata.name: p.metadata.uid for p in pods}
    evict("j-1")
    wait_for(lambda: (s := ops.status()) and s.get("podReplacements") == 1, what="j-1 replaced alone")
    wait_for(lambda: any(p.metadata.name == "j-1" and p.metadata.uid != uid["j-1"] and p.status.phase == "Running"
                         for p in ops.pods()), timeout=90, what="the new j-1 running")  # fmt: skip
    evict("j-0")
    time.sleep(0.5)  # the old replica may see the eviction and die before it acts, as in the soak
    operator.kill()
    time.sleep(3)
    operator.start()
    ops.wait_running_attempt(2, 2)
    status = ops.status()
    assert (status["restarts"], status["disruptions"], status["podReplacements"]) == (0, 1, 1), status
