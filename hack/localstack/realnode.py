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

import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from localstack.cluster import ROOT, LocalCluster, free_port
from localstack.pki import issue
from localstack.processes import stop_pid_file

CACHE = Path(os.environ.get("SHARDED_CACHE_DIR") or Path.home() / ".cache" / "sharded-training")
NODE_BRIDGE = "shardednode0"
# Cluster DNS (CoreDNS, hack/coredns) on the host-only bridge, as the nodes' addresses are: the nameserver every
# real node's kubelet writes into its pods' resolv.conf, answering the cluster domain from the API server.
DNS_IP = "10.201.0.254"
CLUSTER_DOMAIN = "cluster.local"
POD_NETWORK = "10.88.0.0/16"  # every real node's pod subnet, 10.88.<index>.0/24
TAINT = {"key": "sharded.dev/real-node", "value": "true", "effect": "NoSchedule"}
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# Debian's packages the node runs on; containerd and runc also come with docker.io.
PACKAGES = {"containerd": "containerd", "runc": "runc", "/usr/lib/cni/bridge": "containernetworking-plugins"}


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def ensure_packages() -> None:
    from images import apt_install  # hack/images.py: installs with the package lists refreshed if needed

    for what, package in PACKAGES.items():
        if not (Path(what).exists() if what.startswith("/") else shutil.which(what)):
            apt_install(package)


def _oci_archive(out: Path, ref: str, entrypoint: list[str], files: dict[str, Path], links: dict[str, str]) -> None:
    """An OCI image archive (what `ctr images import` reads) of one layer holding `files` (path in the image ->
    file here) and symbolic `links`, running `entrypoint` as uid 65535; byte-for-byte the same for the same
    inputs."""
    import gzip
    import io
    import tarfile

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for dest, src in sorted(files.items()):
            info = tar.gettarinfo(str(src), arcname=dest.lstrip("/"))
            info.uid = info.gid = info.mtime = 0
            info.uname = info.gname = ""
            with open(src, "rb") as f:
                tar.addfile(info, f)
        for dest, target in sorted(links.items()):
            info = tarfile.TarInfo(dest.lstrip("/"))
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
            tar.addfile(info)
    raw = layer.getvalue()
    packed = gzip.compress(raw, mtime=0)

    def digest(b: bytes) -> str:
        return "sha256:" + hashlib.sha256(b).hexdigest()

    config = json.dumps({
        "architecture": "amd64", "os": "linux", "config": {"Entrypoint": entrypoint, "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [digest(raw)]},
    }).encode()  # fmt: skip
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": digest(packed),
                    "size": len(packed)}],
    }).encode()  # fmt: skip
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest(manifest), "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": ref, "io.containerd.image.name": ref},
    }]}).encode()  # fmt: skip
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for name, data in [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index),
                           *((f"blobs/sha256/{digest(b)[7:]}", b) for b in (config, manifest, packed))]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(out)


def pause_image() -> Path:
    """The sandbox image, built here (no registry): hack/pause.c compiled static, keyed by its source."""
    source = ROOT / "hack" / "pause.c"
    key = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    out = CACHE / "images" / f"pause-{key}.tar"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        binary = out.with_name(f"pause-{key}")
        _run("gcc", "-O2", "-static", "-o", str(binary), str(source))
        _oci_archive(out, PAUSE_IMAGE, ["/pause"], {"/pause": binary}, {})
    return out


PROBE_IMAGE = "sharded.local/probe:2"


# The probe image's `python`: it stands in for the trainer image where the operator runs its own pods, which
# start `python -m sharded_trainer.launch ... [-- COMMAND]` and `python -m sharded_trainer.store`. The first
# runs the job's spec.command (a shell script of the test's), the second idles as a store nothing connects to.
PYTHON_STAND_IN = """#!/bin/sh
while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done
if [ $# -gt 0 ]; then shift; exec "$@"; fi
exec sleep 2147483647
"""


def probe_image() -> Path:
    """A shell for tests of what the kubelet gives a container: Debian's static busybox (downloaded, not
    installed), every applet linked under /bin, and PYTHON_STAND_IN as /usr/bin/python."""
    key = hashlib.sha256(PYTHON_STAND_IN.encode()).hexdigest()[:12]
    out = CACHE / "images" / f"probe-busybox-{key}.tar"
    if out.exists():
        return out
    work = CACHE / "images" / "busybox"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    subprocess.run(["apt-get", "download", "busybox-static"], cwd=work, check=True, capture_output=True)
    [deb] = work.glob("busybox-static_*.deb")
    _run("dpkg-deb", "-x", str(deb), str(work / "root"))
    busybox = work / "root" / "bin" / "busybox"
    applets = _run(str(busybox), "--list").stdout.split()
    links = {f"/bin/{a}": "busybox" for a in applets if a != "busybox"}
    python = work / "python"
    python.write_text(PYTHON_STAND_IN)
    python.chmod(0o755)
    _oci_archive(out, PROBE_IMAGE, ["/bin/sh"], {"/bin/busybox": busybox, "/usr/bin/python": python}, links)
    return out


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


def ensure_cluster_dns(cluster: LocalCluster, timeout: float = 60) -> None:
    """CoreDNS serving the cluster domain from the API server on DNS_IP:53 (Services; a headless Service's pods
    by hostname and subdomain, which is how a job's pods find pod 0), started once per cluster and stopped with
    it (its pid file is the cluster's)."""
    pid_file, log = cluster.workdir / "pids" / "coredns", cluster.workdir / "logs" / "coredns.log"
    if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
        return
    ensure_node_bridge()
    _run("ip", "addr", "replace", f"{DNS_IP}/32", "dev", NODE_BRIDGE)
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

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args, check=check)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)  # fmt: skip
        (self.cluster.workdir / "pids").mkdir(exist_ok=True)
        (self.cluster.workdir / "pids" / f"{self.name}-{name}").write_text(str(self.procs[name].pid))

    def _write_configs(self) -> tuple[Path, Path, Path]:
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
root = "{r}/containerd/root"
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
        _run("ip", "addr", "replace", f"{self.ip}/32", "dev", NODE_BRIDGE)
        self.root.mkdir(parents=True, exist_ok=True)
        containerd, kubeconfig, kubelet = self._write_configs()
        self._spawn("containerd", ["containerd", "--config", str(containerd)])
        deadline = time.monotonic() + timeout
        while self.ctr("version", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"containerd of {self.name} did not answer; see {self.root / 'containerd.log'}")
            time.sleep(0.2)
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
    stop_pid_file(workdir / "pids" / f"{name}-containerd")
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(f"{root}/")), key=len, reverse=True):
        _run("umount", "-l", mount, check=False)
    _run("ip", "link", "delete", f"cni-{name}", check=False)
    index = name.rsplit("-", 1)[-1]
    _run("ip", "addr", "del", f"10.201.0.{index}/32", "dev", NODE_BRIDGE, check=False)


def stop_nodes(workdir: Path) -> None:
    """Every real node of the cluster in `workdir` stopped (stop_node)."""
    for root in sorted((workdir / "nodes").glob("real-*")):
        stop_node(workdir, root)
