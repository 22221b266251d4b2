"""A local node agent: registers nodes in the local control plane and runs the pods scheduled onto them
as real processes, like a kubelet without containers. Dev and test tooling; not part of the operator.

Each pod gets a network namespace (veth on a bridge, its own IP), its own hostname (UTS namespace) and
mount namespace, and `/etc/netns/<ns>/hosts` listing every pod of its namespace as
`<pod>.<subdomain>.<namespace>.svc`, so a job's peers resolve to each other exactly as in a cluster.
Volumes: ConfigMap -> files, PVC -> its bound PV's hostPath directory (subPath honoured), emptyDir ->
a directory (a size-limited tmpfs for `medium: Memory`, which is how /dev/shm is sized). In process mode
(the default) images are ignored: `python` is this project's virtualenv interpreter. In container mode
(`--containers`, localstack.containers) each pod's container runs from its image through docker, with the
pod's user, fsGroup, limits and shm size. Requires root (as in CI) for namespaces.

    PYTHONPATH=hack python -m localstack.nodeagent --kubeconfig .cluster/kubeconfig --nodes 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from localstack import containers as podcontainers
from localstack.kubelet import KubeletServer
from localstack.podstart import BRIDGE, GATEWAY, NODE_LABEL, SUBNET, PodRun, PodStarter, can_isolate, now, sh

# The name of a fork server the trainer's agent forked from itself (sharded_trainer.agent.SERVER_NAME): its
# command line is the agent's, so only its name tells it apart.
FORKED_SERVER = b"sharded-forksrv"


class NodeAgent(PodStarter):
    """Runs the pods bound to `nodes` until stop(); see the module docstring."""

    def __init__(
        self, kubeconfig: str, workdir: Path, nodes: list[str], cpu: str = "8", memory: str = "32Gi",
        pki: Path | None = None, containers: bool = False,
    ):  # fmt: skip
        from kubernetes import client, config

        if not can_isolate():
            raise RuntimeError(
                "the node agent needs root and iproute2/util-linux (ip, unshare) to give each pod its own network "
                "namespace and hostname; run it as root (CI does), or use the KWOK-only integration tier"
            )
        self.api = client.CoreV1Api(config.new_client_from_config(config_file=kubeconfig))
        self.workdir, self.nodes = workdir, nodes
        self.capacity = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi"}
        self.runs: dict[str, PodRun] = {}
        self.down: set[str] = set()  # nodes whose kubelet is silent (lose_node): nothing on them is synced
        self._node_lock = threading.Lock()  # a heartbeat must not undo a node just lost
        self._next_ip = 10
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.python_bin = str(Path(sys.executable).parent)
        # With the cluster's CA: serve the kubelet's log and port-forward endpoints, which the API server proxies.
        self.pki = pki
        self.logs: KubeletServer | None = None
        self.containers = containers

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> NodeAgent:
        if self.pki is not None:
            self.logs = KubeletServer(self.pki, self._locate_log, self._locate_netns, self._enter).start()
        self._setup_bridge()
        for name in self.nodes:
            self._register(name)
        self._thread = threading.Thread(target=self._loop, name="nodeagent", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop every pod process (SIGTERM, then SIGKILL), remove namespaces, bridge and nodes."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=30)
        for run in list(self.runs.values()):
            self._kill(run, grace=5)
            self._cleanup(run)
        for name in self.nodes:
            with contextlib.suppress(Exception):
                self.api.delete_node(name)
        sh("ip", "link", "del", BRIDGE, check=False)
        for rule in self._forward_rules():
            sh("iptables", "-D", *rule, check=False)
        if self.logs:
            self.logs.stop()

    def _locate_log(self, namespace: str, name: str) -> tuple[Path, bool] | None:
        """The newest run of pod `namespace/name` on this agent: its log file and whether it still runs."""
        runs = [r for r in list(self.runs.values()) if (r.namespace, r.name) == (namespace, name)]
        if runs:
            run = runs[-1]
            return run.workdir / "container.log", run.proc is not None and run.proc.poll() is None
        logs = (self.workdir / "pods").glob(f"{namespace}_{name}_*/container.log")
        done = sorted(logs, key=lambda p: p.stat().st_mtime)
        return (done[-1], False) if done else None

    def _locate_netns(self, namespace: str, name: str) -> str | None:
        """The network namespace of pod `namespace/name` while it runs on this agent (what port-forward enters)."""
        runs = [r for r in list(self.runs.values()) if (r.namespace, r.name) == (namespace, name)]
        return runs[-1].netns if runs and runs[-1].proc is not None and runs[-1].proc.poll() is None else None

    def _enter(self, namespace: str, name: str) -> list[str] | None:
        """How to run a command in pod `namespace/name` while it runs here (what exec runs): in its container
        (container mode), or in the namespaces and environment of its process, in its working directory."""
        runs = [r for r in list(self.runs.values()) if (r.namespace, r.name) == (namespace, name)]
        run = runs[-1] if runs else None
        if run is None or run.proc is None or run.proc.poll() is not None:
            return None
        if self.containers:
            return ["docker", "exec", "-i", podcontainers.container_name(run.uid)]
        # `ip netns exec` and `unshare` exec'd into the container's process: its pid has the pod's namespaces.
        target = ["nsenter", "--target", str(run.proc.pid), "--net", "--mount", "--uts"]
        return [*target, "env", "-i", f"--chdir={run.cwd}", *(f"{k}={v}" for k, v in run.env.items())]

    def _setup_bridge(self) -> None:
        if sh("ip", "link", "show", BRIDGE, check=False).returncode != 0:
            sh("ip", "link", "add", BRIDGE, "type", "bridge")
            sh("ip", "addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        # dockerd sets the FORWARD policy to DROP (and br_netfilter sends bridged frames through it):
        # without these, pods on the bridge silently stop reaching each other once docker runs.
        for rule in self._forward_rules():
            if sh("iptables", "-C", *rule, check=False).returncode != 0:
                sh("iptables", "-I", *rule)

    @staticmethod
    def _forward_rules() -> list[list[str]]:
        if shutil.which("iptables") is None:
            return []
        return [["FORWARD", "-i", BRIDGE, "-j", "ACCEPT"], ["FORWARD", "-o", BRIDGE, "-j", "ACCEPT"]]

    def _register(self, name: str) -> None:
        from kubernetes.client.rest import ApiException

        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"type": NODE_LABEL, "kubernetes.io/hostname": name}},
        }
        try:
            self.api.create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
        self._heartbeat(name)

    def _heartbeat(self, name: str) -> None:
        t = now()
        conditions = [
            {"type": "Ready", "status": "True", "reason": "AgentReady", "message": "node agent is running"},
            *({"type": c, "status": "False", "reason": "AgentReady", "message": "ok"}
              for c in ("MemoryPressure", "DiskPressure", "PIDPressure")),
        ]  # fmt: skip
        for c in conditions:
            c.update(lastHeartbeatTime=t, lastTransitionTime=t)
        status = {
            "capacity": self.capacity,
            "allocatable": self.capacity,
            "conditions": conditions,
            # The API server reaches a node's kubelet (here: the log server) at its InternalIP and port.
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1" if self.logs else GATEWAY},
                          {"type": "Hostname", "address": name}],
            **({"daemonEndpoints": {"kubeletEndpoint": {"Port": self.logs.port}}} if self.logs else {}),
            "nodeInfo": {"kubeletVersion": "nodeagent", "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "process", "kernelVersion": os.uname().release},
        }  # fmt: skip
        self.api.patch_node_status(name, {"status": status})

    # --- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_beat = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() - last_beat > 10:
                    with self._node_lock:
                        for n in self.nodes:
                            if n not in self.down:
                                self._heartbeat(n)
                    last_beat = time.monotonic()
                self._sync()
                self._rotate_tokens()
            except Exception as e:  # an API hiccup must not stop the node
                print(f"[nodeagent] sync error: {e!r}", file=sys.stderr)
            self._stop.wait(0.5)

    def _sync(self) -> None:
        seen: set[str] = set()
        pods = [
            p
            for n in self.nodes
            if n not in self.down
            for p in self.api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={n}").items
        ]
        for pod in pods:
            uid = pod.metadata.uid
            seen.add(uid)
            run = self.runs.get(uid)
            if pod.metadata.deletion_timestamp:
                if run and not run.killing:
                    run.killing = True
                    grace = pod.metadata.deletion_grace_period_seconds
                    threading.Thread(target=self._terminate, args=(run, pod, grace), daemon=True).start()
                elif not run:
                    self._delete_pod_object(pod)
                continue
            if run is None and pod.status.phase == "Pending":
                self._start(pod)
            elif run and run.proc and run.proc.poll() is not None and not run.reported_exit:
                self._report_exit(run, pod)
        for uid, run in list(self.runs.items()):
            # The pod object is gone (force-deleted): nothing may keep running, once the node's kubelet is back.
            if uid not in seen and run.node not in self.down:
                self._kill(run, grace=0)
                self._cleanup(run)
                self.runs.pop(uid, None)

    # --- faults, for tests and benchmarks -------------------------------------------------------
    def lose_node(self, name: str, freeze: bool = False) -> list[PodRun]:
        """The node's kubelet goes silent, as in a partition: Ready turns Unknown, the node is tainted
        unreachable (as the node lifecycle controller does) and nothing on it is synced any more: its pods
        are neither started, stopped, reported nor cleaned up. With `freeze`, their processes are stopped
        (SIGSTOP) instead of left running: a zombie attempt that wakes up when thawed. Returns its runs."""
        with self._node_lock:
            self.down.add(name)
            t = now()
            conditions = [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                           "message": "Kubelet stopped posting node status.", "lastHeartbeatTime": t,
                           "lastTransitionTime": t}]  # fmt: skip
            self.api.patch_node_status(name, {"status": {"conditions": conditions}})
            self._set_taint(name, present=True)
        runs = [r for r in list(self.runs.values()) if r.node == name]
        for run in runs if freeze else []:
            self._signal_all(run, signal.SIGSTOP)
            run.frozen = True
        return runs

    def thaw(self, run: PodRun) -> None:
        self._signal_all(run, signal.SIGCONT)
        run.frozen = False

    def restore_node(self, name: str) -> None:
        """The kubelet is back: the node turns Ready, and pods it still runs whose objects are gone are killed."""
        with self._node_lock:
            self._set_taint(name, present=False)
            self._heartbeat(name)
            self.down.discard(name)

    def _set_taint(self, name: str, present: bool) -> None:
        taint = {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}
        taints = [t for t in (self.api.read_node(name).spec.taints or []) if t.key != taint["key"]]
        keep = [{"key": t.key, "effect": t.effect, **({"value": t.value} if t.value else {})} for t in taints]
        self.api.patch_node(name, {"spec": {"taints": [*keep, taint] if present else keep}})

    def crash(self, run: PodRun) -> None:
        """SIGKILL the pod's main process (its container's, in container mode): no checkpoint, no goodbye."""
        if self.containers:
            podcontainers.kill(run.uid)
        elif run.proc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)

    def trainer_workers(self, run: PodRun) -> list[int]:
        """PIDs of the pod's torchrun workers (process mode): in its network namespace, neither the launcher
        nor torchrun itself; the trainer's workers are forked by the agent's fork server (its children)."""
        workers = []
        for pid in self._pids(run):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                parent = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
                parent_argv = Path(f"/proc/{parent}/cmdline").read_bytes()
                parent_name = Path(f"/proc/{parent}/comm").read_bytes().strip()
            except (OSError, IndexError):
                continue
            launchers = {b"sharded_trainer.launch", b"torch.distributed.run", b"sharded_trainer.agent"}
            spawned = b"sharded_trainer" in argv and not launchers & set(argv)
            if spawned or b"multiprocessing.forkserver" in parent_argv or parent_name == FORKED_SERVER:
                workers.append(int(pid))
        return workers

    def _report_exit(self, run: PodRun, pod) -> None:
        assert run.proc is not None
        code = run.proc.returncode
        if code < 0:  # killed by a signal: report as the shell would
            code = 128 - code
        t = now()
        container = pod.spec.containers[0]
        reason = "Completed" if code == 0 else "Error"
        self._patch_status(
            pod,
            {
                "phase": "Succeeded" if code == 0 else "Failed",
                "conditions": [
                    {"type": c, "status": "False", "lastTransitionTime": t} for c in ("Ready", "ContainersReady")
                ],
                "containerStatuses": [{"name": container.name, "image": container.image, "imageID": "", "ready": False,
                                       "restartCount": 0, "started": False,
                                       "state": {"terminated": {"exitCode": code, "reason": reason, "finishedAt": t}}}],
            },
        )  # fmt: skip
        run.reported_exit = True
        self._cleanup(run)
        self._refresh_hosts(run.namespace)

    def _terminate(self, run: PodRun, pod, grace: int | None) -> None:
        # On a thread of its own: whatever fails on the way (an API hiccup), the run must not outlive it, or
        # the pod object would stay terminating forever with nothing left to finish it.
        try:
            self._kill(run, grace=30 if grace is None else grace)
            if run.proc and not run.reported_exit:
                self._report_exit(run, pod)
        finally:
            self._cleanup(run)
            self.runs.pop(run.uid, None)
            self._delete_pod_object(pod)

    def _kill(self, run: PodRun, grace: float) -> None:
        """SIGTERM the container's main process only, as the kubelet does; wait up to `grace` seconds,
        then SIGKILL everything the pod runs."""
        if not run.proc or run.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(run.proc.pid, signal.SIGTERM)
        try:
            run.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()
        # Workers torchrun started may have left the group: sweep the namespace's processes too.
        self._sweep(run)

    def _sweep(self, run: PodRun, timeout: float = 10.0) -> None:
        """SIGKILL every process left in the pod's network namespace (a frozen one too: SIGKILL needs no thaw),
        and wait until none is left, as a kubelet waits for a sandbox's processes before it reports the pod
        gone: a SIGKILL is delivered when the process next runs, which on a busy node is later."""
        deadline = time.monotonic() + timeout
        while self._signal_all(run, signal.SIGKILL) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _cleanup(self, run: PodRun) -> None:
        self._sweep(run)
        if self.containers:
            podcontainers.remove(run.uid)
        sh("ip", "netns", "del", run.netns, check=False)
        shutil.rmtree(Path("/etc/netns") / run.netns, ignore_errors=True)

    def _delete_pod_object(self, pod) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            self.api.delete_namespaced_pod(
                pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0, preconditions={"uid": pod.metadata.uid}),
            )  # fmt: skip
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def _patch_status(self, pod, status: dict) -> None:
        from kubernetes.client.rest import ApiException

        try:
            self.api.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": status})
        except ApiException as e:
            if e.status != 404:
                raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path(".cluster") / "nodeagent")
    parser.add_argument("--containers", action="store_true", help="run pods from their images through docker")
    args = parser.parse_args(argv)
    nodes = [f"local-node-{i}" for i in range(args.nodes)]
    agent = NodeAgent(args.kubeconfig, args.workdir.resolve(), nodes, containers=args.containers).start()
    print(json.dumps({"nodes": agent.nodes, "bridge": BRIDGE, "gateway": GATEWAY}), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
