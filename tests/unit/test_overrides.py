"""The pod allowlist's Python side: each row's attacks leave it, its safe examples and a plain job stay inside.

The same examples go through the API server's admission policy in tests/integration/test_admission_policy.py,
so the CEL and the Python check are held to one table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sharded_operator.api import overrides
from sharded_operator.api.allowlist import Allow
from sharded_operator.api.overrides import NAMES, ROWS, PodOverride, forbidden, outside
from sharded_operator.render import podspec
from sharded_operator.settings import OperatorSettings
from support.jobs import make_job

CASES = [(row, example) for row in ROWS for example in row.risky]
SAFE = [(row, example) for row in ROWS for example in row.safe]


def ids(case) -> str:
    return f"{case[0].name}-{'+'.join(case[1])}"


def job_with(example: dict):
    job = make_job()
    for path, value in example.items():
        job = job.spec(path, value)
    return job.model()


def test_a_plain_job_and_the_infiniband_example_stay_inside_every_row():
    assert outside(make_job().model().spec, Allow()) == []
    ib = make_job().gpus(8).spec("network", {"infiniband": {"enabled": True}, "hostNetwork": True}).model()
    assert outside(ib.spec, Allow()) == []


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_each_attack_leaves_its_row_and_forbidPodOverrides_refuses_it_naming_the_field(case):
    row, example = case
    spec = job_with(example).spec
    assert outside(spec, Allow()) == [row]  # each example is an attack on its own row alone
    assert forbidden(spec, []) is None
    assert row.field in forbidden(spec, [row.name]), row.name
    assert forbidden(spec, [r.name for r in ROWS if r is not row]) is None


@pytest.mark.parametrize("case", SAFE, ids=ids)
def test_each_safe_example_stays_inside(case):
    _row, example = case
    assert outside(job_with(example).spec, Allow()) == []


def test_host_networking_comes_only_with_the_clusters_gpu_and_rdma_names():
    """The CPU pod with the host network and IPC_LOCK that `resourceName: cpu` once gave is outside the list."""
    ib = {"infiniband": {"enabled": True, "resourceName": "cpu"}, "hostNetwork": True}
    cpu = make_job().spec("resources", {"gpusPerNode": 1, "gpuResourceName": "cpu"}).spec("network", ib).model()
    assert {r.name for r in outside(cpu.spec, Allow())} == {"infiniband"}
    # Without GPUs at all the CRD's own rule refuses the profile; the row refuses it too, for a dump past it.
    no_gpu = make_job().spec("network.infiniband", {"enabled": True}).obj()["spec"]
    assert {r.name for r in outside(no_gpu, Allow())} == {"infiniband"}
    amd = make_job().spec("resources", {"gpusPerNode": 8, "gpuResourceName": "amd.com/gpu"})
    amd = amd.spec("network.infiniband", {"enabled": True}).model()
    assert {r.name for r in outside(amd.spec, Allow())} == {"infiniband"}
    assert outside(amd.spec, Allow(gpu_resources=("amd.com/gpu",))) == []
    # The operator renders that CPU pod only when the row is not forbidden: forbidPodOverrides closes it.
    assert "spec.network.infiniband" in forbidden(cpu.spec, ["infiniband"])


def test_annotation_prefixes_the_admin_lists_are_allowed():
    job = make_job().spec("pod.annotations", {"prometheus.io/scrape": "true"}).model()
    assert [r.name for r in outside(job.spec, Allow())] == ["annotations"]
    assert outside(job.spec, Allow(annotation_prefixes=("prometheus.io/",))) == []


def test_the_operator_reads_the_allowlist_from_its_settings():
    s = OperatorSettings.from_env({
        "SHARDED_OPERATOR_ANNOTATION_PREFIXES": "a/,b/", "SHARDED_OPERATOR_GPU_RESOURCE_NAMES": "x/gpu",
        "SHARDED_OPERATOR_RDMA_RESOURCE_NAMES": "x/ib", "SHARDED_OPERATOR_FORBID_POD_OVERRIDES": "volumes,hostPort",
    })  # fmt: skip
    assert s.allow == Allow(("a/", "b/"), ("x/gpu",), ("x/ib",))
    assert s.forbid_pod_overrides == ["volumes", "hostPort"]
    with pytest.raises(ValueError, match="hostPath"):
        OperatorSettings.from_env({"SHARDED_OPERATOR_FORBID_POD_OVERRIDES": "hostPath"})


def test_the_infiniband_pod_the_allowlist_admits_is_what_the_builder_renders():
    """The row names what the builder really grants: IPC_LOCK and the host network come with the profile."""
    job = make_job().gpus(8).spec("network", {"infiniband": {"enabled": True}, "hostNetwork": True}).model()
    pod = podspec.build_pod(job, 0, 1, OperatorSettings())
    assert pod["spec"]["hostNetwork"] is True
    assert "IPC_LOCK" in pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"]


def test_the_security_model_in_the_docs_lists_exactly_the_tables_rows():
    """docs/install.md shows the table as overrides.table() renders it: a row added or reworded is documented."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "install.md").read_text()
    assert overrides.table() in docs, (
        "paste sharded_operator.api.overrides.table() into docs/install.md's Security model"
    )


def test_every_named_pod_override_has_exactly_one_row():
    """The names the chart, the settings and the policy use are the enum's, each a row of the allowlist once."""
    assert sorted(NAMES) == sorted(PodOverride.__members__.values()) and len(set(NAMES)) == len(ROWS)
