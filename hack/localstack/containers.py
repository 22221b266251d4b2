"""The node agent's container mode: a pod's container runs from its image through docker.

As the kubelet does with its pause container, each pod first gets a sandbox container that only holds
the pod's namespaces; its network namespace is attached under the pod's name (`ip netns attach`), so the
agent wires it to the bridge exactly as in process mode, and the pod's container joins it
(`--network container:`). Docker cannot join a named network namespace itself, hence the sandbox.
The container gets the pod's user, group and fsGroup, its CPU and memory limits, the shm size of its
memory-backed /dev/shm volume, its env and its volumes (bind mounts of the host directories the agent
prepared: claims' hostPath directories, ConfigMaps, projected tokens), and the agent's hosts file, kept
current as the pod's peers come and go.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sharded_api.quantity import quantity_value


@dataclass
class Mount:
    source: Path
    target: str
    tmpfs_bytes: int | None = None  # a memory-backed emptyDir of this size
    read_only: bool = False
    # The root of the volume (not of its subPath) when the kubelet manages its ownership (fsGroup):
    # claims and emptyDirs.
    owned_root: Path | None = None


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], check=check, capture_output=True, text=True)


def sandbox_name(uid: str) -> str:
    return f"sp-{uid[:8]}-sandbox"


def container_name(uid: str) -> str:
    return f"sp-{uid[:8]}"


def start_sandbox(pod, uid: str, netns: str) -> None:
    """The pod's sandbox, from the pod's own image (the only one known to be here), its network
    namespace attached as `netns` for the agent to wire up."""
    image = pod.spec.containers[0].image
    hostname = pod.spec.hostname or pod.metadata.name
    docker("run", "-d", "--pull", "never", "--name", sandbox_name(uid), "--network", "none", "--hostname", hostname,
           "--entrypoint", "sleep", image, "infinity")  # fmt: skip
    pid = docker("inspect", "-f", "{{.State.Pid}}", sandbox_name(uid)).stdout.strip()
    subprocess.run(["ip", "netns", "attach", netns, pid], check=True, capture_output=True)


def set_ownership(mounts: list[Mount], fs_group: int | None) -> None:
    """What the kubelet does for volumes that support ownership management, with the policy
    OnRootMismatch: group-own everything by fsGroup, group-writable, directories setgid so new files
    inherit the group; skipped when the volume's root already has the group."""
    if fs_group is None:
        return
    for root in {m.owned_root for m in mounts if m.owned_root is not None and m.tmpfs_bytes is None}:
        if root.stat().st_gid == fs_group:
            continue
        for path in [root, *root.rglob("*")]:
            if path.is_symlink():
                continue
            os.chown(path, -1, fs_group)
            mode = path.stat().st_mode
            os.chmod(path, mode | 0o060 | (0o2010 if path.is_dir() else 0))


def tmpfs_options(size: int, fs_group: int | None) -> str:
    """A memory-backed emptyDir as the real kubelet leaves it (tests/realnode): with an fsGroup, root's and the
    group's, mode 3777 (setgid, sticky, everyone writes); without, mode 1777."""
    return f"size={size},mode=3777,gid={fs_group}" if fs_group is not None else f"size={size},mode=1777"


def run_argv(pod, uid: str, netns: str, mounts: list[Mount], env: dict[str, str]) -> list[str]:
    """`docker run` of the pod's (first) container, attached: its exit is the pod's, its output the log."""
    container = pod.spec.containers[0]
    pod_sc, sc = pod.spec.security_context, container.security_context
    uid_ = (sc and sc.run_as_user) if sc and sc.run_as_user is not None else (pod_sc and pod_sc.run_as_user)
    gid = (sc and sc.run_as_group) if sc and sc.run_as_group is not None else (pod_sc and pod_sc.run_as_group)
    etc = f"/etc/netns/{netns}"
    argv = ["docker", "run", "--rm", "--pull", "never", "--name", container_name(uid),
            "--network", f"container:{sandbox_name(uid)}",
            "-v", f"{etc}/hosts:/etc/hosts", "-v", f"{etc}/resolv.conf:/etc/resolv.conf"]  # fmt: skip
    if uid_ is not None:
        argv += ["--user", f"{uid_}:{gid if gid is not None else uid_}"]
    for group in [*((pod_sc and pod_sc.supplemental_groups) or []), *([pod_sc.fs_group] if pod_sc and pod_sc.fs_group
                                                                       is not None else [])]:  # fmt: skip
        argv += ["--group-add", str(group)]
    limits = (container.resources and container.resources.limits) or {}
    if "cpu" in limits:
        argv += ["--cpus", f"{quantity_value(limits['cpu']):g}"]
    if "memory" in limits:
        argv += ["--memory", str(int(quantity_value(limits["memory"])))]
    for m in mounts:
        if m.tmpfs_bytes is not None:  # /dev/shm among them: docker's own --shm-size would be root's
            argv += ["--tmpfs", f"{m.target}:{tmpfs_options(m.tmpfs_bytes, pod_sc and pod_sc.fs_group)}"]
        else:
            argv += ["-v", f"{m.source}:{m.target}{':ro' if m.read_only else ''}"]
    for key, value in env.items():
        argv += ["-e", f"{key}={value}"]
    if container.working_dir:
        argv += ["-w", container.working_dir]
    command, args = list(container.command or []), list(container.args or [])
    if command:
        argv += ["--entrypoint", command[0], container.image, *command[1:], *args]
    else:
        argv += [container.image, *args]
    return argv


def kill(uid: str) -> None:
    """SIGKILL the pod's container: a crash, as the OOM killer or a failed node would cause."""
    docker("kill", "--signal", "KILL", container_name(uid), check=False)


def remove(uid: str) -> None:
    docker("rm", "-f", container_name(uid), sandbox_name(uid), check=False)
