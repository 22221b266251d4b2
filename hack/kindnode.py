"""kind, as users run it, on a machine without a registry: a node image made here, and `make kind-e2e`.

kind's own node image (`kindest/node`) is kind's base image, whose Dockerfile clones containerd, runc and the
CNI plugins from GitHub and needs BuildKit, plus Kubernetes' images pulled from registry.k8s.io. None of that
is reachable here, so this makes an image with the same layout from what is:

- Debian bookworm by debootstrap, with the packages kind's base image installs and Debian's containerd, runc
  and CNI plugins in the place of kind's builds of them;
- kind's own node files (entrypoint, systemd units, containerd and kubelet settings) from the `sigs.k8s.io/kind`
  module at KIND_VERSION, set up as kind's Dockerfile does;
- kubelet, kubeadm and kubectl, and one image holding the control plane's binaries (kube-apiserver,
  kube-controller-manager, kube-scheduler, kube-proxy, etcd, CoreDNS, local-path-provisioner, kubectl), all
  built from their Go modules by hack/build-binaries.sh, tagged under `sharded-local/` and unpacked into the
  image's containerd with the sandbox (pause) image, as `kind build node-image` does;
- `/kind/manifests`: the pod network (hack/kind/default-cni.yaml, standing in for kindnetd) and
  local-path-provisioner's own manifest as the default StorageClass `standard`.

The cluster needs the kind configuration written next to it (kubeadm's image repository and the tags of the
etcd and CoreDNS builds; on a cgroup v1 host, the kubelet told to run there; where the host withholds
CAP_SYS_RESOURCE, containerd told not to lower OOM scores). The image is keyed by all of its
inputs and made once. Usage: `python hack/kindnode.py e2e` (what `make kind-e2e` runs), or `python
hack/kindnode.py image` to print the image and configuration only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HACK = Path(__file__).resolve().parent
sys.path[:0] = [str(HACK)]

import images  # noqa: E402 - hack/images.py: dockerd, debootstrap images, the project's images
from localstack import nodeimages  # noqa: E402 - the pause image, and letting go of unpacked layers

ROOT = HACK.parent
VERSIONS = dict(line.split("=", 1) for line in (HACK / "versions.env").read_text().split() if "=" in line)
K8S = VERSIONS["KUBERNETES_VERSION"]
REPO = "sharded-local"  # kubeadm's imageRepository in the cluster configuration
# What kind's base image installs (its Dockerfile), less NFS, iSCSI and fuse, plus Debian's containerd, runc
# and CNI plugins, which kind builds from source; iproute2 also serves the pod network's routes.
NODE_PACKAGES = [
    "systemd", "conntrack", "iptables", "nftables", "iproute2", "ethtool", "util-linux", "mount", "kmod",
    "libseccomp2", "pigz", "e2fsprogs", "bash", "ca-certificates", "curl", "jq", "procps",
    "containerd", "runc", "containernetworking-plugins",
]  # fmt: skip
CONTROL_PLANE = ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy"]
COMPONENT_BINARIES = [*CONTROL_PLANE, "etcd", "coredns", "kubectl", "local-path-provisioner"]


def log(message: str) -> None:
    print(f"[kind] {message}", file=sys.stderr, flush=True)


def binaries() -> Path:
    """hack/build-binaries.sh's directory, with kind's extras built."""
    out = subprocess.run(["bash", str(HACK / "build-binaries.sh"), "kind"], check=True, stdout=subprocess.PIPE,
                         text=True)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[-1])


def ensure_privileged_runs() -> None:
    """kind runs its nodes `--privileged`: on a host whose capability bounding set is short, only through the
    capability-filtering runtime hack/images.py gives a dockerd it starts."""
    images.ensure_dockerd()
    if images.bounding_set_complete():
        return
    runtime = images.docker("info", "--format", "{{.DefaultRuntime}}").stdout.strip()
    if runtime != images.CAPFILTER_RUNTIME:
        raise SystemExit(
            "error: this host's capability bounding set lacks capabilities that `docker run --privileged` asks "
            f"for, and dockerd's default runtime is {runtime!r}: stop dockerd and run this again, which starts "
            "it with hack/kind/runc-capfilter as the default runtime"
        )


def tags() -> dict[str, str]:
    """The image names kubeadm will ask for, through the cluster configuration's repository and tags."""
    etcd = VERSIONS["ETCD_VERSION"].lstrip("v")
    out = {name: f"{REPO}/{name}:{K8S}" for name in CONTROL_PLANE}
    out["etcd"] = f"{REPO}/etcd:{etcd}"
    out["coredns"] = f"{REPO}/coredns:{VERSIONS['COREDNS_VERSION']}"
    return out


def recipe(bin_dir: Path) -> str:
    """Every input of the node image: this module, hack/kind, the pause image, the binaries' builds."""
    h = hashlib.sha256()
    for path in sorted([Path(__file__), *(HACK / "kind").iterdir(), nodeimages.pause_image()]):
        h.update(path.name.encode() + path.read_bytes())
    for name in sorted(os.listdir(bin_dir)):
        h.update(f"{name}={os.path.realpath(bin_dir / name)}".encode())
    h.update(" ".join(NODE_PACKAGES).encode())
    return h.hexdigest()[:12]


def components_image(base: str, bin_dir: Path, key: str) -> str:
    """One image with every control-plane binary on PATH; CoreDNS is its entrypoint (kubeadm's CoreDNS
    Deployment gives arguments only), the others are run by their manifests' commands."""
    tag = f"{REPO}/kind-components:{key}"
    with tempfile.TemporaryDirectory(prefix="kind-components-") as tmp:
        for name in COMPONENT_BINARIES:
            shutil.copy(bin_dir / name, Path(tmp) / name)
        (Path(tmp) / "Dockerfile").write_text(
            f'FROM {base}\nCOPY {" ".join(COMPONENT_BINARIES)} /usr/local/bin/\nENTRYPOINT ["/usr/local/bin/coredns"]\n'
        )
        images.docker("build", "-q", "-t", tag, tmp)
    for name in tags().values():
        images.docker("tag", tag, name)
    return tag


def prepare_node(rootfs: Path, bin_dir: Path) -> None:
    """kind's base image steps on a debootstrapped tree: its files, its systemd set-up, and the node binaries."""
    files = bin_dir / "kind-files"
    for src in files.rglob("*"):
        dest = rootfs / src.relative_to(files)
        if src.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
        else:
            shutil.copyfile(src, dest)
            dest.chmod(0o755 if "bin" in src.relative_to(files).parts else 0o644)
    system = rootfs / "lib/systemd/system"
    for pattern in ["multi-user.target.wants/*", "local-fs.target.wants/*", "sockets.target.wants/*udev*",
                    "sockets.target.wants/*initctl*", "basic.target.wants/*",
                    "sysinit.target.wants/systemd-tmpfiles-setup.service"]:  # fmt: skip
        for p in system.glob(pattern):
            p.unlink()
    for p in (rootfs / "etc/systemd/system").glob("*.wants/*"):
        p.unlink()
    with open(rootfs / "etc/systemd/journald.conf", "a") as f:
        f.write("ReadKMsg=no\n")
    init = rootfs / "sbin/init"
    if init.exists() or init.is_symlink():
        init.unlink()
    init.symlink_to("/usr/lib/systemd/systemd")
    subprocess.run(["chroot", str(rootfs), "systemctl", "enable", "kubelet.service", "containerd.service",
                    "undo-mount-hacks.service"], check=True, capture_output=True)  # fmt: skip
    subprocess.run(["chroot", str(rootfs), "systemctl", "mask", "systemd-binfmt.service"], check=True,
                   capture_output=True)  # fmt: skip
    # kind's units run its own builds from /usr/local; Debian's are in /usr/bin and /usr/lib/cni.
    (rootfs / "usr/local/bin/containerd").symlink_to("/usr/bin/containerd")
    cni = rootfs / "opt/cni/bin"
    cni.mkdir(parents=True)
    for plugin in (rootfs / "usr/lib/cni").iterdir():
        (cni / plugin.name).symlink_to(f"/usr/lib/cni/{plugin.name}")
    # The base runtime spec kind's containerd configuration names: containerd's default, with kind's
    # createContainer hook and without rlimits.
    spec = json.loads(subprocess.run(["ctr", "oci", "spec"], check=True, capture_output=True, text=True).stdout)
    spec.setdefault("hooks", {}).setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
    spec["process"].pop("rlimits", None)
    (rootfs / "etc/containerd/cri-base.json").write_text(json.dumps(spec, indent=2))
    for name in ["kubelet", "kubeadm", "kubectl"]:
        shutil.copyfile(bin_dir / name, rootfs / "usr/bin" / name)
        (rootfs / "usr/bin" / name).chmod(0o755)
    (rootfs / "etc/kubernetes/manifests").mkdir(parents=True)
    (rootfs / "kind/version").write_text(K8S)


def manifests(rootfs: Path, bin_dir: Path, components: str) -> None:
    """The pod network and the default StorageClass kind applies at create, with the local images."""
    out = rootfs / "kind/manifests"
    out.mkdir(parents=True)
    cni = (HACK / "kind/default-cni.yaml").read_text().replace("COMPONENTS_IMAGE", components)
    (out / "default-cni.yaml").write_text(cni)
    storage = (bin_dir / "local-path-storage.yaml").read_text()
    version = VERSIONS["LOCAL_PATH_PROVISIONER_VERSION"]
    replacements = {
        f"image: rancher/local-path-provisioner:{version}": f"image: {components}",
        "image: busybox": f"image: {components}",
        "imagePullPolicy: IfNotPresent": "imagePullPolicy: Never",
        # kind's default class is `standard`, and charts and examples ask for it by that name.
        "  name: local-path\nprovisioner:": "  name: standard\n  annotations:\n"
        '    storageclass.kubernetes.io/is-default-class: "true"\nprovisioner:',
    }
    for old, new in replacements.items():
        if old not in storage:
            raise RuntimeError(f"local-path-storage.yaml {version} has no {old!r}: update hack/kindnode.py")
        storage = storage.replace(old, new)
    (out / "default-storage.yaml").write_text(storage)


class ScratchContainerd:
    """A containerd on this host whose root is the node image's /var/lib/containerd, to unpack images there."""

    def __init__(self, root: Path, state: Path) -> None:
        self.name, self.socket = "node image", state / "containerd.sock"
        config = state / "config.toml"
        config.write_text(f'version = 2\nroot = "{root}"\nstate = "{state}/run"\n'
                          f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                          f'[grpc]\n  address = "{self.socket}"\n')  # fmt: skip
        self.proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=open(state / "containerd.log", "wb"))  # noqa: SIM115  # fmt: skip
        deadline = time.monotonic() + 30
        while self.ctr("version", check=False).returncode != 0:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"containerd did not start; see {state / 'containerd.log'}")
            time.sleep(0.2)

    def ctr_argv(self) -> list[str]:
        return ["ctr", "--address", str(self.socket), "--namespace", "k8s.io"]

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.ctr_argv(), *args], check=check, capture_output=True, text=True)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def unpack_images(rootfs: Path, state: Path, components: str) -> None:
    node = ScratchContainerd(rootfs / "var/lib/containerd", state)
    try:
        node.ctr("images", "import", str(nodeimages.pause_image()))
        save = subprocess.Popen(["docker", "save", components, *tags().values()], stdout=subprocess.PIPE)
        subprocess.run([*node.ctr_argv(), "images", "import", "-"], stdin=save.stdout, check=True,
                       capture_output=True)  # fmt: skip
        if save.wait() != 0:
            raise RuntimeError(f"docker save {components} failed")
        # As kind's containerd does (discard_unpacked_layers): the snapshots stay, the layer blobs go.
        for ref in [nodeimages.PAUSE_IMAGE, nodeimages.containerd_ref(components)]:
            nodeimages.discard_layers(node, nodeimages.manifest_digest(node, ref))
    finally:
        node.stop()


def node_image(bin_dir: Path) -> str:
    key = recipe(bin_dir)
    tag = f"{REPO}/kind-node:{K8S}-{key}"
    if images._image_label(tag, "sharded.recipe") == key:
        return tag
    started = time.monotonic()
    base = images.debootstrap_image(f"{REPO}/kind-base:bookworm", NODE_PACKAGES, [])
    log(f"making the node image {tag} (first time only, a few minutes)")
    components = components_image(base, bin_dir, key)
    with tempfile.TemporaryDirectory(prefix="kind-node-") as tmp:
        rootfs, state = Path(tmp) / "rootfs", Path(tmp) / "state"
        rootfs.mkdir(), state.mkdir(), (state / "empty").mkdir()
        container = images.docker("create", base, "true").stdout.strip()
        try:
            export = subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE)
            subprocess.run(["tar", "-C", str(rootfs), "-x"], stdin=export.stdout, check=True)
            export.wait()
        finally:
            images.docker("rm", container)
        prepare_node(rootfs, bin_dir)
        manifests(rootfs, bin_dir, components)
        unpack_images(rootfs, state, components)
        images.import_rootfs(rootfs, f"{tag}-tree", [])
        # `docker import` takes no STOPSIGNAL (systemd halts cleanly on SIGRTMIN+3): a build adds it.
        (state / "Dockerfile").write_text(
            f"FROM {tag}-tree\nLABEL sharded.recipe={key}\nENV container=docker\nSTOPSIGNAL SIGRTMIN+3\n"
            'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]\n'
        )
        images.docker("build", "-q", "-t", tag, "-f", str(state / "Dockerfile"), str(state / "empty"))
        images.docker("rmi", f"{tag}-tree")
    # Earlier builds go: each node image is a single layer of GBs that shares nothing with the next.
    for name in [f"{REPO}/kind-node", f"{REPO}/kind-components"]:
        old = images.docker("images", "--format", "{{.Repository}}:{{.Tag}}", name).stdout.split()
        stale = [t for t in old if t not in (tag, components)]
        if stale:
            images.docker("rmi", *stale, check=False)
    log(f"node image made in {time.monotonic() - started:.0f}s")
    return tag


def cluster_config(key: str) -> Path:
    """kind's cluster configuration for the node image: one control-plane node; kubeadm told where the
    images are; on a cgroup v1 host, the kubelet allowed to run there (it refuses by default since 1.35); on
    a host whose bounding set is short, containerd kept from lowering OOM scores."""
    t = tags()
    patches = [
        "kind: ClusterConfiguration\n"
        f"imageRepository: {REPO}\n"
        f'etcd: {{local: {{imageTag: "{t["etcd"].split(":")[1]}"}}}}\n'
        f'dns: {{imageTag: "{t["coredns"].split(":")[1]}"}}\n'
    ]
    if not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        patches.append("kind: KubeletConfiguration\nfailCgroupV1: false\n")
    body = "kind: Cluster\napiVersion: kind.x-k8s.io/v1alpha4\nnodes:\n  - role: control-plane\n"
    if not images.bounding_set_complete():
        # Without CAP_SYS_RESOURCE no process may lower its OOM score, and runc's child dies setting the
        # sandbox's -998 ("can't get final child's PID from pipe"): containerd is told not to ask.
        body += ("containerdConfigPatches:\n  - |-\n    [plugins.\"io.containerd.grpc.v1.cri\"]\n"
                 "      restrict_oom_score_adj = true\n")  # fmt: skip
    body += "kubeadmConfigPatches:\n" + "".join("  - |\n" + "".join(f"    {line}\n" for line in p.splitlines())
                                               for p in patches)  # fmt: skip
    out = images.CACHE / "kind" / f"cluster-{key}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(body)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] not in (["e2e"], ["image"]):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    ensure_privileged_runs()
    bin_dir = binaries()
    image = node_image(bin_dir)
    config = cluster_config(recipe(bin_dir))
    print(f"KIND_NODE_IMAGE={image}\nKIND_CONFIG={config}")
    if argv[0] == "image":
        return 0
    built = images.build_all()
    env = {**os.environ, "KIND_NODE_IMAGE": image, "KIND_CONFIG": str(config), "BUILD_IMAGES": "0",
           "KIND_DELETE": os.environ.get("KIND_DELETE", "1"), "OPERATOR_IMAGE": built["operator"],
           "TRAINER_IMAGE": built["trainer"], "PATH": f"{bin_dir}:{os.environ['PATH']}",
           # One kind node on this machine's cores: what is left after the control plane, for two pods.
           "QUICKSTART_CPU": os.environ.get("QUICKSTART_CPU", "250m" if (os.cpu_count() or 1) <= 2 else "500m"),
           }  # fmt: skip
    return subprocess.run(["bash", str(HACK / "kind-e2e.sh")], env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
