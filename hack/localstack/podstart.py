"""How the node agent starts one pod: its network namespace and address, its environment, its volumes
(ConfigMaps, claims, emptyDirs, projected tokens kept fresh as a kubelet does) and the script that runs it,
as a process or (`containers`) through docker."""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from localstack import containers as podcontainers
from localstack.containers import Mount
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


class PodStarter:
    """The NodeAgent's part that starts pods and finds their processes (a mixin: the agent holds the state
    these methods use)."""

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
                sc = pod.spec.security_context
                options = podcontainers.tmpfs_options(m.tmpfs_bytes, sc.fs_group if sc else None)
                lines.append(f"mount -t tmpfs -o {options} tmpfs {target}")
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
