"""A local node agent: registers nodes in the local control plane and runs the pods scheduled onto them
as real processes, like a kubelet without containers. Dev and test tooling; not part of the operator.

Each pod gets a network namespace (veth on a bridge, its own IP), its own hostname (UTS namespace) and
mount namespace, and `/etc/netns/<ns>/hosts` listing every pod of its namespace as
`<pod>.<subdomain>.<namespace>.svc`, so a job's peers resolve to each other exactly as in a cluster.
Volumes: ConfigMap -> files, PVC -> its bound PV's hostPath directory (subPath honoured), emptyDir ->
a directory (a size-limited tmpfs for `medium: Memory`, which is how /dev/shm is sized). In process mode
(the default) images are ignored: `python` is this project's virtualenv interpreter. In container mode
(`--containers`, hack/podcontainers.py) each pod's container runs from its image through docker, with the
pod's user, fsGroup, limits and shm size. Requires root (as in CI) for namespaces.

    python hack/nodeagent.py --kubeconfig .cluster/kubeconfig --nodes 2
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import podcontainers
from kubeletserver import KubeletServer
from podcontainers import Mount
from sharded_api.quantity import quantity_value

BRIDGE = "shbr0"
SUBNET = ipaddress.ip_network("10.203.0.0/16")
GATEWAY = "10.203.0.1"
NODE_LABEL = "local"


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def can_isolate() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare") is not None


@dataclass
class ProjectedToken:
    """A projected ServiceAccount token the agent keeps fresh in a pod's volume, as the kubelet does."""

    path: Path
    service_account: str
    audience: str
    seconds: int
    minted: float = 0.0


@dataclass
class PodRun:
    uid: str
    namespace: str
    name: str
    node: str
    netns: str
    ip: str
    workdir: Path
    proc: subprocess.Popen | None = None
    reported_exit: bool = False
    killing: bool = False
    frozen: bool = False
    mounts: list[str] = field(default_factory=list)
    tokens: list[ProjectedToken] = field(default_factory=list)
    # process mode: the container's environment and working directory, which an exec runs with too
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "/"


class NodeAgent:
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
            except (OSError, IndexError):
                continue
            launchers = {b"sharded_trainer.launch", b"torch.distributed.run", b"sharded_trainer.agent"}
            spawned = b"sharded_trainer" in argv and not launchers & set(argv)
            if spawned or b"multiprocessing.forkserver" in parent_argv:
                workers.append(int(pid))
        return workers

    def _pids(self, run: PodRun) -> list[str]:
        """The processes in the pod's network namespace (none once it is gone)."""
        return sh("ip", "netns", "pids", run.netns, check=False).stdout.split()

    def _signal_all(self, run: PodRun, sig: int) -> list[str]:
        """Send `sig` to every process in the pod's network namespace; the ones found."""
        pids = self._pids(run)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), sig)
        return pids

    # --- one pod --------------------------------------------------------------------------------
    def _start(self, pod) -> None:
        ip = str(SUBNET.network_address + self._next_ip)
        self._next_ip += 1
        uid = pod.metadata.uid
        ns, name = pod.metadata.namespace, pod.metadata.name
        workdir = self.workdir / "pods" / f"{ns}_{name}_{uid[:8]}"
        run = PodRun(
            uid=uid, namespace=ns, name=name, node=pod.spec.node_name, netns=f"sp-{uid[:8]}", ip=ip, workdir=workdir
        )
        self.runs[uid] = run
        run.workdir.mkdir(parents=True, exist_ok=True)
        try:
            if self.containers:
                podcontainers.start_sandbox(pod, uid, run.netns)
            self._network(run)
            mounts = self._mounts(pod, run)
            if self.containers:
                sc = pod.spec.security_context
                podcontainers.set_ownership(mounts, sc.fs_group if sc else None)
                argv = podcontainers.run_argv(pod, uid, run.netns, mounts, self._pod_env(pod, run))
            else:
                argv = ["ip", "netns", "exec", run.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                        "sh", str(self._script(pod, run, mounts))]  # fmt: skip
        except Exception as e:
            self._patch_status(pod, {"phase": "Failed", "reason": "AgentError", "message": str(e)[:500]})
            run.reported_exit = True
            self._cleanup(run)
            return
        log = open(run.workdir / "container.log", "ab")  # noqa: SIM115 - owned by the child
        run.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        self._refresh_hosts(run.namespace)
        container = pod.spec.containers[0]
        t = now()
        self._patch_status(
            pod,
            {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": GATEWAY, "startTime": t,
                "conditions": [{"type": c, "status": "True", "lastTransitionTime": t}
                               for c in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
                "containerStatuses": [{"name": container.name, "image": container.image, "imageID": "",
                                       "ready": True, "restartCount": 0, "started": True,
                                       "state": {"running": {"startedAt": t}}}],
            },
        )  # fmt: skip

    def _network(self, run: PodRun) -> None:
        host_if, pod_if = f"vh{run.uid[:8]}", f"vp{run.uid[:8]}"
        if not self.containers:  # in container mode the sandbox's namespace is already attached by name
            sh("ip", "netns", "add", run.netns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", pod_if)
        sh("ip", "link", "set", host_if, "master", BRIDGE, "up")
        sh("ip", "link", "set", pod_if, "netns", run.netns)
        ns = ["ip", "netns", "exec", run.netns]
        sh(*ns, "ip", "link", "set", pod_if, "name", "eth0")
        sh(*ns, "ip", "addr", "add", f"{run.ip}/{SUBNET.prefixlen}", "dev", "eth0")
        sh(*ns, "ip", "link", "set", "eth0", "up")
        sh(*ns, "ip", "link", "set", "lo", "up")
        sh(*ns, "ip", "route", "add", "default", "via", GATEWAY)
        etc = Path("/etc/netns") / run.netns
        etc.mkdir(parents=True, exist_ok=True)
        # Names outside the hosts file fail fast instead of waiting on an unreachable resolver.
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        (etc / "hosts").write_text("127.0.0.1 localhost\n")

    def _refresh_hosts(self, namespace: str) -> None:
        """Every pod of the namespace gets `<ip> <host>.<subdomain>.<ns>.svc[.cluster.local] <host>` lines."""
        lines = ["127.0.0.1 localhost"]
        for pod in self.api.list_namespaced_pod(namespace).items:
            run = self.runs.get(pod.metadata.uid)
            if not run or pod.metadata.deletion_timestamp:
                continue
            host = pod.spec.hostname or pod.metadata.name
            names = [host]
            if pod.spec.subdomain:
                fq = f"{host}.{pod.spec.subdomain}.{namespace}.svc"
                names = [f"{fq}.cluster.local", fq, host]
            lines.append(f"{run.ip} {' '.join(names)}")
        text = "\n".join(lines) + "\n"
        # A snapshot: pods ending on other threads (_terminate) remove their runs meanwhile.
        for run in list(self.runs.values()):
            hosts = Path("/etc/netns") / run.netns / "hosts"
            if run.namespace == namespace and hosts.exists():
                # Rewrite in place: `ip netns exec` bind-mounted this very inode over /etc/hosts.
                with open(hosts, "r+") as f:
                    f.seek(0)
                    f.write(text)
                    f.truncate()

    def _pod_env(self, pod, run: PodRun) -> dict[str, str]:
        """The container's own env (values and field references); the image brings the rest."""
        env = {}
        fields = {
            "metadata.name": pod.metadata.name, "metadata.namespace": pod.metadata.namespace,
            "metadata.uid": pod.metadata.uid, "spec.nodeName": pod.spec.node_name, "status.podIP": run.ip,
            "status.hostIP": GATEWAY, "spec.serviceAccountName": pod.spec.service_account_name or "default",
        }  # fmt: skip
        for e in pod.spec.containers[0].env or []:
            if e.value is not None:
                env[e.name] = e.value
            elif e.value_from and e.value_from.field_ref:
                env[e.name] = fields.get(e.value_from.field_ref.field_path, "")
        return env

    def _process_env(self, pod, run: PodRun) -> dict[str, str]:
        """Process mode has no image: this project's interpreter stands in for it."""
        return {
            "PATH": f"{self.python_bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/root",
            "HOSTNAME": pod.spec.hostname or pod.metadata.name,
            "PYTHONUNBUFFERED": "1",
            **self._pod_env(pod, run),
        }

    def _volume_source(self, pod, run: PodRun, volume) -> tuple[Path, str | None]:
        """(host directory, tmpfs size or None) for one pod volume."""
        base = run.workdir / "volumes" / volume.name
        if volume.config_map:
            base.mkdir(parents=True, exist_ok=True)
            cm = self.api.read_namespaced_config_map(volume.config_map.name, pod.metadata.namespace)
            for key, value in (cm.data or {}).items():
                (base / key).write_text(value)
            return base, None
        if volume.persistent_volume_claim:
            pvc = self.api.read_namespaced_persistent_volume_claim(
                volume.persistent_volume_claim.claim_name, pod.metadata.namespace
            )
            if not pvc.spec.volume_name:
                raise RuntimeError(f"claim {pvc.metadata.name} is not bound")
            pv = self.api.read_persistent_volume(pvc.spec.volume_name)
            if not pv.spec.host_path:
                raise RuntimeError(f"volume {pv.metadata.name} is not a hostPath volume")
            return Path(pv.spec.host_path.path), None
        if volume.empty_dir is not None:
            base.mkdir(parents=True, exist_ok=True)
            memory = volume.empty_dir.medium == "Memory"
            return base, (volume.empty_dir.size_limit or "64Mi") if memory else None
        if volume.host_path:
            return Path(volume.host_path.path), None
        if volume.projected:  # ServiceAccount tokens, minted through the API server's TokenRequest
            base.mkdir(parents=True, exist_ok=True)
            for source in volume.projected.sources or []:
                if sat := source.service_account_token:
                    token = ProjectedToken(path=base / sat.path, service_account=pod.spec.service_account_name
                                           or "default", audience=sat.audience or "", seconds=sat.expiration_seconds
                                           or 3600)  # fmt: skip
                    self._mint(run, token)
                    run.tokens.append(token)
            return base, None
        raise RuntimeError(f"volume {volume.name}: only configMap, persistentVolumeClaim, emptyDir, hostPath")

    def _mounts(self, pod, run: PodRun) -> list[Mount]:
        """The container's volume mounts, resolved to host directories (or tmpfs sizes)."""
        volumes = {v.name: v for v in pod.spec.volumes or []}
        mounts = []
        for m in pod.spec.containers[0].volume_mounts or []:
            if m.name not in volumes:
                continue
            volume = volumes[m.name]
            src, tmpfs = self._volume_source(pod, run, volume)
            owned = volume.persistent_volume_claim is not None or volume.empty_dir is not None
            owned_root = src if owned else None
            if m.sub_path:
                src = src / m.sub_path
                src.mkdir(parents=True, exist_ok=True)
            size = int(quantity_value(tmpfs)) if tmpfs else None
            mounts.append(
                Mount(src, m.mount_path, tmpfs_bytes=size, read_only=bool(m.read_only), owned_root=owned_root)
            )
        return mounts

    def _script(self, pod, run: PodRun, mounts: list[Mount]) -> Path:
        container = pod.spec.containers[0]
        lines = ["set -e", f"hostname {shlex.quote(pod.spec.hostname or pod.metadata.name)}"]
        for m in mounts:
            target = shlex.quote(m.target)
            # The mount point must exist in the shared filesystem; the mount itself stays in the pod's namespace.
            Path(m.target).mkdir(parents=True, exist_ok=True)
            if m.tmpfs_bytes is not None:
                lines.append(f"mount -t tmpfs -o size={m.tmpfs_bytes} tmpfs {target}")
            else:
                lines.append(f"mount --bind {shlex.quote(str(m.source))} {target}")
            if m.read_only:
                lines.append(f"mount -o remount,bind,ro {target}")
        cmd = [*(container.command or []), *(container.args or [])]
        env = run.env = self._process_env(pod, run)
        run.cwd = container.working_dir or str(run.workdir)
        lines.append(f"cd {shlex.quote(run.cwd)}")
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        lines.append(f"exec env -i {exports} {' '.join(shlex.quote(c) for c in cmd)}")
        script = run.workdir / "run.sh"
        script.write_text("\n".join(lines) + "\n")
        return script

    def _mint(self, run: PodRun, token: ProjectedToken) -> None:
        """A token for the audience, bound to the pod (void once it is gone), written atomically."""
        bound = {"kind": "Pod", "apiVersion": "v1", "name": run.name, "uid": run.uid}
        spec = {"audiences": [token.audience] if token.audience else None, "expirationSeconds": token.seconds,
                "boundObjectRef": bound}  # fmt: skip
        body = {"spec": spec}
        minted = self.api.create_namespaced_service_account_token(token.service_account, run.namespace, body)
        tmp = token.path.with_name(token.path.name + ".tmp")
        tmp.write_text(minted.status.token)
        os.replace(tmp, token.path)
        token.minted = time.monotonic()

    def _rotate_tokens(self) -> None:
        """Renew each token at 80% of its lifetime, as the kubelet does."""
        for run in list(self.runs.values()):
            for token in run.tokens:
                if run.node not in self.down and time.monotonic() - token.minted > 0.8 * token.seconds:
                    self._mint(run, token)

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
