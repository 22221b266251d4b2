"""The images a real node (realnode.py) runs, put into its containerd without a registry: the sandbox (pause)
image and a busybox probe image, both made here as OCI archives, and the project's Docker-built images (the
trainer's), streamed from `docker save`.

A real node's containerd keeps its images under the cache, not the run's directory, so a run imports only
what changed since the last (the trainer image is 6 GB: about three minutes per node here). Once unpacked, an
image's layer blobs are let go, as containerd's `discard_unpacked_layers` does for images the CRI pulls: the
containers run from the unpacked snapshots, and a second copy of every layer would double the node's disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from localstack.cluster import ROOT

CACHE = Path(os.environ.get("SHARDED_CACHE_DIR") or Path.home() / ".cache" / "sharded-training")
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
LAYER_REF = "containerd.io/gc.ref.content.l."  # a manifest's label that keeps one of its layers' blobs
SNAPSHOT_REF = "containerd.io/gc.ref.snapshot."  # a config's label naming its unpacked chain, by snapshotter


class Node(Protocol):
    name: str

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess: ...

    def ctr_argv(self) -> list[str]: ...


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


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


def docker_image_id(tag: str) -> str:
    return _run("docker", "image", "inspect", "-f", "{{.Id}}", tag).stdout.strip()


def containerd_ref(tag: str) -> str:
    """The name containerd gives a Docker tag (Docker's short names are docker.io's)."""
    first, _, rest = tag.partition("/")
    if not rest:
        return f"docker.io/library/{tag}"
    return tag if "." in first or ":" in first or first == "localhost" else f"docker.io/{tag}"


def manifest_digest(node: Node, ref: str) -> str | None:
    listing = [line.split() for line in node.ctr("images", "ls").stdout.splitlines()[1:]]
    return next((fields[2] for fields in listing if fields and fields[0] == ref), None)


def has_image(node: Node, tag: str, image_id: str) -> bool:
    """Whether the node's containerd holds this very build under `tag`, unpacked: the image ID is its config's
    digest, and the config names the unpacked snapshot chain (an import that failed while unpacking leaves the
    image's record without it: imported again, not taken as there)."""
    manifest = manifest_digest(node, containerd_ref(tag))
    if manifest is None:
        return False
    config = json.loads(node.ctr("content", "get", manifest).stdout)["config"]["digest"]
    if config != image_id:
        return False
    labels = image_labels(node, config)
    chain = labels.get(f"{SNAPSHOT_REF}overlayfs")
    return chain is not None and node.ctr("snapshots", "info", chain, check=False).returncode == 0


def image_labels(node: Node, digest: str) -> dict[str, str]:
    """The labels containerd keeps on a blob of its content store (a manifest's, a config's)."""
    line = next((line for line in node.ctr("content", "ls").stdout.splitlines() if line.startswith(digest)), "")
    fields = line.split()
    return dict(label.split("=", 1) for label in fields[-1].split(",") if "=" in label) if fields else {}


def import_docker_images(nodes: Sequence[Node], tags: Sequence[str], log=print) -> None:
    """The Docker images `tags` in the containerd of every node in `nodes`, each build streamed from one
    `docker save` to the nodes that lack it, its layer blobs then let go. The CRI plugin names each image by its
    ID as well: those of earlier builds are removed, so their snapshots go with containerd's garbage collection."""
    ids = [docker_image_id(tag) for tag in tags]
    for tag, image_id in zip(tags, ids, strict=True):
        missing = [n for n in nodes if not has_image(n, tag, image_id)]
        if missing:
            log(f"importing {tag} ({image_id[7:19]}) into {', '.join(n.name for n in missing)}: minutes for a new "
                "build, nothing for one already there")  # fmt: skip
            _stream(tag, missing)
        for n in nodes:  # every node's: an import interrupted before this left its blobs
            if not has_image(n, tag, image_id):
                raise RuntimeError(f"{tag} ({image_id}) is not unpacked in {n.name}'s containerd after its import")
            discard_layers(n, manifest_digest(n, containerd_ref(tag)))
    for n in nodes:
        stale = [ref for ref in n.ctr("images", "ls", "-q").stdout.split() if ref.startswith("sha256:")
                 and ref not in ids]  # fmt: skip
        if stale:
            n.ctr("images", "rm", *stale)


def _stream(tag: str, nodes: Sequence[Node]) -> None:
    """One `docker save` of `tag` read once and written to `ctr images import -` of every node."""
    save = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    imports = [subprocess.Popen([*n.ctr_argv(), "images", "import", "-"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in nodes]  # fmt: skip
    outputs = [b""] * len(imports)

    def drain(i: int) -> None:  # so that a full output pipe never stalls the stream
        outputs[i] = imports[i].stdout.read()

    drains = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(imports))]
    for t in drains:
        t.start()
    try:
        while chunk := save.stdout.read(1 << 20):
            for p in imports:
                p.stdin.write(chunk)
    finally:
        for p in imports:
            p.stdin.close()
    saved = save.wait()
    for t in drains:
        t.join()
    failed = [(n.name, p.wait(), out.decode()[-500:]) for n, p, out in zip(nodes, imports, outputs, strict=True)]
    failed = [f for f in failed if f[1] != 0]
    if saved != 0 or failed:
        raise RuntimeError(f"importing {tag} failed: docker save exited {saved} "
                           f"({save.stderr.read().decode()[-500:]}); imports: {failed}")  # fmt: skip


def discard_layers(node: Node, manifest: str) -> None:
    """Let go of an unpacked image's layer blobs: its manifest no longer references them for the garbage
    collector, and they are removed. What stays: the manifest, the config (which references the unpacked
    snapshot chain, and is all the CRI reads of an image) and the snapshots."""
    layers = {key: value for key, value in image_labels(node, manifest).items() if key.startswith(LAYER_REF)}
    if layers:
        node.ctr("content", "label", manifest, *(f"{key}=" for key in layers))
        node.ctr("content", "rm", *layers.values())
