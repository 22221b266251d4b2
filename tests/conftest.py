"""Shared fixtures: the real local control plane for the integration and e2e tiers."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from localstack import cluster as localcluster
from localstack.stack import CRD_FILE, OperatorProcess, install_crd, wait_collectable

ROOT = Path(__file__).resolve().parent.parent

# Inductor on CPU probes every vector ISA that /proc/cpuinfo lists by building a test library and loading it
# in a fresh Python that imports torch: ~14 s of CPU in each compiling process, every torchrun worker of
# every compiled run. Trusting cpuinfo skips the base probes (the same kernels come out on this machine);
# set here, before anything imports torch, so the test process and every process it starts inherit it.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# One intra-op thread in the test process and whatever it starts that does not choose for itself (torchrun
# already gives each of several workers one): the lanes share two cores, so a second thread only spins on
# the tiny models here. Measured: 40 greedy answers of a tiny model took 4-7 CPU-seconds with two threads,
# 1.1 with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The per-tier time table printed at the end of every run, and the floor under the collected tests; the realnode
# tier's shared nodes.
pytest_plugins = ["support.suite_clock", "support.realnodes"]


@pytest.fixture(scope="session")
def cluster() -> Iterator[localcluster.LocalCluster]:
    """A started control plane with 4 KWOK nodes of 8 GPUs each, stopped after the session."""
    with localcluster.running_cluster(gpu_nodes=4) as c:
        yield c


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """The operator and trainer images, built from the repo's Dockerfiles (dockerd started if needed)."""
    import images as built

    return built.build_all()


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
def crd_installed(cluster) -> dict:
    """The generated CRD, applied and Established, its jobs' dependents collected once they are deleted."""
    install_crd(cluster.kubeconfig)
    wait_collectable(cluster.kubeconfig)
    return yaml.safe_load(CRD_FILE.read_text())


_ns_counter = iter(range(10_000))
STUCK = "kwok.sharded.dev/stuck"  # hack/kwok-stages.yaml: such a pod is never removed after its deletion


@pytest.fixture
def namespace(core) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards."""
    name = f"t{int(time.time()) % 100000}-{next(_ns_counter)}"
    core.create_namespace({"metadata": {"name": name}})
    # The controller-manager's serviceaccount controller creates `default`; pods are refused without it.
    wait_for(lambda: core.read_namespaced_service_account("default", name), timeout=30, what="default SA")
    yield name
    from kubernetes.client.rest import ApiException

    # A pod a test left stuck (KWOK never removes it, as a dead kubelet would not) would hold the namespace
    # Terminating for good, and with it the next tests that wait for a quiet cluster: one failure, not several.
    for pod in core.list_namespaced_pod(name).items:
        if STUCK in (pod.metadata.annotations or {}):
            with contextlib.suppress(ApiException):  # gone meanwhile
                core.delete_namespaced_pod(pod.metadata.name, name, grace_period_seconds=0)
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


@pytest.fixture(scope="session")
def operator(cluster, crd_installed, tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    # A short restart grace: KWOK removes deleted pods at once anyway, but a pod left stuck (a dead kubelet)
    # must outlive its grace before the operator may force it out.
    op = OperatorProcess(
        cluster.kubeconfig,
        log,
        RESTART_GRACE_SECONDS="3",
        SUSPEND_GRACE_SECONDS="5",
        PROGRESS_WRITE_SECONDS="1",
        IGNORE_NAMESPACES="kube-system,ha-*",  # the replicas of test_ha.py act there
    ).start()
    yield op
    op.stop()


@pytest.fixture(scope="session")
def world4_run(tmp_path_factory):
    """For the trainer tier's modules (each torchrun launch costs tens of seconds on 2 cores): an
    uninterrupted 2x2 run of 20 steps per strategy (micro-batch 4, global batch 16), checkpointing at 10 and
    20, made once for both strategies (in one launch, the first time either is asked for) and shared:
    (strategy, directory, config, run)."""
    from support.torchrun_jobs import run_many, write_config

    made: dict = {}

    def get(strategy: str):
        if not made:
            tmp = tmp_path_factory.mktemp("ref")
            strategies = ("fsdp", "zero2")
            configs = [write_config(tmp / s, **{"strategy.type": s, "tensorboard": True}) for s in strategies]
            for s, config, run in zip(strategies, configs, run_many(tmp, configs), strict=True):
                made[s] = (s, config.parent, config, run)
        return made[strategy]

    return get


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """item.call_failed: whether the test's body failed, for fixtures that explain a failure at tear-down."""
    report = yield
    if report.when == "call":
        item.call_failed = report.failed
    return report
