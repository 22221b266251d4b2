"""The pods the operator builds, run by the real kubelet: a node of the local control plane run by the kubelet
of the control plane's Kubernetes version with containerd, runc and the CNI bridge (hack/localstack/realnode.py),
not by the node agent's imitation of it.

Each pod is the operator's own (`podspec.build_pod`: its security contexts, /dev/shm, progress token, trainer
config, grace period) with the container's image and command swapped for a busybox shell that reports what
the kubelet gave it, so what is proven is what the kubelet does with the operator's spec: /dev/shm a
memory-backed tmpfs of the spec's size, the `restricted` contexts (uid, fsGroup, no capabilities, no new
privileges), a projected token for the operator's audience, requested by the kubelet under the node's own
identity, that the operator's verifier accepts as this pod's; SIGTERM on deletion and the exit code kept, then
SIGKILL at the end of the grace period; `kubectl logs` through the API server to the kubelet's TLS server;
the CLI's logs, exec and port-forward; Pod Security `restricted` admission; the operator's own handling of
an eviction, a suspend and a resume of pods the kubelet runs; and, on two real nodes, cluster DNS and the pod
network that a job's pods find and reach pod 0 through.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from localstack.nodeimages import PROBE_IMAGE, SNAPSHOT_REF, has_image, image_labels, manifest_digest, probe_image
from localstack.realnode import CLUSTER_DOMAIN, TAINT, RealNode, kept_root, stop_node
from sharded_api.contract import PodEnv
from sharded_operator.api.models import LABEL_ATTEMPT, LABEL_INDEX, LABEL_JOB
from sharded_operator.decide.views import PodView
from sharded_operator.render import children, podspec
from sharded_operator.run.issuer import IssuerKeys
from sharded_operator.settings import OperatorSettings
from support.jobs import make_job
from support.realnodes import logs, restricted_namespace
from support.reports import post

pytestmark = pytest.mark.realnode
SETTINGS = OperatorSettings(progress_url="http://op:8080/progress")
TOKEN = "/var/run/secrets/training.sharded.dev/progress/token"
HOLD = "sharded.dev/test-hold"  # keeps a deleted pod readable once the kubelet has stopped it
# The stubborn pod's grace period: long enough that a SIGTERM handled at once, on a loaded machine, ends first.
GRACE = 8


@pytest.fixture
def namespace(node):
    """A namespace enforcing Pod Security `restricted` (tests/conftest.py's is for the KWOK tiers)."""
    return restricted_namespace(node)


def run_probe(node: RealNode, job, index: int, script: str, *, hold: bool = False, grace: int | None = None) -> dict:
    """The operator's pod for `job`'s node `index` (and its trainer ConfigMap), its container running
    `script` in the probe image, on the real node."""
    api, ns = node.cluster.api, job.metadata["namespace"]
    config_map = children.build_config_map(job, SETTINGS)
    if (
        api("GET", f"/api/v1/namespaces/{ns}/configmaps?fieldSelector=metadata.name={config_map['metadata']['name']}")[
            "items"
        ]
        == []
    ):
        api("POST", f"/api/v1/namespaces/{ns}/configmaps", config_map)
    pod = podspec.build_pod(job, index, 1, SETTINGS)
    pod["metadata"].pop("ownerReferences", None)  # no job object here: nothing would collect it
    if hold:
        pod["metadata"]["finalizers"] = [HOLD]
    spec = pod["spec"]
    spec["nodeName"] = node.name
    spec["tolerations"] = [*spec.get("tolerations", []), {**TAINT, "operator": "Equal"}]
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    [container] = spec["containers"]
    container.update(image=PROBE_IMAGE, imagePullPolicy="Never", command=["/bin/sh", "-c", script])
    return api("POST", f"/api/v1/namespaces/{ns}/pods", pod)


def wait_pod(node: RealNode, ns: str, name: str, until, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        pod = node.cluster.api("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
        if until(pod):
            return pod
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} never got there: {json.dumps(pod.get('status'))[:1500]}\n"
                                 f"{node.log_tail('kubelet')}")  # fmt: skip
        time.sleep(0.3)


def phase_is(*phases: str):
    return lambda pod: pod["status"].get("phase") in phases


def test_a_training_pod_gets_its_shm_its_restricted_users_and_a_progress_token_bound_to_it(node, namespace):
    job = make_job("probe", namespace).spec("shmSize", "96Mi").model()
    script = (
        "echo df $(df -k /dev/shm | tail -n 1); echo mount $(grep ' /dev/shm ' /proc/mounts);"
        " echo uid $(id -u) groups $(id -G);"
        " grep -E '^(NoNewPrivs|CapEff)' /proc/self/status; echo shm $(stat -c '%u %g %a' /dev/shm);"
        f" echo token $(cat {TOKEN}); echo config $(head -c 200 /etc/sharded/trainer.yaml | tr '\\n' ' ')"
    )
    created = run_probe(node, job, 0, script)
    pod = wait_pod(node, namespace, created["metadata"]["name"], phase_is("Succeeded", "Failed"))
    out = logs(node, namespace, created["metadata"]["name"])
    assert pod["status"]["phase"] == "Succeeded", out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}

    assert lines["df"][1] == str(96 * 1024), out  # 1K blocks: the spec's 96Mi
    assert lines["mount"][:3] == ["tmpfs", "/dev/shm", "tmpfs"], out  # memory-backed
    uid = str(SETTINGS.pod_uid)
    assert lines["uid"][0] == uid and uid in lines["uid"][2:], out  # runAsUser, and fsGroup among its groups
    assert lines["shm"] == ["0", uid, "3777"], out  # the fsGroup's, setgid and sticky: the node agent copies it
    assert lines["NoNewPrivs:"] == ["1"] and lines["CapEff:"] == ["0000000000000000"], out
    assert lines["config"], out  # the trainer config from the operator's ConfigMap

    # The token the kubelet requested for the pod: the operator's verifier (offline, against the issuer's keys)
    # takes it as this pod's, and its lifetime is the one the operator asked for.
    [token] = lines["token"]
    api = node.cluster.api
    keys = IssuerKeys(lambda: api("GET", "/.well-known/openid-configuration"), lambda: api("GET", "/openid/v1/jwks"))
    keys.refresh()
    sender = keys.verify(token, SETTINGS.progress_audience)
    assert (sender.namespace, sender.pod_name, sender.pod_uid) == (namespace, pod["metadata"]["name"],
                                                                   pod["metadata"]["uid"])  # fmt: skip
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert claims["exp"] - claims["iat"] == SETTINGS.token_seconds
    assert claims["kubernetes.io"]["node"]["name"] == node.name  # requested with the node's identity


def test_a_deleted_pod_gets_sigterm_and_keeps_its_exit_code_then_sigkill_at_the_end_of_its_grace(node, namespace):
    """The trainer's stop path as the kubelet drives it: deleting a pod sends SIGTERM (the trainer checkpoints
    and exits 75, which the operator reads as stopped, not failed); a process that ignores it is killed when
    the pod's grace period ends (137), not before."""
    job = make_job("stop", namespace).model()
    ready = "echo up; while [ ! -e /dev/shm/stop ]; do sleep 0.2; done"
    polite = run_probe(node, job, 0, f"trap 'echo term; exit 75' TERM; {ready}", hold=True)
    stubborn = run_probe(node, job, 1, f"trap 'echo ignored' TERM; {ready}", hold=True, grace=GRACE)
    names = [polite["metadata"]["name"], stubborn["metadata"]["name"]]
    try:
        for name in names:
            wait_pod(node, namespace, name, phase_is("Running"))
            deadline = time.monotonic() + 20
            while "up" not in logs(node, namespace, name):  # the trap is set once it has printed
                assert time.monotonic() < deadline
                time.sleep(0.2)
        deleted = time.time()
        for name in names:
            node.cluster.api("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")
        views = {}
        for name in names:
            pod = wait_pod(node, namespace, name, phase_is("Succeeded", "Failed"), timeout=60)
            views[name] = PodView.from_pod(pod)
        stopped, killed = views[names[0]], views[names[1]]
        assert (stopped.exit_code, stopped.deleting) == (75, True), stopped
        assert killed.exit_code == 137, killed
        took = {name: dt.datetime.fromisoformat(v.finished_at).timestamp() - deleted for name, v in views.items()}
        assert took[names[0]] < GRACE <= took[names[1]] + 1, took  # SIGKILL waits for the grace (whole seconds)
    finally:
        for name in names:
            node.cluster.api(
                "PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}", {"metadata": {"finalizers": None}},
                content_type="application/merge-patch+json",
            )  # fmt: skip


def test_a_node_its_launcher_lost_is_stopped_by_its_pid_files_and_leaves_nothing_mounted_or_running(node, namespace):
    """`make cluster-down`, or the next `up`, after a launcher died with a pod running: the node is found by
    its pid files, its containers killed through containerd, and every mount under its root undone."""
    lost = RealNode(node.cluster, 3).start([probe_image()])
    job = make_job("lost", namespace).model()
    created = run_probe(lost, job, 0, "sleep 600")
    wait_pod(node, namespace, created["metadata"]["name"], phase_is("Running"))

    def under_root() -> tuple[list[str], list[str]]:
        mounts = [m.split()[1] for m in Path("/proc/mounts").read_text().splitlines() if f" {lost.root}/" in m]
        running = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if str(lost.root).encode() in cmdline.read_bytes():
                    running.append(cmdline.parent.name)
            except OSError:  # gone meanwhile
                pass
        return mounts, running

    mounts, running = under_root()
    assert any(m.endswith("/dev/shm") or "volumes" in m for m in mounts) and running, (mounts, running)
    lost.procs.clear()  # the launcher's handles are gone: only what is on disk is left
    stop_node(node.cluster.workdir, lost.root)
    assert under_root() == ([], []), under_root()
    assert not list((node.cluster.workdir / "pids").glob(f"{lost.name}-*"))
    # Its Node object would look Ready to the scheduler until the node controller's grace runs out.
    node.cluster.api("DELETE", f"/api/v1/nodes/{lost.name}")


def test_a_node_started_again_on_its_kept_root_drops_the_containers_an_unclean_stop_left(node):
    """A node's containerd root outlives the run (its images are kept), so whatever a node stopped without
    stop_node left in it (a machine reset, a launcher SIGKILLed with its children) is there at the next start:
    container records the kubelet would see through the CRI. The next start removes them before the kubelet
    runs, and takes the kept root over from the dead owner. Its images are kept only unpacked."""
    first = RealNode(node.cluster, 4).start([probe_image()])
    kept = kept_root(first.name)
    assert int((kept / "owner").read_text()) == first.procs["containerd"].pid
    first.ctr("containers", "create", PROBE_IMAGE, "left-by-a-crash")
    # Stopped as a crash stops it: no stop_node, nothing removed, the owner file left naming a dead pid.
    for proc in first.procs.values():
        os.killpg(proc.pid, 9)
        proc.wait()
    again = RealNode(node.cluster, 4).start([probe_image()])
    try:
        assert again.ctr("containers", "ls", "-q").stdout.split() == []
        assert int((kept / "owner").read_text()) == again.procs["containerd"].pid
        # A kept image counts as there only unpacked: an import that failed while unpacking leaves the image's
        # record and config without the label naming its snapshots, and the next run must import it again.
        manifest = manifest_digest(again, PROBE_IMAGE)
        config = json.loads(again.ctr("content", "get", manifest).stdout)["config"]["digest"]
        assert has_image(again, PROBE_IMAGE, config) and not has_image(again, PROBE_IMAGE, "sha256:" + "0" * 64)
        [(label, chain)] = [(k, v) for k, v in image_labels(again, config).items() if k.startswith(SNAPSHOT_REF)]
        again.ctr("content", "label", config, f"{label}=")
        try:
            assert not has_image(again, PROBE_IMAGE, config)
        finally:
            again.ctr("content", "label", config, f"{label}={chain}")
        assert has_image(again, PROBE_IMAGE, config)
    finally:
        again.stop()
        node.cluster.api("DELETE", f"/api/v1/nodes/{again.name}")
    assert not (kept / "owner").exists()


def test_the_cli_reads_logs_execs_and_forwards_a_port_through_the_real_kubelet_in_a_restricted_namespace(
    node, namespace
):
    """`sharded logs`, `sharded exec` and `sharded port-forward` against a job's pod on the real node: the API
    server's pods/log, pods/exec and pods/portforward, served by the kubelet's TLS server and containerd (the
    e2e tier proves them on the node agent). The namespace enforces `restricted`: the operator's pod is
    admitted, and a pod that asks for root is not."""
    import socket

    from localstack.stack import install_crd
    from sharded_operator.api.models import GROUP, PLURAL, VERSION

    api, cluster = node.cluster.api, node.cluster
    with pytest.raises(urllib.error.HTTPError) as refused:
        api("POST", f"/api/v1/namespaces/{namespace}/pods", {
            "metadata": {"name": "root"},
            "spec": {"nodeName": node.name, "containers": [{"name": "c", "image": PROBE_IMAGE,
                                                             "securityContext": {"runAsUser": 0}}]},
        })  # fmt: skip
    assert refused.value.code == 403 and "violates PodSecurity" in refused.value.read().decode()

    # The job object the CLI reads (no operator here: its status names attempt 1, whose pod the test makes).
    install_crd(cluster.kubeconfig)
    built = make_job("cli", namespace)
    jobs = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    api("POST", jobs, built.manifest())
    api("PATCH", f"{jobs}/cli/status", {"status": {"attempt": 1}}, "application/merge-patch+json")
    script = (
        "echo hello from the real kubelet; mkdir /dev/shm/www;"
        " echo served by the kubelet > /dev/shm/www/index.html; exec httpd -f -p 127.0.0.1:8000 -h /dev/shm/www"
    )
    pod = run_probe(node, built.model(), 0, script)["metadata"]["name"]
    wait_pod(node, namespace, pod, phase_is("Running"))

    env = {"PATH": "/usr/bin:/bin"}

    def sharded(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sharded_operator.cli.main", "--kubeconfig",
                               str(cluster.kubeconfig), "-n", namespace, *args], capture_output=True, text=True,
                              env=env, timeout=60, **kw)  # fmt: skip

    deadline = time.monotonic() + 30
    while "[node-0] hello from the real kubelet" not in (out := sharded("logs", "cli")).stdout:
        assert time.monotonic() < deadline, (out.stdout, out.stderr)
        time.sleep(0.5)
    # The command's output and exit code, as the trainer's user (restricted: not root).
    ran = sharded("exec", "cli", "--", "sh", "-c", "echo $((6 * 7)) $(id -u); echo to-stderr >&2; exit 3")
    assert (ran.returncode, ran.stdout.split(), ran.stderr.strip()) == (3, ["42", str(SETTINGS.pod_uid)],
                                                                         "to-stderr"), ran  # fmt: skip
    forward = subprocess.Popen([sys.executable, "-m", "sharded_operator.cli.main", "--kubeconfig",
                                str(cluster.kubeconfig), "-n", namespace, "port-forward", "cli", "0:8000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        first = forward.stdout.readline()
        assert first.startswith("Forwarding from 127.0.0.1:") and f"(pod {pod})" in first, first
        local = int(first.split(":")[1].split()[0])
        deadline = time.monotonic() + 30
        while True:  # httpd binds once the shell has written its page
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=10) as r:
                    assert r.read() == b"served by the kubelet\n"
                break
            except (OSError, urllib.error.URLError):
                assert time.monotonic() < deadline
                time.sleep(0.5)
    finally:
        forward.terminate()
        forward.wait(timeout=10)
    # The server is on the pod's loopback only: the forward entered the pod's network namespace to reach it.
    pod_ip = api("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")["status"]["podIP"]
    with pytest.raises(OSError):
        socket.create_connection((pod_ip, 8000), timeout=5).close()


def test_the_operator_runs_a_job_on_the_real_kubelet_through_an_eviction_a_kill_a_suspend_and_a_resume(
    node, namespace, tmp_path
):
    """The operator's own pods on the real node, their lifecycle driven by the kubelet: the progress token
    the kubelet mounted is accepted by the operator's /progress as the live pod's (and refused once that pod
    is gone); a pod evicted through the Eviction API (the API server marks it DisruptionTarget, the kubelet
    stops it with SIGTERM, the trainer's stand-in exits 75) restarts the gang as a disruption, not a failure;
    a container SIGKILLed on the node is a failure with the kubelet's exit code 137, and the gang restarts;
    a suspend stops the pod with SIGTERM and leaves the job Suspended; a resume starts a fresh attempt that
    finishes. The image is the probe's, whose `python` runs the job's spec.command in place of the trainer
    (the e2e tier trains)."""
    import signal

    from localstack.stack import OperatorProcess, install_crd
    from sharded_api.contract import ProgressReport
    from sharded_operator.api.models import GROUP, PLURAL, VERSION

    api, cluster = node.cluster.api, node.cluster
    install_crd(cluster.kubeconfig)
    operator = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", RESTART_GRACE_SECONDS="10",
                               SUSPEND_GRACE_SECONDS="10").start()  # fmt: skip
    jobs = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    # Stopped with SIGTERM, it exits 75 as the trainer does after its final checkpoint; attempt 4 finishes.
    script = (f"echo token $(cat {TOKEN}); echo attempt ${PodEnv.ATTEMPT}; [ ${PodEnv.ATTEMPT} -ge 4 ] && exit 0;"
              " trap 'echo stopping; exit 75' TERM; while :; do sleep 0.2; done")  # fmt: skip
    body = (make_job("evict", namespace).image(PROBE_IMAGE).nodes(1).procs(1)
            .spec("command", ["/bin/sh", "-c", script]).spec("pod", {"imagePullPolicy": "Never"})
            .spec("scheduling", {"tolerations": [{**TAINT, "operator": "Equal"}],
                                 "nodeSelector": {"kubernetes.io/hostname": node.name}}).manifest())  # fmt: skip

    def status() -> dict:
        return api("GET", f"{jobs}/evict").get("status") or {}

    def wait(pred, what: str, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while not pred(s := status()):
            if time.monotonic() > deadline:
                pods = api("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
                seen = [(p["metadata"]["name"], p["spec"].get("nodeName"), p["status"]) for p in pods]
                raise AssertionError(f"{what}: {json.dumps(s)[:1000]}\npods: {json.dumps(seen)[:3000]}\n"
                                     f"{operator.log.read_text()[-1500:]}")  # fmt: skip
            time.sleep(0.3)
        return s

    def report(token: str, attempt: int, step: int) -> tuple[int, str]:
        """A progress report for `attempt` with a token the kubelet mounted in a pod, as its trainer posts it."""
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = ProgressReport(uid=uid, namespace=namespace, name="evict", attempt=attempt, run="probe", step=step,
                              total_steps=10, updated_at=now)  # fmt: skip
        code, answer = post(operator, body.model_dump_json(by_alias=True, exclude_none=True).encode(), token)
        return code, json.dumps(answer)

    tokens: dict[int, str] = {}  # attempt -> the token its pod's log printed

    def running_pod(attempt: int) -> str:
        wait(lambda s: s.get("attempt") == attempt and s.get("phase") == "Running", f"attempt {attempt} running")
        pods = api("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={LABEL_ATTEMPT}={attempt}")["items"]
        [pod] = [p for p in pods if p["metadata"]["labels"].get(LABEL_INDEX) == "0"]
        name = pod["metadata"]["name"]
        wait_pod(node, namespace, name, phase_is("Running"))
        deadline = time.monotonic() + 30
        while f"attempt {attempt}" not in (out := logs(node, namespace, name)):  # the trap is set once printed
            assert time.monotonic() < deadline
            time.sleep(0.2)
        tokens[attempt] = next(line.split()[1] for line in out.splitlines() if line.startswith("token "))
        return name

    try:
        uid = api("POST", jobs, body)["metadata"]["uid"]
        pod = running_pod(1)
        code, why = report(tokens[1], 1, 3)
        assert code == 200, (why, operator.log.read_text()[-2000:])
        wait(lambda s: (s.get("progress") or {}).get("step") == 3, "the reported step in status")
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
        api("POST", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", eviction)
        s = wait(lambda s: s.get("attempt") == 2, "a restart after the eviction")
        assert (s["disruptions"], s.get("restarts", 0)) == (1, 0), s
        # Decided from the condition the API server set, as the kubelet began to stop the pod.
        assert s["lastFailure"]["reason"] == "DisruptionTarget" and s["lastFailure"]["pod"] == pod, s

        pod = running_pod(2)  # the same name, a new pod
        # The evicted pod's token cannot report for the new attempt: its pod is gone (or, as the operator last
        # read it, of attempt 1).
        code, why = report(tokens[1], 2, 5)
        assert code == 403 and ("gone" in why or "belongs to attempt 1" in why), (code, why)
        assert report(tokens[2], 2, 5)[0] == 200

        # SIGKILL to the container's process on the node (the container's own PID 1 cannot be killed from inside).
        [pid] = [int(c.parent.name) for c in Path("/proc").glob("[0-9]*/cmdline") if _is_attempt(c.parent, script, 2)]
        os.kill(pid, signal.SIGKILL)
        s = wait(lambda s: s.get("attempt") == 3, "a restart after the kill")
        assert (s["disruptions"], s["restarts"], s["lastFailure"]["exitCode"]) == (1, 1, 137), s
        assert s["lastFailure"]["pod"] == pod, s

        running_pod(3)
        api("PATCH", jobs + "/evict", {"spec": {"runPolicy": {"suspend": True}}}, "application/merge-patch+json")
        wait(lambda s: s.get("phase") == "Suspended", "Suspended")
        wait_for_no_pods = time.monotonic() + 60
        while api("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={LABEL_ATTEMPT}=3")["items"]:
            assert time.monotonic() < wait_for_no_pods, "the suspended attempt's pod was never removed"
            time.sleep(0.3)
        api("PATCH", jobs + "/evict", {"spec": {"runPolicy": {"suspend": False}}}, "application/merge-patch+json")
        s = wait(lambda s: s.get("phase") in ("Succeeded", "Failed"), "finished")
        assert (s["phase"], s["attempt"], s["disruptions"], s["restarts"]) == ("Succeeded", 4, 1, 1), s
    finally:
        api("DELETE", f"{jobs}/evict")
        operator.stop()


def _is_attempt(proc: Path, script: str, attempt: int) -> bool:
    """Whether the process `proc` (a /proc entry) runs `script` for `attempt`: the container's shell."""
    try:
        return (proc / "cmdline").read_bytes().split(b"\0")[-2] == script.encode() and (
            f"{PodEnv.ATTEMPT}={attempt}".encode() in (proc / "environ").read_bytes().split(b"\0")
        )
    except (OSError, IndexError):
        return False


def test_a_jobs_pods_on_two_real_nodes_reach_pod_0_by_its_name_through_cluster_dns(
    node, second_node, namespace, tmp_path
):
    """What every multi-node job needs before torchrun's rendezvous: the operator gives each pod pod 0's name
    under the job's headless Service (MASTER_ADDR); the kubelet points the pod's resolver at cluster DNS
    (CoreDNS built from its module, answering from the API server), which resolves that name to pod 0's
    address; and the pod network carries a connection from the other node to it. Pod 0 listens on
    MASTER_PORT; the other pod, on the other real node, resolves and connects, and says where it runs."""
    from localstack.stack import OperatorProcess, install_crd
    from sharded_operator.api.models import GROUP, PLURAL, VERSION

    api, cluster = node.cluster.api, node.cluster
    install_crd(cluster.kubeconfig)
    operator = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log").start()
    jobs = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    rank, addr, port = f"${PodEnv.NODE_RANK}", f"${PodEnv.MASTER_ADDR}", f"${PodEnv.MASTER_PORT}"
    script = (f'if [ "{rank}" = 0 ]; then echo "listening on {port}"; exec nc -l -p {port}; fi; '
              f"nslookup {addr}.{CLUSTER_DOMAIN}; "
              f'until echo "from ${PodEnv.NODE_NAME}" | nc -w 2 {addr} {port}; do sleep 0.5; done')  # fmt: skip
    hostname = "kubernetes.io/hostname"
    affinity = {
        # Only the two real nodes, and never both pods on one: pod 1 keeps off pod 0's node.
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchExpressions": [{"key": hostname, "operator": "In", "values": [node.name, second_node.name]}]}]}},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {LABEL_JOB: "dns", LABEL_INDEX: "0"}}, "topologyKey": hostname}]},
    }  # fmt: skip
    body = (make_job("dns", namespace).image(PROBE_IMAGE).nodes(2).procs(1)
            .spec("command", ["/bin/sh", "-c", script]).spec("pod", {"imagePullPolicy": "Never"})
            .spec("runPolicy", {"cleanPodPolicy": "None"})  # the finished pods' logs are read below
            .spec("scheduling", {"tolerations": [{**TAINT, "operator": "Equal"}], "affinity": affinity})
            .manifest())  # fmt: skip
    try:
        api("POST", jobs, body)
        deadline = time.monotonic() + 120
        while (status := api("GET", f"{jobs}/dns").get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            if time.monotonic() > deadline:
                pods = api("GET", f"/api/v1/namespaces/{namespace}/pods")["items"]
                tails = {p["metadata"]["name"]: logs(node, namespace, p["metadata"]["name"]) for p in pods
                         if p["status"].get("phase") in ("Running", "Succeeded", "Failed")}  # fmt: skip
                raise AssertionError(f"not finished: {json.dumps(status)[:800]}\n{tails}\n"
                                     f"{(cluster.workdir / 'logs' / 'coredns.log').read_text()[-1500:]}")  # fmt: skip
            time.sleep(0.5)
        pods = api("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={LABEL_JOB}=dns,{LABEL_INDEX}")["items"]
        placed = {p["metadata"]["labels"][LABEL_INDEX]: p["spec"]["nodeName"] for p in pods}
        assert status["phase"] == "Succeeded", (status, placed)
        assert sorted(placed.values()) == sorted([node.name, second_node.name]), placed
        [pod0] = [p["metadata"]["name"] for p in pods if p["metadata"]["labels"][LABEL_INDEX] == "0"]
        # Pod 0 heard from the pod on the other node, by pod 0's name under the headless Service.
        assert f"from {placed['1']}" in logs(node, namespace, pod0)
        queried = (cluster.workdir / "logs" / "coredns.log").read_text()
        assert f"{pod0}.dns.{namespace}.svc.{CLUSTER_DOMAIN}." in queried, queried[-1500:]
    finally:
        api("DELETE", f"{jobs}/dns")
        operator.stop()
