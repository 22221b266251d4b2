"""Two operator replicas on the real API server: one acts (it holds the Lease), the other stands by and
still takes progress reports; SIGKILL the active one in the middle of its work and the standby takes over,
with no duplicate pods, events or restarts. (The session's own operator leaves `ha-*` namespaces alone.)"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for
from localstack import cluster as localcluster
from localstack.stack import OperatorProcess, install_crd
from sharded_operator.api.models import GROUP, PLURAL, VERSION, training_pods
from sharded_operator.run.election import LEASE_SECONDS
from support.jobs import make_job
from support.reports import mint, post

pytestmark = pytest.mark.integration
LEASE = "sharded-operator"


@pytest.fixture
def ha_namespace(core):
    name = f"ha-{int(time.time()) % 100000}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.read_namespaced_service_account("default", name), what="default SA")
    yield name
    core.delete_namespace(name)


@pytest.fixture
def replicas(cluster, crd_installed, ha_namespace, tmp_path):
    settings = {
        "NAMESPACES": ha_namespace, "LEASE_NAME": LEASE, "LEASE_NAMESPACE": ha_namespace,
        "PROGRESS_WRITE_SECONDS": "1", "RESTART_GRACE_SECONDS": "3", "IGNORE_NAMESPACES": "kube-system",
    }  # fmt: skip
    ops = [
        OperatorProcess(cluster.kubeconfig, tmp_path / f"op-{i}.log", IDENTITY=f"replica-{i}", **settings)
        for i in range(2)
    ]
    for op in ops:
        op.start()
    yield ops
    for op in ops:
        op.stop()


def holder(coordination, namespace: str) -> str | None:
    try:
        return coordination.read_namespaced_lease(LEASE, namespace).spec.holder_identity
    except Exception:
        return None


def create(custom, namespace: str, name: str, nodes: int = 4) -> str:
    body = make_job(name).nodes(nodes).gpus(2).obj()
    body["metadata"] = {"name": name}
    return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)["metadata"]["uid"]


def test_the_standby_takes_over_when_the_active_replica_is_killed(cluster, core, custom, ha_namespace, replicas):
    from kubernetes import client

    coordination = client.CoordinationV1Api(core.api_client)
    leader = wait_for(lambda: holder(coordination, ha_namespace), what="a replica holding the Lease")
    active = replicas[int(leader.rsplit("-", 1)[1])]
    standby = replicas[1 - replicas.index(active)]

    def pods(name: str) -> list:
        return core.list_namespaced_pod(ha_namespace, label_selector=training_pods(name)).items

    def running(name: str, n: int):
        ps = [p for p in pods(name) if p.status.phase == "Running"]
        status = custom.get_namespaced_custom_object(GROUP, VERSION, ha_namespace, PLURAL, name).get("status") or {}
        return len(ps) == n and status.get("phase") == "Running" and (ps, status)

    # The standby does not act: one job, created and run by the active replica only.
    create(custom, ha_namespace, "first", nodes=2)
    wait_for(lambda: running("first", 2), timeout=60, what="the first job running")
    # Progress posted to the standby reaches status all the same: nothing lives in one replica's memory.
    first_uid = custom.get_namespaced_custom_object(GROUP, VERSION, ha_namespace, PLURAL, "first")["metadata"]["uid"]
    token = mint(core, ha_namespace, pods("first")[0])
    report = {"uid": first_uid, "namespace": ha_namespace, "name": "first", "attempt": 1, "run": "r", "step": 7,
              "updatedAt": "2026-01-01T00:00:00Z"}  # fmt: skip
    assert post(standby, report, token)[0] == 200
    wait_for(lambda: running("first", 2)[1].get("progress", {}).get("step") == 7, what="progress via the standby")

    # SIGKILL the active replica while it creates a 4-pod gang.
    create(custom, ha_namespace, "second", nodes=4)
    wait_for(lambda: pods("second"), timeout=30, interval=0.05, what="the second job's first pod")
    killed_at = time.monotonic()
    active.kill()
    wait_for(lambda: holder(coordination, ha_namespace) == standby.env["SHARDED_OPERATOR_IDENTITY"],
             timeout=LEASE_SECONDS * 3, what="the standby holding the Lease")  # fmt: skip
    took_over = time.monotonic() - killed_at
    ps, status = wait_for(lambda: running("second", 4), timeout=60, what="the second job running")
    recovered = time.monotonic() - killed_at
    print(f"takeover {took_over:.1f}s, the interrupted job running {recovered:.1f}s after the kill")
    assert took_over <= LEASE_SECONDS + 5  # the Lease's duration, plus the standby's retry period and slack
    assert sorted(p.metadata.name for p in ps) == ["second-0", "second-1", "second-2", "second-3"]
    assert len(pods("second")) == 4 and (status["attempt"], status["restarts"]) == (1, 0)
    assert running("first", 2)[1]["restarts"] == 0  # the first job was left as it was

    def reasons() -> list[str]:
        return [e.reason for e in core.list_namespaced_event(ha_namespace).items if e.involved_object.name == "second"]

    # An event echoes a status already written: the Running one may follow the status that says Running.
    seen = wait_for(lambda: "Running" in (r := reasons()) and r, timeout=30, what="the second job's Running event")
    assert seen.count("Creating") <= 1 and seen.count("Running") == 1, seen  # none twice


def test_a_standby_times_the_lease_by_its_own_clock_whatever_the_holders_clock_says(cluster, core, ha_namespace,
                                                                                    tmp_path):  # fmt: skip
    """The holder's clock runs 10 s behind: its renewTime looks 10 s old the moment it is written. A holder
    acts for RENEW_DEADLINE after its last renewal; a standby that compared renewTime with its own clock
    would take over 5 s after it, while the holder still acts. Timed from when it saw the record change, it
    waits the Lease's whole duration."""
    from kubernetes import client

    from sharded_operator.run.election import RENEW_DEADLINE, micro_time

    coordination = client.CoordinationV1Api(core.api_client)
    skewed = micro_time(dt.datetime.now(dt.UTC) - dt.timedelta(seconds=10))
    spec = {"holderIdentity": "skewed-holder", "leaseDurationSeconds": LEASE_SECONDS, "acquireTime": skewed,
            "renewTime": skewed, "leaseTransitions": 1}  # fmt: skip
    coordination.create_namespaced_lease(ha_namespace, {"metadata": {"name": LEASE}, "spec": spec})
    renewed = time.monotonic()  # the holder's last renewal: it acts until renewed + RENEW_DEADLINE
    standby = OperatorProcess(
        cluster.kubeconfig,
        tmp_path / "standby.log",
        IDENTITY="standby",
        NAMESPACES=ha_namespace,
        LEASE_NAME=LEASE,
        LEASE_NAMESPACE=ha_namespace,
        IGNORE_NAMESPACES="kube-system",
    ).start()
    try:
        wait_for(lambda: holder(coordination, ha_namespace) == "standby", timeout=LEASE_SECONDS * 3, interval=0.1,
                 what="the standby holding the Lease")  # fmt: skip
        took = time.monotonic() - renewed
        print(f"taken {took:.1f}s after the skewed holder's last renewal")
        assert took >= RENEW_DEADLINE, f"taken {took:.1f}s after the last renewal, while the holder still acted"
    finally:
        standby.stop()


def _landed(events: list[dict], agent: str) -> list[dict]:
    """The writes to jobs and pods that `agent` sent and the API server carried out, in the order they landed."""
    mine = [e for e in events if e.get("userAgent") == agent and e.get("stage") == "ResponseComplete"
            and e["objectRef"]["resource"] in ("shardedtrainingjobs", "pods")
            and (e.get("responseStatus") or {}).get("code", 500) < 300]  # fmt: skip
    return sorted(mine, key=lambda e: e["stageTimestamp"])


def _log_time(log: Path, needle: str) -> dt.datetime:
    """When a replica's log (kopf's JSON lines, each with its timestamp) first says `needle`."""
    for line in log.read_text().splitlines():
        if line.startswith("{") and needle in (record := json.loads(line)).get("message", ""):
            return dt.datetime.fromisoformat(record["timestamp"])
    raise AssertionError(f"{log.name} never says {needle!r}:\n{log.read_text()[-3000:]}")


@pytest.fixture
def audited():
    """A control plane of its own whose API server keeps an audit log of the writes (the session's has none:
    each audited write waits for its line), with the CRD installed, and its clients."""
    from kubernetes import client, config

    with localcluster.running_cluster(gpu_nodes=2, audit=True) as c:
        install_crd(c.kubeconfig)
        api = config.new_client_from_config(config_file=str(c.kubeconfig))
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": "ha-audit"}})
        wait_for(lambda: core.read_namespaced_service_account("default", "ha-audit"), what="default SA")
        yield c, core, client.CustomObjectsApi(api), "ha-audit"


def test_a_slow_holder_with_a_skewed_clock_and_its_successor_never_act_at_once(audited, tmp_path):
    """Replica A holds the Lease with its clock 10 s behind; then every byte between it and the API server
    takes 6 s each way, so it cannot renew and B takes over, while a gang fails. The restart is decided once;
    A says it lost the Lease before B says it holds it; none of A's writes lands after B's first (the API
    server's audit); and every status decision, from either replica, landed over the version the previous
    one left (their logs), so neither decided from a view older than the other's writes."""
    from kubernetes import client

    from support.ops import Ops
    from support.slow_proxy import SlowProxy

    cluster, core, custom, ha_namespace = audited
    coordination, ops = client.CoordinationV1Api(core.api_client), Ops(core, custom, ha_namespace)
    server = json.loads(cluster.kubeconfig.read_text())
    proxy = SlowProxy(("127.0.0.1", cluster.api_port)).start()
    server["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    slow_kubeconfig = tmp_path / "kubeconfig-a"
    slow_kubeconfig.write_text(json.dumps(server))
    settings = {"NAMESPACES": ha_namespace, "LEASE_NAME": LEASE, "LEASE_NAMESPACE": ha_namespace,
                "RESTART_GRACE_SECONDS": "3", "IGNORE_NAMESPACES": "kube-system", "LOG_FORMAT": "json"}  # fmt: skip
    a = OperatorProcess(slow_kubeconfig, tmp_path / "a.log", IDENTITY="replica-a", **settings)
    a.command = [sys.executable, str(Path(__file__).parent / "scripts" / "skewed_operator.py")]
    a.env["SKEW_SECONDS"] = "-10"
    b = OperatorProcess(cluster.kubeconfig, tmp_path / "b.log", IDENTITY="replica-b", **settings)
    try:
        a.start()
        wait_for(lambda: holder(coordination, ha_namespace) == "replica-a", timeout=30, what="A holding the Lease")
        b.start()
        ops.create(make_job("j").nodes(2).gpus(2).spec("failurePolicy.backoffLimit", 3))
        ops.wait_running_attempt(1, 2)
        mark = cluster.audit_mark()
        proxy.delay = 6.0
        ops.exit("j-1", 137, "OOMKilled")
        wait_for(lambda: holder(coordination, ha_namespace) == "replica-b", timeout=LEASE_SECONDS * 3, interval=0.2,
                 what="B holding the Lease")  # fmt: skip
        ops.wait_running_attempt(2, 2, timeout=90)
        # A's writes still on the wire land (or are refused) within two delays; give them time to show.
        wait_for(lambda: "lost the Lease" in a.log.read_text(), timeout=60, what="A saying it lost the Lease")
        time.sleep(2 * proxy.delay + 2)
        status = ops.status()
        events = cluster.audit_events(since=mark)
    finally:
        b.stop()
        a.stop()
        proxy.close()
    assert (status["attempt"], status["restarts"]) == (2, 1), status
    assert status["lastFailure"]["pod"] == "j-1" and status["lastFailure"]["exitCode"] == 137
    lost, holding = _log_time(a.log, "lost the Lease"), _log_time(b.log, "holding the Lease")
    assert lost <= holding, f"A still believed it led at {lost}, B already acted at {holding}"
    by_a, by_b = _landed(events, "sharded-operator/replica-a"), _landed(events, "sharded-operator/replica-b")
    assert by_b, "B never wrote after taking over"
    if by_a:
        assert by_a[-1]["stageTimestamp"] < by_b[0]["requestReceivedTimestamp"], (by_a[-1], by_b[0])
    written = re.compile(rf"status of {ha_namespace}/j written over resourceVersion (\d+) -> (\d+)")
    chain = sorted((int(m[2]), int(m[1])) for log in (a.log, b.log) for m in written.finditer(log.read_text()))
    assert len(chain) >= 3, chain  # A's decisions for attempt 1, and the restart and its Running phase
    for (produced, _), (_, over) in itertools.pairwise(chain):
        assert over == produced, f"a decision landed over version {over}, not over {produced}, the last one written"
