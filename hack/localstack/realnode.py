"""A real node for the local control plane: the kubelet built from the control plane's own Kubernetes version
(hack/build-binaries.sh) with a containerd of its own, runc and the CNI bridge, as Kubernetes'
`hack/local-up-cluster.sh` runs a kubelet on a host.

What the node agent (nodeagent.py) imitates, this runs: pods are sandboxes and containers made by containerd's
CRI plugin, /dev/shm and every emptyDir are the kubelet's own mounts, projected service-account tokens are
requested by the kubelet with the node's identity (a `system:node:<name>` client certificate, so the Node
authorizer limits it to its own pods), and logs, exec and port-forward reach the kubelet's TLS server.

Each node has its own root directories, sockets, ports, CNI bridge and subnet (10.88.<index>.0/24), and an
address of its own, 10.201.0.<index>, on a host-only bridge with no ports: the kubelet refuses a loopback node
IP, and an address on a bridge nothing is attached to is reachable from this machine only, as loopback is.
It is tainted (`sharded.dev/real-node`) so that only pods that ask for it land there. The nodes share cluster DNS
(CoreDNS built from hack/coredns, on 10.201.0.254 of that bridge), which each kubelet gives its pods as their
nameserver, and a flat pod network: this host routes between the nodes' CNI bridges.

On this machine's cgroup v1 hierarchy the kubelet runs with `failCgroupV1: false`, without per-QoS cgroups or
node allocatable enforcement (the machine's processes share the root cgroups), and containerd with
`restrict_oom_score_adj` (a process here may not lower its OOM score: without it runc's child dies at start,
"can't get final child's PID from pipe").
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from localstack.cluster import LocalCluster, free_port
from localstack.nodeimages import CACHE, PAUSE_IMAGE, pause_image
from localstack.pki import issue
from localstack.processes import alive, stop_pid_file

NODE_BRIDGE = "shardednode0"
# Cluster DNS (CoreDNS, hack/coredns) on the host-only bridge, as the nodes' addresses are: the nameserver every
# real node's kubelet writes into its pods' resolv.conf, answering the cluster domain from the API server.
DNS_IP = "10.201.0.254"
CLUSTER_DOMAIN = "cluster.local"
POD_NETWORK = "10.88.0.0/16"  # every real node's pod subnet, 10.88.<index>.0/24
TAINT = {"key": "sharded.dev/real-node", "value": "true", "effect": "NoSchedule"}
# Debian's packages the node runs on; containerd and runc also come with docker.io.
PACKAGES = {"containerd": "containerd", "runc": "runc", "/usr/lib/cni/bridge": "containernetworking-plugins"}


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def ensure_packages() -> None:
    from images import apt_install  # hack/images.py: installs with the package lists refreshed if needed

    for what, package in PACKAGES.items():
        if not (Path(what).exists() if what.startswith("/") else shutil.which(what)):
            apt_install(package)


def ensure_node_bridge() -> None:
    if _run("ip", "link", "show", NODE_BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", NODE_BRIDGE, "type", "bridge")
        _run("ip", "link", "set", NODE_BRIDGE, "up")
    # Pods of one node reach another node's pods through this host, which routes between the nodes' CNI
    # bridges; Docker leaves the FORWARD chain's policy at DROP, so let the pod network through (no NAT: each
    # pod sees the other's own address, as on a cluster's flat pod network).
    rule = ["FORWARD", "-s", POD_NETWORK, "-d", POD_NETWORK, "-j", "ACCEPT"]
    if _run("iptables", "-C", *rule, check=False).returncode != 0:
        _run("iptables", "-I", *rule)


def bridge_address(ip: str, present: bool = True) -> None:
    """Give `ip` (a /32) to this host on the host-only bridge, or take it away: how the nodes, cluster DNS and
    anything else the pods must reach get an address that only this machine and its pods can reach."""
    if present:
        ensure_node_bridge()
        _run("ip", "addr", "replace", f"{ip}/32", "dev", NODE_BRIDGE)
    else:
        _run("ip", "addr", "del", f"{ip}/32", "dev", NODE_BRIDGE, check=False)


def ensure_cluster_dns(cluster: LocalCluster, timeout: float = 60) -> None:
    """CoreDNS serving the cluster domain from the API server on DNS_IP:53 (Services; a headless Service's pods
    by hostname and subdomain, which is how a job's pods find pod 0), started once per cluster and stopped with
    it (its pid file is the cluster's)."""
    pid_file, log = cluster.workdir / "pids" / "coredns", cluster.workdir / "logs" / "coredns.log"
    if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
        return
    bridge_address(DNS_IP)
    corefile = cluster.workdir / "Corefile"
    corefile.write_text(f"""{CLUSTER_DOMAIN}:53 {{
    bind {DNS_IP}
    errors
    log
    kubernetes {CLUSTER_DOMAIN} {{
        kubeconfig {cluster.kubeconfig}
    }}
}}
""")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(cluster.bin_dir / "coredns"), "-conf", str(corefile)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    pid_file.parent.mkdir(exist_ok=True)
    pid_file.write_text(str(proc.pid))
    # The kubernetes plugin holds the server back until its first list of the API server has synced; the banner
    # comes once it serves.
    deadline = time.monotonic() + timeout
    while "CoreDNS-" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise TimeoutError(f"CoreDNS did not start serving; {log}:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)


@dataclass
class RealNode:
    cluster: LocalCluster
    index: int  # 1..250: the node's address and pod subnet
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"real-{self.index}"

    @property
    def ip(self) -> str:
        return f"10.201.0.{self.index}"

    @property
    def root(self) -> Path:
        return self.cluster.workdir / "nodes" / self.name

    @property
    def socket(self) -> Path:
        return self.root / "containerd.sock"

    def ctr_argv(self) -> list[str]:
        return ["ctr", "--address", str(self.socket), "--namespace", "k8s.io"]

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(*self.ctr_argv(), *args, check=check)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)  # fmt: skip
        (self.cluster.workdir / "pids").mkdir(exist_ok=True)
        (self.cluster.workdir / "pids" / f"{self.name}-{name}").write_text(str(self.procs[name].pid))

    def _write_configs(self, containerd_root: Path) -> tuple[Path, Path, Path]:
        r, pki = self.root, self.cluster.workdir / "pki"
        subnet = f"10.88.{self.index}.0/24"
        (r / "cni").mkdir(parents=True, exist_ok=True)
        (r / "cni" / "10-bridge.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0", "name": self.name, "plugins": [
                {"type": "bridge", "bridge": f"cni-{self.name}", "isDefaultGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]], "dataDir": str(r / "ipam")}},
                {"type": "loopback"},
            ]}))  # fmt: skip
        containerd = r / "containerd.toml"
        containerd.write_text(f"""version = 2
root = "{containerd_root}"
state = "{r}/containerd/state"
[grpc]
  address = "{self.socket}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{r}/cni"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
""")
        # The node's identity towards the API server (the Node authorizer's), and its serving certificate for
        # the API server's logs, exec and port-forward requests, valid for its address.
        issue(pki, f"{self.name}-client", f"system:node:{self.name}", "system:nodes")
        issue(pki, f"{self.name}-serving", self.name, None, ips=[self.ip], dns=[self.name])
        kubeconfig = r / "kubeconfig"
        user = {"client-certificate": str(pki / f"{self.name}-client.crt"),
                "client-key": str(pki / f"{self.name}-client.key")}  # fmt: skip
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "node",
            "clusters": [{"name": "local", "cluster": {"server": self.cluster.server,
                                                       "certificate-authority": str(pki / "ca.crt")}}],
            "users": [{"name": "node", "user": user}],
            "contexts": [{"name": "node", "context": {"cluster": "local", "user": "node"}}],
        }))  # fmt: skip
        kubelet = r / "kubelet.yaml"
        kubelet.write_text(yaml.safe_dump({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.ip, "port": free_port(), "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": free_port(),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(pki / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},
            "tlsCertFile": str(pki / f"{self.name}-serving.crt"),
            "tlsPrivateKeyFile": str(pki / f"{self.name}-serving.key"),
            "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
            "failSwapOn": False, "failCgroupV1": False, "containerRuntimeEndpoint": f"unix://{self.socket}",
            "evictionHard": {}, "imageGCHighThresholdPercent": 100, "localStorageCapacityIsolation": False,
            "makeIPTablesUtilChains": False, "registerWithTaints": [TAINT],
            "resolvConf": "/etc/resolv.conf", "serializeImagePulls": False,
            "clusterDNS": [DNS_IP], "clusterDomain": CLUSTER_DOMAIN,
            # Its own, not the host's /var/log/pods: a kubelet removes the log directories of pods it does not
            # know, which on a shared directory are the other nodes' pods.
            "podLogsDir": str(r / "pod-logs"),
        }))  # fmt: skip
        return containerd, kubeconfig, kubelet

    def start(self, images: list[Path], timeout: float = 90) -> RealNode:
        ensure_packages()
        ensure_cluster_dns(self.cluster)
        bridge_address(self.ip)
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        with _claim_lock(self.name):
            containerd_root = kept_root(self.name)
            if _owner(containerd_root) is not None:  # another run's node of this name has it: one of this run's
                containerd_root = self.root / "containerd" / "root"
            containerd, kubeconfig, kubelet = self._write_configs(containerd_root)
            self._start_containerd(containerd, deadline)
            # What a node stopped without its stop_node left: containers the kubelet would find and try to run
            # again. Removed, and containerd restarted so that its CRI plugin forgets them too.
            if leftovers := self.ctr("containers", "ls", "-q").stdout.split():
                self.ctr("containers", "rm", *leftovers, check=False)
                stop_pid_file(self.cluster.workdir / "pids" / f"{self.name}-containerd")
                self._start_containerd(containerd, deadline)
            if containerd_root == kept_root(self.name):
                (containerd_root / "owner").write_text(str(self.procs["containerd"].pid))
        for image in [pause_image(), *images]:
            self.ctr("images", "import", str(image))
        self._spawn("kubelet", [str(self.cluster.bin_dir / "kubelet"), f"--config={kubelet}",
                                f"--kubeconfig={kubeconfig}", f"--root-dir={self.root / 'kubelet'}",
                                f"--hostname-override={self.name}", f"--node-ip={self.ip}", "--v=1"])  # fmt: skip
        while not self._ready():
            if time.monotonic() > deadline or self.procs["kubelet"].poll() is not None:
                raise TimeoutError(f"{self.name} not Ready; kubelet log:\n{self.log_tail('kubelet')}")
            time.sleep(0.5)
        return self

    def _start_containerd(self, config: Path, deadline: float) -> None:
        self._spawn("containerd", ["containerd", "--config", str(config)])
        while self.ctr("version", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"containerd of {self.name} did not answer; see {self.root / 'containerd.log'}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            node = self.cluster.api("GET", f"/api/v1/nodes/{self.name}")
        except Exception:  # not registered yet
            return False
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))

    def log_tail(self, name: str, chars: int = 3000) -> str:
        log = self.root / f"{name}.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""

    def stop(self) -> None:
        self.procs.clear()  # their pid files are what stop_node goes by
        stop_node(self.cluster.workdir, self.root)


def stop_node(workdir: Path, root: Path) -> None:
    """A real node stopped: the kubelet first (so nothing restarts what follows), every container and sandbox
    killed through its containerd, containerd stopped, and what is still mounted under its root (the kubelet's
    volumes, containerd's root filesystems and network namespaces) unmounted, the deepest first. Also for a node
    a crashed launcher left (it goes by the pid files)."""
    name = root.name
    stop_pid_file(workdir / "pids" / f"{name}-kubelet")
    socket = root / "containerd.sock"
    if socket.exists():
        ctr = ["ctr", "--address", str(socket), "--namespace", "k8s.io", "tasks"]
        for task in _run(*ctr, "ls", "-q", check=False).stdout.split():
            _run(*ctr, "kill", "-s", "SIGKILL", task, check=False)
        time.sleep(0.5)
        for task in _run(*ctr, "ls", "-q", check=False).stdout.split():
            _run(*ctr, "rm", "-f", task, check=False)
        # The containers' records too: a kept root (kept_root) must not hand them to the node's next start.
        if containers := _run(*ctr[:-1], "containers", "ls", "-q", check=False).stdout.split():
            _run(*ctr[:-1], "containers", "rm", *containers, check=False)
    pid_file, kept = workdir / "pids" / f"{name}-containerd", kept_root(name)
    ours = pid_file.exists() and _owner(kept) == int(pid_file.read_text())
    stop_pid_file(pid_file)
    if ours:  # released; a dead owner's root is free anyway, this keeps the file from naming a reused pid
        with _claim_lock(name):
            (kept / "owner").unlink(missing_ok=True)
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith((f"{root}/", f"{kept}/"))), key=len, reverse=True):
        _run("umount", "-l", mount, check=False)
    _run("ip", "link", "delete", f"cni-{name}", check=False)
    index = name.rsplit("-", 1)[-1]
    bridge_address(f"10.201.0.{index}", present=False)


def kept_root(name: str) -> Path:
    """The containerd root of the node `name` that outlives the run: its images (the trainer's is 6 GB, minutes to
    import) stay unpacked for the next run's node of the same name (nodeimages.py)."""
    return CACHE / "realnode" / name / "containerd"


@contextlib.contextmanager
def _claim_lock(name: str):
    """Serializes claiming and releasing a kept root between launchers (two suite runs may start a real-1)."""
    kept_root(name).mkdir(parents=True, exist_ok=True)
    with open(kept_root(name).parent / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _owner(kept: Path) -> int | None:
    """The pid of the live containerd that uses the kept root `kept`, if one does."""
    try:
        pid = int((kept / "owner").read_text())
    except (OSError, ValueError):
        return None
    return pid if alive(pid) else None


def stop_nodes(workdir: Path) -> None:
    """Every real node of the cluster in `workdir` stopped (stop_node)."""
    for root in sorted((workdir / "nodes").glob("real-*")):
        stop_node(workdir, root)
