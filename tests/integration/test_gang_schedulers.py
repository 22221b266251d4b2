"""Gang scheduling with the real schedulers: Volcano (its scheduler and controller manager) and the
scheduler-plugins coscheduling plugin (a kube-scheduler built with it, as a second scheduler), on the local
control plane with KWOK GPU nodes.

Each scheduler gets a pool of its own: two nodes of 4 GPUs, tainted so that only these tests' jobs (which
tolerate the taint and select the pool) land there. What a gang scheduler promises is then exact: a job of
three 4-GPU nodes can never run, two jobs of two 4-GPU nodes can never both run, and no pod of a job that
does not run whole is ever bound."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from kubernetes.client.rest import ApiException

from conftest import wait_for
from localstack.gang import COSCHEDULING_SCHEDULER, LocalCoscheduling, LocalVolcano
from sharded_operator.api.models import GROUP, PLURAL, VERSION
from sharded_operator.render.podgroup import COSCHEDULING_API, VOLCANO_API, VOLCANO_SCHEDULER
from support.jobs import make_job
from support.ops import Ops

pytestmark = pytest.mark.integration

POOL_GPUS = 4  # per node, two nodes per pool
TAINT = "sharded.dev/gang-test"


@dataclass
class Gang:
    provider: str  # spec.scheduling.gang.provider
    scheduler: str  # the pods' schedulerName
    api: str  # the PodGroup's apiVersion
    nodes: tuple[str, str]  # the pool
    volcano: LocalVolcano | None = None


@pytest.fixture(scope="module", params=["volcano", "scheduler-plugins"])
def gang(request, cluster, crd_installed, operator, tmp_path_factory):
    """One scheduler running, with its pool of two tainted 4-GPU nodes."""
    provider = request.param
    volcano = None
    if provider == "volcano":
        volcano = LocalVolcano(cluster).start()
        runner, scheduler, api = volcano, VOLCANO_SCHEDULER, VOLCANO_API
    else:
        runner = LocalCoscheduling(cluster, tmp_path_factory.mktemp("coscheduling")).start()
        scheduler, api = COSCHEDULING_SCHEDULER, COSCHEDULING_API
    nodes = (f"{provider}-pool-0", f"{provider}-pool-1")
    capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": str(POOL_GPUS)}
    for node in nodes:
        cluster.add_gpu_node(node, capacity, labels={"pool": provider},
                             taints=[{"key": TAINT, "value": provider, "effect": "NoSchedule"}])  # fmt: skip
    wait_for(lambda: all(_ready(cluster, n) for n in nodes), timeout=60, what="the pool's nodes Ready")
    yield Gang(provider, scheduler, api, nodes, volcano)
    runner.stop()
    for node in nodes:
        cluster.api("DELETE", f"/api/v1/nodes/{node}")


def _ready(cluster, node: str) -> bool:
    conditions = cluster.api("GET", f"/api/v1/nodes/{node}").get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@pytest.fixture
def ops(gang, core, custom, namespace, cluster, request):
    """The test's verbs; afterwards its jobs are deleted and the pool is empty again for the next test."""
    ops = Ops(core, custom, namespace)
    yield ops
    if getattr(request.node, "call_failed", False):
        explain(gang, ops, cluster)
    for job in custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]:
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job["metadata"]["name"])
    wait_for(lambda: not core.list_namespaced_pod(namespace).items, timeout=60, what="the test's pods gone")


def gang_job(gang: Gang, name: str, nodes: int, gpus: int = POOL_GPUS, **gang_fields):
    return (
        make_job(name).nodes(nodes).gpus(gpus)
        .spec("failurePolicy.backoffLimit", 3)
        .spec("scheduling", {
            "nodeSelector": {"pool": gang.provider},
            "tolerations": [{"key": TAINT, "operator": "Equal", "value": gang.provider, "effect": "NoSchedule"}],
            "schedulerName": gang.scheduler,
            "gang": {"enabled": True, "provider": gang.provider, "scheduleTimeoutSeconds": 30, **gang_fields},
        })
    )  # fmt: skip


def pod_group(cluster, gang: Gang, namespace: str, name: str) -> dict | None:
    try:
        return cluster.api("GET", f"/apis/{gang.api}/namespaces/{namespace}/podgroups/{name}")
    except OSError as e:
        if getattr(e, "code", None) == 404:
            return None
        raise


def explain(gang: Gang, ops: Ops, cluster) -> None:
    """What the scheduler and the operator saw: each job's status and PodGroup, each pod's node and
    conditions, and the scheduler's log."""
    for job in ops.custom.list_namespaced_custom_object(GROUP, VERSION, ops.ns, PLURAL)["items"]:
        name = job["metadata"]["name"]
        print(f"job {name} status: {job.get('status')}\nPodGroup: {pod_group(cluster, gang, ops.ns, name)}")
        for p in ops.pods(name):
            conds = [(c.type, c.status, c.reason, c.message) for c in p.status.conditions or []]
            print(f"  pod {p.metadata.name}: {p.status.phase} on {p.spec.node_name}: {conds}")
    component = "vc-scheduler" if gang.volcano else "coscheduler"
    print(f"--- {component} log\n{cluster.log_tail(component, 6000)}")


def bound(ops: Ops, name: str) -> list[str]:
    """The job's pods a scheduler has placed (bound to a node), of any attempt."""
    return [p.metadata.name for p in ops.pods(name) if p.spec.node_name]


def test_a_gang_that_cannot_fit_waits_unbound_and_says_why(gang, ops, cluster):
    # Three 4-GPU nodes on a pool of two: one pod per node would fit twice, the gang never.
    ops.create(gang_job(gang, "big", nodes=3))
    wait_for(lambda: len(ops.pods("big")) == 3, timeout=30, what="the job's three pods")
    status = wait_for(lambda: "Unschedulable" in (s := ops.status("big")).get("message", "") and s,
                      timeout=30, what="the scheduler's reason in status.message")  # fmt: skip
    for _ in range(8):  # several scheduling cycles of both schedulers: still nothing placed
        assert bound(ops, "big") == [], [(p.metadata.name, p.spec.node_name) for p in ops.pods("big")]
        time.sleep(0.5)
    status = ops.status("big")
    assert status["phase"] == "Starting" and status["message"].startswith("0/3 nodes running; pod big-"), status
    # The scheduler's own words: Volcano's for the member it cannot place (it calls the others "Schedulable"),
    # coscheduling's for the whole group, which its PostFilter turned away once one member did not fit.
    words = "Insufficient nvidia.com/gpu" if gang.volcano else "rejection in PostFilter"
    assert words in status["message"], status["message"]
    group = pod_group(cluster, gang, ops.ns, "big")
    assert group["spec"]["minMember"] == 3 and group["spec"]["minResources"]["nvidia.com/gpu"] == "12", group


def test_competing_gangs_run_one_whole_the_other_waits_whole_then_starts(gang, ops):
    # Each job needs the whole pool. Without a gang scheduler each would get one node and wait forever.
    ops.create(gang_job(gang, "a", nodes=2))
    ops.create(gang_job(gang, "b", nodes=2))
    # Coscheduling may first hold one pod of each gang at Permit: both are rejected and retried after a backoff,
    # which on a loaded machine has taken longer than 30 s to settle. What may never happen is checked throughout:
    # pods of both gangs bound (each would hold a node the other needs), or a gang left half-placed. A gang
    # scheduler decides for the whole gang, then binds its pods one request at a time (Volcano was seen with one
    # of two bound between two looks), so a half-placed gang must become whole, and soon.
    deadline, seen, half_since = time.monotonic() + 120, [], None
    while time.monotonic() < deadline:
        counts = (len(bound(ops, "a")), len(bound(ops, "b")))
        seen.append(counts)
        assert 0 in counts, seen  # never both
        half_since = (half_since or time.monotonic()) if 1 in counts else None
        assert half_since is None or time.monotonic() - half_since < 20, seen  # never left half-placed
        if 2 in counts and all(p.status.phase == "Running" for p in ops.pods("ab"[counts.index(2)])):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"neither gang ran whole: {seen}")
    first, second = ("a", "b") if counts[0] == 2 else ("b", "a")
    for _ in range(6):  # the loser stays whole outside
        assert bound(ops, second) == [], seen
        time.sleep(0.5)

    # The winner finishes: its GPUs free up and the waiting gang starts whole.
    for p in ops.pods(first):
        ops.exit(p.metadata.name, 0)
    ops.wait_phase("Succeeded", first)
    pods = ops.wait_running_attempt(1, 2, second, timeout=90)
    assert {p.spec.node_name for p in pods} == set(gang.nodes)


def test_a_gang_restart_a_resize_and_a_deletion_keep_the_pod_group_right(gang, ops, cluster, core):
    fields = {"queue": "research"} if gang.volcano else {}
    if gang.volcano:
        gang.volcano.open_queue("research")
    _priority_class(core, "gang-high", 1000)
    ops.create(gang_job(gang, "j", nodes=2, gpus=2, **fields).spec("scheduling.priorityClassName", "gang-high"))
    ops.wait_running_attempt(1, 2)
    group = pod_group(cluster, gang, ops.ns, "j")
    assert group["spec"]["minMember"] == 2 and group["spec"]["minResources"]["nvidia.com/gpu"] == "4"
    if gang.volcano:  # queue and priority reach the PodGroup, and Volcano schedules the gang in that queue
        assert group["spec"]["queue"] == "research" and group["spec"]["priorityClassName"] == "gang-high"
    assert all(p.spec.priority == 1000 for p in ops.pods("j"))

    # A worker fails: the gang restarts as a new attempt, scheduled whole again under the same PodGroup.
    ops.exit(ops.pods("j")[0].metadata.name, 1)
    ops.wait_running_attempt(2, 2)
    assert pod_group(cluster, gang, ops.ns, "j")["spec"]["minMember"] == 2

    # Suspended, resized to three nodes, resumed: the PodGroup waits for three before the pods are created.
    ops.patch_spec({"runPolicy": {"suspend": True}})
    ops.wait_phase("Suspended")
    wait_for(lambda: not ops.pods("j"), timeout=60, what="the suspended job's pods gone")
    ops.patch_spec({"nodes": 3})
    ops.patch_spec({"runPolicy": {"suspend": False}})
    pods = ops.wait_running_attempt(3, 3, timeout=90)
    group = pod_group(cluster, gang, ops.ns, "j")
    assert group["spec"]["minMember"] == 3 and group["spec"]["minResources"]["nvidia.com/gpu"] == "6", group
    assert {p.spec.node_name for p in pods} == set(gang.nodes)

    # Deleted: the PodGroup goes with the job (the garbage collector follows its owner reference).
    ops.custom.delete_namespaced_custom_object(GROUP, VERSION, ops.ns, PLURAL, "j")
    wait_for(lambda: pod_group(cluster, gang, ops.ns, "j") is None, timeout=60, what="the PodGroup deleted")


def test_an_elastic_gang_waits_for_min_nodes_and_grows_past_them(gang, ops, cluster):
    ops.create(gang_job(gang, "e", nodes=1).spec("elastic", {"minNodes": 1, "maxNodes": 2}))
    ops.wait_running_attempt(1, 1, name="e")
    assert pod_group(cluster, gang, ops.ns, "e")["spec"]["minMember"] == 1
    # Grown to two nodes within minNodes..maxNodes: the new pod is placed on its own, the group unchanged.
    ops.patch_spec({"nodes": 2}, name="e")
    wait_for(lambda: len([p for p in ops.pods("e") if p.status.phase == "Running"]) >= 2, timeout=60,
             what="the elastic job's second node running")  # fmt: skip
    assert pod_group(cluster, gang, ops.ns, "e")["spec"]["minMember"] == 1


def _priority_class(core, name: str, value: int) -> None:
    from kubernetes import client

    try:
        client.SchedulingV1Api(core.api_client).create_priority_class(
            {"metadata": {"name": name}, "value": value, "description": "gang scheduler tests"}
        )
    except ApiException as e:
        if e.status != 409:
            raise
