"""The local control plane from the command line (`make cluster-up`, `make cluster-down`):

PYTHONPATH=hack python -m localstack up [--dir .cluster] [--gpu-nodes 4] [--real-nodes 0] [--trainer-image]
    # prints the kubeconfig path
PYTHONPATH=hack python -m localstack down [--dir .cluster]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from localstack.cluster import ROOT, LocalCluster, binaries_dir
from localstack.nodeimages import import_docker_images, probe_image
from localstack.processes import stop_dir
from localstack.realnode import RealNode, stop_nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--dir", type=Path, default=ROOT / ".cluster", help="state directory")
    parser.add_argument("--gpu-nodes", type=int, default=4, help="KWOK nodes with 8 GPUs each")
    parser.add_argument("--real-nodes", type=int, default=0,
                        help="nodes run by the real kubelet and containerd (localstack/realnode.py; needs root), "
                             "tainted sharded.dev/real-node=true:NoSchedule")  # fmt: skip
    parser.add_argument("--trainer-image", action="store_true",
                        help="build the trainer image (hack/images.py) and put it in the real nodes' containerd, so "
                             "jobs train there (minutes for a build the nodes have not had)")  # fmt: skip
    args = parser.parse_args(argv)
    workdir = args.dir.resolve()
    if args.command == "down":
        stop_nodes(workdir)
        stop_dir(workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        print(f"stopped the cluster in {workdir}", file=sys.stderr)
        return 0
    stop_nodes(workdir)
    stop_dir(workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    started = time.monotonic()
    cluster = LocalCluster(workdir=workdir, bin_dir=binaries_dir(), gpu_nodes=args.gpu_nodes).start()
    nodes = [RealNode(cluster, index).start([probe_image()]) for index in range(1, args.real_nodes + 1)]
    if args.trainer_image and nodes:
        import images  # hack/images.py

        import_docker_images(nodes, [images.build_all()["trainer"]], log=lambda m: print(m, file=sys.stderr))
    print(
        f"cluster ready in {time.monotonic() - started:.0f}s (API {cluster.server}, logs in {workdir / 'logs'})\n"
        f"  export KUBECONFIG={cluster.kubeconfig}\n"
        f"  export PATH={cluster.bin_dir}:$PATH   # kubectl and helm\n"
        f"stop it with: make cluster-down",
        file=sys.stderr,
    )
    print(cluster.kubeconfig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
