"""Shared fixtures: the real local control plane for the integration and e2e tiers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import localcluster
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "crds" / "training.sharded.dev_shardedtrainingjobs.yaml"


@pytest.fixture(scope="session")
def cluster() -> Iterator[localcluster.LocalCluster]:
    """A started control plane with 4 KWOK nodes of 8 GPUs each, stopped after the session."""
    with localcluster.running_cluster(gpu_nodes=4) as c:
        yield c


@pytest.fixture(scope="session")
def api_client(cluster):
    from kubernetes import config

    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture(scope="session")
def core(api_client):
    from kubernetes import client

    return client.CoreV1Api(api_client)


@pytest.fixture(scope="session")
def custom(api_client):
    from kubernetes import client

    return client.CustomObjectsApi(api_client)


@pytest.fixture(scope="session")
def crd_installed(api_client) -> dict:
    """The generated CRD, applied and Established."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    ext = client.ApiextensionsV1Api(api_client)
    body = yaml.safe_load(CRD_FILE.read_text())
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as e:
        if e.status != 409:
            raise
    wait_for(
        lambda: any(
            c.type == "Established" and c.status == "True"
            for c in (ext.read_custom_resource_definition(body["metadata"]["name"]).status.conditions or [])
        ),
        timeout=30,
        what="CRD Established",
    )
    return body


_ns_counter = iter(range(10_000))


@pytest.fixture
def namespace(core) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards."""
    name = f"t{int(time.time()) % 100000}-{next(_ns_counter)}"
    core.create_namespace({"metadata": {"name": name}})
    # The controller-manager's serviceaccount controller creates `default`; pods are refused without it.
    wait_for(lambda: core.read_namespaced_service_account("default", name), timeout=30, what="default SA")
    yield name
    core.delete_namespace(name)


def wait_for(predicate: Callable[[], object], timeout: float = 30, interval: float = 0.25, what: str = "") -> object:
    """Poll until `predicate()` is truthy; return its value or fail the test with `what`."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # transient API errors while things settle
            last_exc = e
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what or predicate}" + (f": {last_exc}" if last_exc else ""))


class OperatorProcess:
    """`python -m sharded_operator` as a real process against the local cluster."""

    def __init__(self, kubeconfig: Path, log: Path, **settings: str):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "SHARDED_OPERATOR_HTTP_HOST": "127.0.0.1",
            "SHARDED_OPERATOR_HTTP_PORT": str(port),
            "SHARDED_OPERATOR_PROGRESS_URL": f"{self.url}/progress",
            "SHARDED_OPERATOR_RESYNC_SECONDS": "1",
            "SHARDED_OPERATOR_RESTART_GRACE_SECONDS": "0",
            "SHARDED_OPERATOR_SUSPEND_GRACE_SECONDS": "5",
            "SHARDED_OPERATOR_LOG_FORMAT": "plain",
            **{f"SHARDED_OPERATOR_{k.upper()}": v for k, v in settings.items()},
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        import urllib.request

        out = open(self.log, "ab")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sharded_operator"], env=self.env, stdout=out, stderr=subprocess.STDOUT
        )

        def healthy():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as r:
                return r.status == 200

        wait_for(healthy, timeout=60, what="operator /healthz")
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crashed or OOM-killed operator."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def operator(cluster, crd_installed, tmp_path_factory) -> Iterator[OperatorProcess]:
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log").start()
    yield op
    op.stop()
