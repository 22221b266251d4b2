"""`helm install` into the real control plane, and proof that the chart's RBAC is enough and not more:
the operator runs with the chart's ServiceAccount token and reconciles a job, and cannot read Secrets."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import wait_for
from localstack import cluster as localcluster
from localstack.stack import OperatorProcess
from sharded_operator.api.models import GROUP, PLURAL, VERSION
from support.jobs import make_job
from support.reports import mint, post

pytestmark = pytest.mark.integration
CHART = Path(__file__).resolve().parents[2] / "charts" / "sharded-training-operator"
RELEASE, NS, JOBS_NS = "sto", "sharded-system", "team-a"
SA = f"{RELEASE}-sharded-training-operator"
# A refusal as the operator's API client words it, "(403) Forbidden: ...", or as kopf and the API server do
# ("... is forbidden: User ..."); not any 403 in a log (a port or a resourceVersion can be one).
REFUSED = re.compile(r"(?i)forbidden|\(403\)")


@pytest.fixture(scope="module")
def chart_cluster():
    """A cluster of its own: the operator here must be the only one reconciling jobs."""
    with localcluster.running_cluster(gpu_nodes=2) as c:
        yield c


def helm(cluster, *args: str) -> str:
    return subprocess.run(
        [str(cluster.bin_dir / "helm"), "--kubeconfig", str(cluster.kubeconfig), *args],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


@pytest.fixture(scope="module")
def release(chart_cluster):
    chart_cluster.api("POST", "/api/v1/namespaces", {"metadata": {"name": JOBS_NS}})
    helm(chart_cluster, "install", RELEASE, str(CHART), "-n", NS, "--create-namespace",
         "--set", f"watchNamespaces={{{JOBS_NS}}}", "--wait", "--timeout", "120s")  # fmt: skip
    return chart_cluster


def sa_token(cluster) -> str:
    req = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    return cluster.api("POST", f"/api/v1/namespaces/{NS}/serviceaccounts/{SA}/token", req)["status"]["token"]


def token_kubeconfig(cluster, token: str, path: Path) -> Path:
    kc = json.loads(cluster.kubeconfig.read_text())
    kc["users"] = [{"name": "admin", "user": {"token": token}}]
    path.write_text(json.dumps(kc))
    return path


def test_install_creates_a_running_operator_deployment_and_the_crd(release):
    status = json.loads(helm(release, "status", RELEASE, "-n", NS, "-o", "json"))
    assert status["info"]["status"] == "deployed"
    dep = release.api("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/{SA}")
    assert dep["status"].get("availableReplicas") == 1  # a KWOK node runs its pod
    crd = release.api("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{PLURAL}.{GROUP}")
    assert crd["spec"]["names"]["shortNames"] == ["stj"]


def test_operator_with_the_charts_identity_reconciles_a_job(release, tmp_path):
    kubeconfig = token_kubeconfig(release, sa_token(release), tmp_path / "sa.kubeconfig")
    op = OperatorProcess(kubeconfig, tmp_path / "op.log", NAMESPACES=JOBS_NS, RESTART_GRACE_SECONDS="0",
                         LEASE_NAME=SA, LEASE_NAMESPACE=NS, PROGRESS_WRITE_SECONDS="0").start()  # fmt: skip
    try:
        body = make_job("rbac").nodes(2).gpus(2).obj()
        body["metadata"] = {"name": "rbac"}
        release.api("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}", body)

        def running():
            job = release.api("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}/rbac")
            return (job.get("status") or {}).get("phase") == "Running"

        wait_for(running, timeout=60, what="job Running under the chart's RBAC")
        pods = release.api("GET", f"/api/v1/namespaces/{JOBS_NS}/pods")["items"]
        assert sorted(p["metadata"]["name"] for p in pods) == ["rbac-0", "rbac-1", "rbac-rdzv"]
        pods = [p for p in pods if p["metadata"]["name"] != "rbac-rdzv"]
        lease = release.api("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{SA}")
        assert lease["spec"]["holderIdentity"]  # the Lease RBAC is enough to elect itself
        # A progress report: verified with a TokenReview and written into status, under the chart's RBAC.
        from kubernetes import client, config

        core = client.CoreV1Api(config.new_client_from_config(config_file=str(release.kubeconfig)))
        pod = core.read_namespaced_pod(pods[0]["metadata"]["name"], JOBS_NS)
        job = release.api("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}/rbac")
        report = {"uid": job["metadata"]["uid"], "namespace": JOBS_NS, "name": "rbac", "attempt": 1, "run": "r",
                  "step": 3, "updatedAt": "2026-01-01T00:00:00Z"}  # fmt: skip
        assert post(op, report, mint(core, JOBS_NS, pod))[0] == 200
        wait_for(
            lambda: (
                release.api("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}/rbac")
                .get("status", {})
                .get("progress", {})
                .get("step")
                == 3
            ),
            what="progress under the chart's RBAC",
        )
        # No request of the operator was refused.
        assert not REFUSED.search(op.log.read_text()), op.log.read_text()[-3000:]
    finally:
        op.stop()


@pytest.mark.parametrize(
    "read",
    [
        lambda core: core.list_namespaced_secret(JOBS_NS),
        lambda core: core.list_namespaced_secret(NS),
        lambda core: core.list_secret_for_all_namespaces(),
        lambda core: core.list_namespaced_pod("kube-system"),  # outside the watched namespace
    ],
    ids=["secrets-in-watched-namespace", "secrets-in-own-namespace", "secrets-everywhere", "pods-elsewhere"],
)
def test_the_same_identity_cannot_read_secrets_or_other_namespaces(release, tmp_path, read):
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    kubeconfig = token_kubeconfig(release, sa_token(release), tmp_path / "sa.kubeconfig")
    core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    with pytest.raises(ApiException) as exc:
        read(core)
    assert exc.value.status == 403


def test_the_operator_image_serves_healthz_and_reconciles_with_the_charts_token(release, images, tmp_path):
    """The image built from operator/Dockerfile, as the chart runs it: in-cluster credentials from the
    ServiceAccount token mounted where the kubelet mounts it, non-root (the image's uid 65532)."""
    secrets = tmp_path / "serviceaccount"
    secrets.mkdir()
    (secrets / "token").write_text(sa_token(release))
    (secrets / "ca.crt").write_bytes((release.workdir / "pki" / "ca.crt").read_bytes())
    (secrets / "namespace").write_text(NS)
    for f in [secrets, *secrets.iterdir()]:
        f.chmod(0o755 if f.is_dir() else 0o644)
    server = urllib.parse.urlsplit(json.loads(release.kubeconfig.read_text())["clusters"][0]["cluster"]["server"])
    port = localcluster.free_port()
    env = {"KUBERNETES_SERVICE_HOST": server.hostname, "KUBERNETES_SERVICE_PORT": str(server.port),
           "SHARDED_OPERATOR_HTTP_HOST": "127.0.0.1", "SHARDED_OPERATOR_HTTP_PORT": str(port),
           "SHARDED_OPERATOR_PROGRESS_PORT": str(localcluster.free_port()), "SHARDED_OPERATOR_NAMESPACES": JOBS_NS,
           "SHARDED_OPERATOR_LEASE_NAME": SA, "SHARDED_OPERATOR_LEASE_NAMESPACE": NS}  # fmt: skip
    name = f"sharded-operator-{port}"
    # The host's network: the control plane listens on loopback only.
    subprocess.run(["docker", "run", "-d", "--name", name, "--network", "host",
                    "-v", f"{secrets}:/var/run/secrets/kubernetes.io/serviceaccount:ro",
                    *(a for k, v in env.items() for a in ("-e", f"{k}={v}")), images["operator"]],
                   check=True, capture_output=True)  # fmt: skip
    try:

        def healthy():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        def logs() -> str:
            out = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
            return (out.stdout + out.stderr)[-3000:]

        if not wait_for(lambda: healthy() or subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name],
                                                           capture_output=True, text=True).stdout.strip() != "true",
                        timeout=60, what="the operator image's /healthz") or not healthy():  # fmt: skip
            pytest.fail(f"the operator container exited:\n{logs()}")
        user = subprocess.run(["docker", "exec", name, "id", "-u"], capture_output=True, text=True, check=True)
        assert user.stdout.strip() == "65532"
        body = make_job("in-image").nodes(2).gpus(2).obj()
        body["metadata"] = {"name": "in-image"}
        release.api("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}", body)
        wait_for(
            lambda: (
                (
                    release.api("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}/in-image").get("status")
                    or {}
                ).get("phase")
                == "Running"
            ),
            timeout=60,
            what="job Running",
        )
        # Deleted while the operator runs: it releases its finalizer.
        release.api("DELETE", f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}/in-image")
        jobs = f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}"
        wait_for(lambda: not any(j["metadata"]["name"] == "in-image" for j in release.api("GET", jobs)["items"]),
                 timeout=60, what="job deleted")  # fmt: skip
        assert not REFUSED.search(logs()), logs()
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_helm_upgrade_upgrades_the_crd_and_uninstall_keeps_it_with_the_jobs(release, tmp_path):
    """The CRD is a template: a newer chart's CRD reaches the API server on `helm upgrade` (a crds/ folder
    would be skipped), and `helm uninstall` leaves it, and so every job, in place. Runs last in this module."""
    import shutil

    import yaml

    newer = tmp_path / "chart"
    shutil.copytree(CHART, newer)
    [crd_file] = (newer / "files" / "crds").glob("*.yaml")
    crd = yaml.safe_load(crd_file.read_text())
    column = {"name": "Image", "type": "string", "jsonPath": ".spec.image", "priority": 1}
    crd["spec"]["versions"][0]["additionalPrinterColumns"].append(column)
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))
    helm(release, "upgrade", RELEASE, str(newer), "-n", NS, "--reuse-values", "--wait", "--timeout", "120s")
    path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{PLURAL}.{GROUP}"
    live = release.api("GET", path)
    assert column in live["spec"]["versions"][0]["additionalPrinterColumns"]
    assert live["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE  # the release owns it

    jobs = f"/apis/{GROUP}/{VERSION}/namespaces/{JOBS_NS}/{PLURAL}"

    def served_jobs():  # the API server answers 429 for a moment while it swaps in the updated CRD's storage
        try:
            return release.api("GET", jobs)["items"]
        except urllib.error.HTTPError as e:
            if e.code != 429:
                raise
            return None

    assert wait_for(served_jobs, timeout=30, what="jobs served"), "an earlier test left a job to outlive the release"
    helm(release, "uninstall", RELEASE, "-n", NS, "--wait")
    assert release.api("GET", path)["metadata"]["name"] == f"{PLURAL}.{GROUP}"
    assert wait_for(served_jobs, timeout=30, what="jobs served")
