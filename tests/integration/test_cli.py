"""The `sharded` command line and the typed client against the real API server and a running operator
(KWOK nodes run the pods; annotations end them). Logs are read in the e2e tier, where pods write some."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from sharded_operator.client import Client, JobError
from sharded_operator.run.k8s import Kube
from support.jobs import make_job

pytestmark = pytest.mark.integration


@pytest.fixture
def sharded(cluster, namespace, operator):
    """Run the CLI as a user does: its own process, the kubeconfig from KUBECONFIG, the namespace by flag."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}

    def run(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [sys.executable, "-m", "sharded_operator.cli.main", "-n", namespace, *args],
            capture_output=True, text=True, env=env, input=stdin, timeout=180,
        )  # fmt: skip
        if check:
            assert out.returncode == 0, (args, out.stdout, out.stderr)
        return out

    return run


def end_pods(core, namespace: str, name: str, code: int) -> None:
    for i in range(2):
        ann = {"kwok.sharded.dev/exit-code": str(code)}
        core.patch_namespaced_pod(f"{name}-{i}", namespace, {"metadata": {"annotations": ann}})


def test_submit_from_flags_list_get_suspend_resume_and_wait(sharded, core, namespace):
    out = sharded(
        "submit",
        "--name",
        "flags",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--strategy",
        "zero2",
        "--image",
        "trainer:test",
        "--set",
        "trainer.steps=50",
        "--set",
        "failurePolicy.backoffLimit=1",
    )
    assert "shardedtrainingjob/flags created" in out.stdout
    sharded("wait", "flags", "--for", "condition=Running", "--timeout", "60s")
    listing = sharded("list").stdout.splitlines()
    assert listing[0].split()[:4] == ["NAME", "PHASE", "READY", "STRATEGY"]
    assert listing[1].split()[:4] == ["flags", "Running", "2/2", "zero2"]
    got = json.loads(sharded("get", "flags", "-o", "json").stdout)
    assert got["spec"]["trainer"]["steps"] == 50 and got["spec"]["resources"]["gpusPerNode"] == 4
    text = sharded("get", "flags").stdout
    assert "Phase:       Running" in text and "Running        True" in text

    assert "suspended" in sharded("suspend", "flags").stdout
    sharded("wait", "flags", "--for", "condition=Suspended", "--timeout", "60s")
    assert "resumed" in sharded("resume", "flags").stdout
    sharded("wait", "flags", "--for", "phase=Running", "--timeout", "60s")
    assert json.loads(sharded("get", "flags", "-o", "json").stdout)["status"]["attempt"] == 2

    end_pods(core, namespace, "flags", 0)
    out = sharded("wait", "flags", "--for", "condition=Complete", "--timeout", "60s")
    assert "condition met: Complete" in out.stdout


def test_submit_from_a_file_and_the_errors_a_user_sees(sharded, core, namespace):
    body = make_job("file").nodes(2).spec("failurePolicy.backoffLimit", 0).obj()
    del body["metadata"]["uid"], body["metadata"]["namespace"], body["metadata"]["generation"]
    assert "created" in sharded("submit", "-f", "-", stdin=yaml.safe_dump(body)).stdout
    # The same name again: the API server's answer, not a traceback.
    again = sharded("submit", "-f", "-", stdin=yaml.safe_dump(body), check=False)
    assert again.returncode == 1 and again.stderr.startswith("error: creating file:")
    assert "already exists" in again.stderr
    # An invalid manifest is refused at admission with the field named.
    bad = sharded("submit", "--name", "bad", "--nodes", "0", check=False)
    assert bad.returncode == 1 and "spec.nodes" in bad.stderr, bad.stderr
    # A wait that cannot be met in time says what it waited for.
    slow = sharded("wait", "file", "--for", "condition=Complete", "--timeout", "2s", check=False)
    assert slow.returncode == 1 and "no condition Complete within 2 s" in slow.stderr
    # A job that fails ends a wait for Complete at once, with the reason, instead of running out the clock.
    sharded("wait", "file", "--for", "condition=Running", "--timeout", "60s")
    end_pods(core, namespace, "file", 2)  # exit code 2: permanent
    failed = sharded("wait", "file", "--for", "condition=Complete", "--timeout", "120s", check=False)
    assert failed.returncode == 1 and "file ended Failed" in failed.stderr, failed.stderr
    assert sharded("get", "nope", check=False).stderr.startswith("error: no ShardedTrainingJob 'nope'")
    usage = sharded("wait", "file", "--for", "ready", check=False)
    assert usage.returncode == 1 and "use condition=NAME or phase=NAME" in usage.stderr


def test_the_typed_client_returns_the_operator_models(cluster, namespace, operator, core):
    jobs = Client(Kube.connect(str(cluster.kubeconfig)), namespace)
    body = make_job("typed").nodes(2).obj()
    del body["metadata"]["uid"], body["metadata"]["namespace"], body["metadata"]["generation"]
    created = jobs.create(body)
    assert created.name == "typed" and created.obj.spec.nodes == 2
    running = jobs.wait("typed", phase="Running", timeout=60)
    assert running.obj.status.ready == "2/2" and running.condition("Running") == "True"
    assert [j.name for j in jobs.list()] == ["typed"]
    with pytest.raises(JobError, match="already exists"):
        jobs.create(body)
    end_pods(core, namespace, "typed", 0)
    done = jobs.wait("typed", condition="Complete", timeout=60)
    assert done.phase == "Succeeded" and done.condition("Succeeded") == "True"
