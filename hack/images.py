"""The operator and trainer images, built here from the repo's own Dockerfiles.

No image registry is reachable from the test machines, so two things are swapped, and only those, through
the Dockerfiles' build arguments: the base image (Debian bookworm with Python 3.11, made by debootstrap and
`docker import`, standing in for python:3.11-slim-bookworm) and the package index (the locked files of
requirements/, downloaded once by hack/setup-env.sh, served on loopback as a PEP 503 index). Everything
else is what users build. Docker's layer cache keys the multi-GB dependency layer on the lock, so after
the first build a code change rebuilds only the project's own layer.

    python hack/images.py            # start dockerd if needed, build both images, print their tags
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SHARDED_CACHE_DIR") or Path.home() / ".cache" / "sharded-training")
WHEELHOUSE = CACHE / "wheelhouse"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# python:3.11-slim carries Python's headers (torch extensions compile against them); Debian splits them out.
BASE_PACKAGES = ["python3", "python3-venv", "python3-dev", "ca-certificates"]
# A fixed port: the index URL is a build argument, and a different one would miss the layer cache.
INDEX_PORT = 36617
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]  # type: ignore[index]
# What the build contexts hold: .dockerignore lets in only these (tests/unit/test_images.py keeps the two
# the same), so they and the Dockerfile and base are every input of an image.
CONTEXT = [
    "pyproject.toml",
    "README.md",
    "requirements",
    "api/sharded_api",
    "operator/sharded_operator",
    "trainer/sharded_trainer",
]
OPERATOR_IMAGE = f"sharded-training/operator:{VERSION}"
TRAINER_IMAGE = f"sharded-training/trainer:{VERSION}"


def log(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


def docker(*args: str, check: bool = True, capture: bool = True, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}  # the classic builder: no buildx plugin is needed
    return subprocess.run(["docker", *args], check=check, capture_output=capture, text=True, env=env, **kw)


def apt_install(package: str) -> None:
    """Debian's package, installed non-interactively; the package lists are refreshed first only when the
    install fails without them (a machine whose lists are missing or stale)."""
    log(f"installing Debian's {package} (first time only)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", package]
    if subprocess.run(cmd, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True, env=env)
        subprocess.run(cmd, check=True, capture_output=True, env=env)


def dockerd_running() -> bool:
    return shutil.which("docker") is not None and docker("info", check=False).returncode == 0


def ensure_dockerd(timeout: float = 90) -> None:
    """Start dockerd when none answers (installing Debian's docker.io first if missing). It stays up after
    the tests, like the caches: the next run reuses it and its image store."""
    if dockerd_running():
        return
    if shutil.which("dockerd") is None:
        apt_install("docker.io")
    CACHE.mkdir(parents=True, exist_ok=True)
    out = open(CACHE / "dockerd.log", "ab")  # noqa: SIM115 - owned by the daemon
    subprocess.Popen(["dockerd", *dockerd_runtime_args()], stdout=out, stderr=subprocess.STDOUT,
                     stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout
    while not dockerd_running():
        if time.monotonic() > deadline:
            raise TimeoutError(f"dockerd did not answer within {timeout}s; see {CACHE / 'dockerd.log'}")
        time.sleep(0.5)
    log("dockerd started")


CAPFILTER = ROOT / "hack" / "kind" / "runc-capfilter"
CAPFILTER_RUNTIME = "capfilter"  # its name among dockerd's runtimes


def bounding_set_complete() -> bool:
    """Whether this host's capability bounding set holds every capability the kernel knows, as
    `docker run --privileged` (kind's nodes) needs runc to grant."""
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    status = Path("/proc/self/status").read_text()
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("CapBnd:"))
    return mask == (1 << (last + 1)) - 1


def dockerd_runtime_args() -> list[str]:
    """dockerd's runtime flags: runc through hack/kind/runc-capfilter where the bounding set is short (else
    every privileged container fails to start), plain runc elsewhere. The filter's copy in the cache outlives
    the checkout that started the daemon."""
    if bounding_set_complete():
        return []
    runtime = CACHE / "runc-capfilter"
    shutil.copyfile(CAPFILTER, runtime)
    runtime.chmod(0o755)
    return ["--add-runtime", f"{CAPFILTER_RUNTIME}={runtime}", "--default-runtime", CAPFILTER_RUNTIME]


def _image_label(tag: str, label: str) -> str | None:
    out = docker("image", "inspect", "-f", f'{{{{index .Config.Labels "{label}"}}}}', tag, check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def base_image() -> str:
    """Debian bookworm with Python 3.11 (`python` on PATH, venv available), keyed on its recipe."""

    def python_on_path(rootfs: Path) -> None:
        (rootfs / "usr/local/bin/python").symlink_to("/usr/bin/python3")

    return debootstrap_image("sharded-local/python:3.11-bookworm", BASE_PACKAGES, ['CMD ["python"]'], python_on_path)


def debootstrap_image(name: str, packages: list[str], changes: list[str], prepare=None) -> str:
    """A Debian bookworm image made by debootstrap with `packages` and `docker import`ed with the Dockerfile
    `changes`, tagged `name-<recipe>` and made again only when the mirror or the packages change;
    `prepare(rootfs)` edits the tree first."""
    recipe = hashlib.sha256(" ".join([DEBIAN_MIRROR, *packages]).encode()).hexdigest()[:12]
    tag = f"{name}-{recipe}"
    if _image_label(tag, "sharded.recipe") == recipe:
        return tag
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    started = time.monotonic()
    log(f"making the image {tag} with debootstrap (first time only, about 3 minutes)")
    with tempfile.TemporaryDirectory(prefix="sharded-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", "bookworm",
                        str(rootfs), DEBIAN_MIRROR], check=True, capture_output=True)  # fmt: skip
        if prepare is not None:
            prepare(rootfs)
        shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
        (rootfs / "var/lib/apt/lists").mkdir()
        import_rootfs(rootfs, tag, [f"LABEL sharded.recipe={recipe}", *changes])
    log(f"{tag} made in {time.monotonic() - started:.0f}s")
    return tag


def import_rootfs(rootfs: Path, tag: str, changes: list[str]) -> None:
    """The directory tree `rootfs` as the one-layer image `tag`, with the Dockerfile instructions `changes`."""
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    docker("import", *(arg for change in changes for arg in ("--change", change)), "-", tag, stdin=tar.stdout)
    if tar.wait() != 0:
        raise RuntimeError(f"tar of {rootfs} failed")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@contextlib.contextmanager
def package_index() -> Iterator[str]:
    """The wheelhouse as a PEP 503 simple index on loopback, for the duration of a build."""
    found = WHEELHOUSE.iterdir() if WHEELHOUSE.is_dir() else []
    files = sorted(p for p in found if p.suffix in (".whl", ".gz", ".zip"))
    if not files:
        raise RuntimeError(f"{WHEELHOUSE} is empty: run `make setup` first (it downloads the locked files)")
    with tempfile.TemporaryDirectory(prefix="sharded-index-") as tmp:
        for f in files:
            project = _normalize(re.split(r"-\d", f.name, maxsplit=1)[0])
            folder = Path(tmp) / "simple" / project
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f.name).symlink_to(f)
        handler = functools.partial(_QuietHandler, directory=tmp)
        try:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
        except OSError:  # taken: any port works, the dependency layer is just rebuilt
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/simple/"
        finally:
            server.shutdown()
            server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def inputs_digest(dockerfile: str, base: str, root: Path = ROOT) -> str:
    """A digest of everything an image is built from: the Dockerfile, the base image, and each file of the
    build context by name and content (bytecode caches aside, as .dockerignore leaves them out)."""
    h = hashlib.sha256(f"{base}\0".encode() + (root / dockerfile).read_bytes())
    for entry in CONTEXT:
        path = root / entry
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" not in f.parts:
                h.update(b"\0" + str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def build(dockerfile: str, tag: str, base: str, index: str, inputs: str) -> None:
    started = time.monotonic()
    log(f"building {tag} from {dockerfile} (cached layers are reused; the first build of the trainer image "
        "installs torch: several minutes)")  # fmt: skip
    result = docker("build", "--network", "host", "-f", dockerfile, "--build-arg", f"BASE_IMAGE={base}",
                    "--build-arg", f"PIP_INDEX_URL={index}", "--label", f"sharded.inputs={inputs}", "-t", tag,
                    str(ROOT), check=False)  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"docker build of {tag} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    log(f"{tag} ready in {time.monotonic() - started:.0f}s")


def build_all() -> dict[str, str]:
    """Both images, built from the repo's Dockerfiles; returns {'operator': tag, 'trainer': tag}. An image
    whose label records the digest of its inputs as they are now is used as it is (Docker's own cache would
    rebuild it from cached layers, but only after sending and hashing the context: most of a minute). One
    build at a time on this machine (the suite's lanes each ask for the images): a second waits for the
    first, and no prune runs under another's build."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "images.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ensure_dockerd()
        base = base_image()
        wanted = [(f, tag, inputs_digest(f, base)) for f, tag in
                  [("operator/Dockerfile", OPERATOR_IMAGE), ("trainer/Dockerfile", TRAINER_IMAGE)]]  # fmt: skip
        stale = [(f, tag, d) for f, tag, d in wanted if _image_label(tag, "sharded.inputs") != d]
        if not stale:
            log("both images match their inputs: used as they are")
        else:
            with package_index() as index:
                for dockerfile, tag, inputs in stale:
                    build(dockerfile, tag, base, index, inputs)
            # A rebuild leaves the previous image untagged (the trainer's is 5 GB): drop those, keep the cache.
            docker("image", "prune", "-f", check=False)
    return {"operator": OPERATOR_IMAGE, "trainer": TRAINER_IMAGE, "base": base}


if __name__ == "__main__":
    for kind, tag in build_all().items():
        print(f"{kind} {tag}")
