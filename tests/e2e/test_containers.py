"""End to end in containers: the pods run from the trainer image built from trainer/Dockerfile, each in
its own container as uid 1000 with the claim's fsGroup (the node agent's container mode), and the image
itself runs a 2-process gloo job. What process mode cannot show: the image's entrypoint, user and
environment, the claim's permissions for that user, the shm size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from localstack.containers import container_name, sandbox_name
from localstack.nodeagent import can_isolate
from localstack.stack import LocalStack
from sharded_trainer.checkpoint.manager import committed_steps
from support.e2e import NS, Jobs, cleanup, job
from support.torchrun_jobs import write_config

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not can_isolate(), reason="pods run in network namespaces: needs root and iproute2"),
]
UID = 1000  # the pods' runAsUser and fsGroup (the operator's pod defaults, the image's user)


@pytest.fixture(scope="module")
def stack(images):
    s = LocalStack(Path(tempfile.mkdtemp(prefix="sharded-containers-")), containers=True).start()
    yield s
    s.stop()


@pytest.fixture
def jobs(stack):
    j = Jobs(stack)
    yield j
    cleanup(j)


def in_image(name: str, images, **kw) -> dict:
    body = job(name, **kw)
    body["spec"]["image"] = images["trainer"]
    return body


def test_the_trainer_image_runs_help_and_a_two_process_gloo_job_as_uid_1000(images, tmp_path):
    image = images["trainer"]
    helped = subprocess.run(["docker", "run", "--rm", "--network", "none", image, "python", "-m", "sharded_trainer",
                             "--help"], capture_output=True, text=True)  # fmt: skip
    assert helped.returncode == 0 and "--config" in helped.stdout, helped.stderr
    # A cluster may run the image as a uid it has no passwd entry for: code asking for the user name
    # (torch's compile cache does) still gets one.
    anyone = subprocess.run(["docker", "run", "--rm", "--network", "none", "--user", "4321:0", image, "python", "-c",
                             "import getpass; print(getpass.getuser())"], capture_output=True, text=True)  # fmt: skip
    assert anyone.returncode == 0 and anyone.stdout.strip(), anyone.stderr
    lab = subprocess.run(["docker", "run", "--rm", "--network", "none", image, "python", "-m", "jupyterlab",
                          "--version"], capture_output=True, text=True)  # fmt: skip
    assert lab.returncode == 0 and lab.stdout.startswith("4."), lab.stderr  # spec.interactive's JupyterLab
    job_dir, claim = tmp_path / "job", tmp_path / "claim"
    write_config(job_dir, **{"checkpoint.dir": "/claim/ckpt", "progressFile": "/claim/progress.json"})
    claim.mkdir()
    os.chown(claim, 0, UID)  # as the kubelet leaves a claim for fsGroup: group-owned, group-writable
    claim.chmod(0o2775)
    run = subprocess.run(
        # No network: torchrun --standalone binds its store to the hostname, which Docker maps in /etc/hosts
        # only when it names one, hence --hostname.
        ["docker", "run", "--rm", "--network", "none", "--hostname", "localhost", "--shm-size", "256m",
         "--group-add", str(UID),
         "-v", f"{job_dir}:/job:ro", "-v", f"{claim}:/claim", image,
         "torchrun", "--standalone", "--nproc-per-node", "2", "-m", "sharded_trainer", "--config", "/job/trainer.yaml"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert committed_steps(claim / "ckpt") == [10, 20]
    written = [p for p in (claim / "ckpt").rglob("*") if p.is_file()]
    assert written and all(p.stat().st_uid == UID for p in written)  # the image's user, not root
    assert json.loads((claim / "progress.json").read_text())["step"] == 20


def test_a_privileged_container_starts_with_every_capability_this_host_can_grant(images):
    """kind runs its nodes `--privileged`, which asks runc for every capability the kernel knows: where the
    host's bounding set is short, the dockerd hack/images.py starts filters the request (hack/kind/runc-capfilter)
    and the container starts with the administrative capabilities; an unprivileged one keeps Docker's default
    few."""
    with open("/proc/self/status") as f:
        host = next(line.split()[1] for line in f if line.startswith("CapBnd:"))

    def effective(*flags: str) -> str:
        run = subprocess.run(["docker", "run", "--rm", "--network", "none", *flags, images["base"], "grep", "CapEff",
                              "/proc/self/status"], capture_output=True, text=True)  # fmt: skip
        assert run.returncode == 0, run.stderr
        return run.stdout.split()[1]

    sys_admin, net_admin = 1 << 21, 1 << 12
    privileged, default = int(effective("--privileged"), 16), int(effective(), 16)
    assert privileged & ~int(host, 16) == 0  # nothing the host lacks
    assert privileged & sys_admin and privileged & net_admin  # what a kind node's systemd and kubelet need
    assert not default & sys_admin


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_quickstart_in_containers_writes_checkpoints_to_the_claim_as_uid_1000(jobs, images, stack, strategy):
    name = f"ctr-{strategy}"
    jobs.create(in_image(name, images, strategy=strategy))
    status = jobs.wait(name, lambda s: s.get("phase") in ("Succeeded", "Failed"), what="finished")
    assert status["phase"] == "Succeeded", jobs.logs(name)[-30000:]
    assert status["progress"]["step"] == 30 and jobs.checkpoints(name) == [10, 20, 30]
    root = stack.claim_dir(NS, f"{name}-checkpoints")
    files = [p for p in (root / name).rglob("*") if p.is_file()]
    assert files and {(p.stat().st_uid, p.stat().st_gid) for p in files} == {(UID, UID)}
    assert root.stat().st_gid == UID and root.stat().st_mode & 0o2070 == 0o2070  # fsGroup applied to the claim


def test_a_killed_container_restarts_the_gang_and_it_resumes_from_the_newest_checkpoint(jobs, images, stack):
    name = "ctr-kill"
    jobs.create(in_image(name, images, steps=80))
    jobs.wait(name, lambda s: (s.get("lastCheckpoint") or {}).get("step", 0) >= 10, what="first checkpoint")
    victim = next(r for r in jobs.runs(name) if r.name == f"{name}-1")
    inspect = subprocess.run(["docker", "inspect", "-f", "{{.Config.Image}} {{.Config.User}}",
                              container_name(victim.uid)], capture_output=True, text=True, check=True)  # fmt: skip
    image, user = inspect.stdout.split()
    assert image == images["trainer"] and user == f"{UID}:{UID}"
    # `sharded exec` through the API server lands in the pod's own container, as its user, with its env; its
    # /dev/shm is the spec's size, owned as the real kubelet leaves a memory-backed emptyDir under an fsGroup.
    env = {**os.environ, "KUBECONFIG": str(stack.cluster.kubeconfig)}
    sharded = f"{Path(sys.executable).parent}/sharded"
    probe = "id -u; echo $PET_NODE_RANK; stat -c '%g %a' /dev/shm; df -k /dev/shm | tail -n 1"
    whoami = subprocess.run([sharded, "exec", name, "--node", "1", "--", "sh", "-c", probe],
                            capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    uid, rank, shm, df = whoami.stdout.splitlines()
    assert (whoami.returncode, uid, rank, shm) == (0, str(UID), "1", f"{UID} 3777"), (whoami.stdout, whoami.stderr)
    assert int(df.split()[1]) * 1024 > 64 * 2**20, df
    stack.agent.crash(victim)  # `docker kill -s KILL`: no checkpoint, no goodbye
    status = jobs.wait(name, lambda s: s.get("phase") in ("Succeeded", "Failed"), what="finished")
    assert status["phase"] == "Succeeded", jobs.logs(name)[-30000:]
    assert status["restarts"] == 1 and status["lastFailure"]["exitCode"] == 137
    resumed = [json.loads(line[8:]) for line in jobs.logs(name).splitlines() if '"event": "resumed"' in line]
    assert resumed and resumed[0]["step"] >= 10 and resumed[0]["step"] % 10 == 0
    assert jobs.checkpoints(name)[-1] == 80
    left = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True).stdout
    assert container_name(victim.uid) not in left.split()  # the crashed pod's container and sandbox are gone
    assert sandbox_name(victim.uid) not in left.split()
