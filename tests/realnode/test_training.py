"""Training on two nodes run by the real kubelet: the trainer image built from trainer/Dockerfile in each node's
containerd, FSDP2 and ZeRO-2 jobs through the operator in a namespace enforcing `restricted`. What is proven
here and not in the e2e tier: torchrun's rendezvous across two kubelets' pods by pod 0's name through cluster
DNS; checkpoints on a `local` PersistentVolume the kubelet mounts and gives the job's fsGroup; progress posted
to the operator from inside the pods with the token the kubelet requested for them; and a container SIGKILLed
on its node, the gang restarted and resumed from the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from localstack.nodeimages import import_docker_images
from localstack.realnode import TAINT, RealNode, bridge_address
from sharded_api.contract import PodEnv
from sharded_operator.api.models import GROUP, LABEL_ATTEMPT, LABEL_INDEX, LABEL_JOB, PLURAL, VERSION
from sharded_trainer.checkpoint.manager import committed_steps
from support.jobs import local_cpu_job
from support.realnodes import logs, restricted_namespace

pytestmark = pytest.mark.realnode
# The operator's address for the pods: on the nodes' host-only bridge, which pods reach through their node (as
# cluster DNS is reached); loopback is the pods' own.
OPERATOR_IP = "10.201.0.253"
UID = 1000  # the operator's default runAsUser and fsGroup, the image's user
HOSTNAME = "kubernetes.io/hostname"


@pytest.fixture
def namespace(node):
    """A namespace enforcing Pod Security `restricted` (tests/conftest.py's is for the KWOK tiers)."""
    return restricted_namespace(node)


@pytest.fixture(scope="module")
def nodes(node, second_node, images) -> tuple[RealNode, RealNode]:
    """Both real nodes with the trainer image in their containerd (imported once per build: kept between runs)."""
    import_docker_images([node, second_node], [images["trainer"]])
    return node, second_node


@pytest.fixture(scope="module")
def operator(nodes, tmp_path_factory):
    from localstack.stack import OperatorProcess, install_crd

    cluster = nodes[0].cluster
    bridge_address(OPERATOR_IP)
    install_crd(cluster.kubeconfig)
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log", host=OPERATOR_IP,
                         RESTART_GRACE_SECONDS="10").start()  # fmt: skip
    yield op
    op.stop()
    bridge_address(OPERATOR_IP, present=False)


def local_volume(nodes: tuple[RealNode, ...], namespace: str, claim: str) -> Path:
    """A `local` PersistentVolume for the job's checkpoint claim, reachable from both nodes (one host's
    directory); the kubelet's local-volume plugin applies the pod's fsGroup to it, as it does on a cluster."""
    return nodes[0].cluster.add_volume(f"{namespace}-{claim}", "1Gi", nodes=[n.name for n in nodes],
                                       claim=(namespace, claim))  # fmt: skip


def real_job(name: str, strategy: str, steps: int, nodes: tuple[RealNode, ...], image: str) -> dict:
    """The local CPU job (2 nodes, gloo) with one process per node, placed one pod on each real node."""
    affinity = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchExpressions": [{"key": HOSTNAME, "operator": "In", "values": [n.name for n in nodes]}]}]}},
        # Only the training pods repel each other (the rendezvous store's pod goes where it fits).
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {LABEL_JOB: name},
                              "matchExpressions": [{"key": LABEL_INDEX, "operator": "Exists"}]},
            "topologyKey": HOSTNAME}]},
    }  # fmt: skip
    return (local_cpu_job(name, strategy, steps).image(image).procs(1)
            .spec("pod", {"imagePullPolicy": "Never"})
            .spec("runPolicy", {"cleanPodPolicy": "None"})  # the pods' logs are read after the end
            .spec("scheduling", {"tolerations": [{**TAINT, "operator": "Equal"}], "affinity": affinity})
            .manifest())  # fmt: skip


class RealJob:
    def __init__(self, node: RealNode, namespace: str, name: str, operator):
        self.node, self.ns, self.name, self.operator = node, namespace, name, operator
        self.path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"

    def status(self) -> dict:
        return self.node.cluster.api("GET", self.path).get("status") or {}

    def patch(self, spec: dict) -> None:
        self.node.cluster.api("PATCH", self.path, {"spec": spec}, "application/merge-patch+json")

    def pods(self, selector: str = "") -> list[dict]:
        query = f"labelSelector={LABEL_JOB}={self.name}{selector}"
        return self.node.cluster.api("GET", f"/api/v1/namespaces/{self.ns}/pods?{query}")["items"]

    def wait(self, pred, what: str, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while not pred(s := self.status()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: {what}: {json.dumps(s)[:1000]}\n{self.explain()}")
            time.sleep(0.5)
        return s

    def explain(self) -> str:
        tails = []
        for p in self.pods():
            if p["status"].get("phase") in ("Running", "Succeeded", "Failed"):
                tails.append(f"--- {p['metadata']['name']} on {p['spec'].get('nodeName')}\n"
                             f"{logs(self.node, self.ns, p['metadata']['name'])[-2000:]}")  # fmt: skip
            else:
                tails.append(f"--- {p['metadata']['name']}: {json.dumps(p['status'])[:600]}")
        return "\n".join([*tails, f"--- operator\n{self.operator.log.read_text()[-2000:]}"])


def container_init(job: str, rank: int, attempt: int) -> int:
    """The host pid of the container process (its PID 1) of `job`'s node `rank` in `attempt`."""
    want = {f"{PodEnv.JOB_NAME}={job}", f"{PodEnv.NODE_RANK}={rank}", f"{PodEnv.ATTEMPT}={attempt}"}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
            nspid = next(line for line in (proc / "status").read_text().splitlines() if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if want <= env and nspid.split()[-1] == "1":
            return int(proc.name)
    raise AssertionError(f"no container process of {job} rank {rank} attempt {attempt}")


def follow(node: RealNode, ns: str, pod: str) -> tuple[subprocess.Popen, Path]:
    """`kubectl logs -f` of a pod into a file, as a user watches a job: what it printed up to its end, even
    once the pod is deleted."""
    out = node.root.parent.parent / f"{ns}-{pod}.log"
    cluster = node.cluster
    proc = subprocess.Popen([str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.kubeconfig), "-n", ns,
                             "logs", "-f", pod], stdout=out.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    return proc, out


def events(text: str, event: str) -> list[dict]:
    return [json.loads(line[8:]) for line in text.splitlines()
            if line.startswith("METRICS ") and f'"event": "{event}"' in line]  # fmt: skip


# (strategy, what happens on the way): suspended and resumed; a container SIGKILLed, the gang restarted; the
# same with in-place restarts on, the pod replaced alone while the other node's workers restart in place.
CASES = [("fsdp", "suspend"), ("zero2", "kill"), ("fsdp", "kill-in-place")]


@pytest.mark.parametrize(("strategy", "fault"), CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_a_job_trains_across_two_real_nodes_with_checkpoints_on_a_local_volume_under_its_fsgroup(
    nodes, operator, namespace, images, strategy, fault
):
    """A job on both real nodes to Succeeded: every pod on its own node, the trainer's progress reports (with
    the kubelet's token) in status, the checkpoints committed on the volume, written by the image's user and
    group-owned by the fsGroup the kubelet gave the volume. On the way, after the first checkpoint: a suspend,
    where the kubelet's SIGTERM has the trainer write a checkpoint at the step it stopped at, within the grace
    period, and the resume continues from that step; or node 1's container SIGKILLed on its node, exit 137 as
    the kubelet reports it, and the gang restarted from the newest checkpoint, or, with in-place restarts on,
    that pod alone replaced while pod 0 (not recreated) restarts its workers in place."""
    name, steps = f"real-{strategy}-{fault}", 120 if fault == "suspend" else 100
    volume = local_volume(nodes, namespace, f"{name}-checkpoints")
    job = RealJob(nodes[0], namespace, name, operator)
    body = real_job(name, strategy, steps, nodes, images["trainer"])
    if fault == "kill-in-place":
        body["spec"]["failurePolicy"]["inPlaceRestarts"] = 2
    nodes[0].cluster.api("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}", body)
    job.wait(lambda s: (s.get("lastCheckpoint") or {}).get("step", 0) >= 10, "a first checkpoint")
    first_pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in job.pods(f",{LABEL_INDEX}")}
    if fault == "suspend":
        [pod0] = [p["metadata"]["name"] for p in job.pods(f",{LABEL_INDEX}=0")]
        watcher, printed = follow(nodes[0], namespace, pod0)
        job.patch({"runPolicy": {"suspend": True}})
        job.wait(lambda s: s.get("phase") == "Suspended" and not job.pods(f",{LABEL_INDEX}"), "Suspended, pods gone")
        watcher.wait(timeout=60)  # the stream ends with the container
        preempted = events(printed.read_text(), "preempted")
        assert preempted, printed.read_text()[-3000:]
        stopped = preempted[0]
        assert committed_steps(volume / name)[-1] == stopped["step"], stopped  # written before the SIGKILL
        steps = stopped["step"] + 10  # a shorter run, edited while suspended: the resumed leg is 10 steps
        job.patch({"trainer": {"steps": steps}})
        job.patch({"runPolicy": {"suspend": False}})
    else:
        os.kill(container_init(name, 1, 1), signal.SIGKILL)
    status = job.wait(lambda s: s.get("phase") in ("Succeeded", "Failed"), "finished")
    assert status["phase"] == "Succeeded", job.explain()
    attempt = status["attempt"]
    pods = job.pods(f",{LABEL_ATTEMPT}={attempt}")
    placed = {p["metadata"]["labels"][LABEL_INDEX]: p["spec"]["nodeName"] for p in pods}
    assert sorted(placed.values()) == sorted(n.name for n in nodes), placed
    assert status["progress"]["step"] == steps, status  # reported from the pods, with the kubelet's token
    assert committed_steps(volume / name)[-1] == steps
    files = [p for p in (volume / name).rglob("*") if p.is_file()]
    assert files and {(p.stat().st_uid, p.stat().st_gid) for p in files} == {(UID, UID)}
    assert volume.stat().st_gid == UID and volume.stat().st_mode & 0o2070 == 0o2070  # the kubelet's fsGroup
    [pod0] = [p["metadata"]["name"] for p in pods if p["metadata"]["labels"][LABEL_INDEX] == "0"]
    resumed = events(logs(nodes[0], namespace, pod0), "resumed")
    if fault == "suspend":
        assert (status.get("restarts", 0), attempt) == (0, 2), status
        assert [r["step"] for r in resumed] == [stopped["step"]], resumed
        return
    assert resumed and resumed[0]["step"] >= 10 and resumed[0]["step"] % 10 == 0, resumed
    if fault == "kill":
        assert (status["restarts"], attempt, status["lastFailure"]["exitCode"]) == (1, 2, 137), status
    else:  # the same attempt: pod 0 kept (its UID), pod 1 a new pod of the same name
        assert (status.get("restarts", 0), attempt, status["podReplacements"]) == (0, 1, 1), status
        assert status["recovery"]["last"]["exitCode"] == 137, status
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
        assert now.keys() == first_pods.keys() and now[pod0] == first_pods[pod0], (first_pods, now)
        assert [uid for n, uid in now.items() if n != pod0] != [uid for n, uid in first_pods.items() if n != pod0]
