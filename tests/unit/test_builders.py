"""Pod wiring: the rendezvous contract, GPUs, /dev/shm, InfiniBand, scheduling, storage."""

from __future__ import annotations

import pytest
import yaml

from sharded_api.config import TrainerConfig
from sharded_api.contract import PodEnv
from sharded_operator.api.models import LABEL_ATTEMPT, LABEL_INDEX, LABEL_JOB, LABEL_ROLE
from sharded_operator.render import children, podgroup, podspec, rendezvous
from sharded_operator.settings import OperatorSettings
from support.jobs import make_job

SETTINGS = OperatorSettings(progress_url="http://op:8080/progress")


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def test_rendezvous_contract_for_a_gpu_job():
    job = make_job("llm", "team").nodes(4).gpus(8).model()
    pod = podspec.build_pod(job, 2, attempt=3, settings=SETTINGS)
    env = env_of(pod)
    assert env["PET_NNODES"] == "4"
    assert env["PET_NPROC_PER_NODE"] == "8"  # auto = GPUs per node
    assert env["PET_NODE_RANK"] == "2"
    assert env["PET_RDZV_BACKEND"] == "c10d"
    assert env["PET_RDZV_ENDPOINT"] == "llm-rdzv.llm.team.svc:29400"  # the store pod, not a training pod
    assert env["PET_RDZV_ID"] == "uid-llm-3"  # a fresh rendezvous per attempt
    conf = dict(kv.split("=") for kv in env["PET_RDZV_CONF"].split(","))
    assert conf == {"is_host": "false", "join_timeout": "900", "last_call_timeout": "5", "keep_alive_interval": "2",
                    "keep_alive_max_attempt": "3"}  # fmt: skip
    assert env["MASTER_ADDR"] == "llm-0.llm.team.svc" and env["MASTER_PORT"] == "29400"
    assert env["PET_MAX_RESTARTS"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert pod["metadata"]["name"] == "llm-2"
    assert pod["spec"]["hostname"] == "llm-2" and pod["spec"]["subdomain"] == "llm"
    assert pod["spec"]["restartPolicy"] == "Never"
    res = pod["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "8" == res["requests"]["nvidia.com/gpu"]
    labels = pod["metadata"]["labels"]
    assert labels[LABEL_JOB] == "llm" and labels[LABEL_INDEX] == "2"
    assert labels[LABEL_ATTEMPT] == "3"
    assert env["SHARDED_PROGRESS_URL"] == "http://op:8080/progress"


def test_the_rendezvous_store_pod_is_small_restricted_and_runs_where_the_job_may():
    job = (
        make_job("llm", "team").nodes(4).gpus(8).spec("scheduling.tolerations", [{"key": "gpu", "operator": "Exists"}])
        .spec("scheduling.nodeSelector", {"pool": "h200"}).spec("scheduling.queueName", "team-a")
        .spec("pod.labels", {"app": "llm"}).model()
    )  # fmt: skip
    pod = podspec.build_store_pod(job, SETTINGS)
    spec, [container] = pod["spec"], pod["spec"]["containers"]
    assert pod["metadata"]["name"] == spec["hostname"] == "llm-rdzv" and spec["subdomain"] == "llm"
    labels = pod["metadata"]["labels"]
    assert labels[LABEL_JOB] == "llm" and labels[LABEL_ROLE] == "rendezvous"
    # no node index (it is not a training pod), no attempt (it serves them all), no Kueue queue or gang
    assert LABEL_INDEX not in labels and LABEL_ATTEMPT not in labels and labels["app"] == "llm"
    assert not any(k.startswith("kueue.x-k8s.io") for k in labels) and "schedulerName" not in spec
    assert container["command"] == ["python", "-m", "sharded_trainer.store", "--port", "29400"]
    assert container["resources"]["requests"] == container["resources"]["limits"] == {"cpu": "250m", "memory": "1Gi"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["automountServiceAccountToken"] is False and spec["restartPolicy"] == "Never"
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}] and spec["nodeSelector"] == {"pool": "h200"}
    assert rendezvous.build_service(job)["spec"]["selector"].items() <= labels.items()  # its DNS name resolves


def test_cpu_job_falls_back_to_gloo_and_hides_gpus():
    job = make_job().model()
    env = env_of(podspec.build_pod(job, 0, 1, SETTINGS))
    assert env["PET_NPROC_PER_NODE"] == str(SETTINGS.cpu_procs_per_node)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert children.backend(job.spec) == "gloo"
    assert children.trainer_config(job.spec).backend == "gloo"
    assert children.backend(make_job().gpus(1).model().spec) == "nccl"


@pytest.mark.parametrize(
    "memory,shm,expected",
    [(None, None, str(2 * 2**30)), ("64Gi", None, str(32 * 2**30)), ("64Gi", "8Gi", "8Gi"), (None, "1G", "1G")],
)
def test_dev_shm_is_a_memory_backed_empty_dir(memory, shm, expected):
    b = make_job()
    if memory:
        b.spec("resources.memory", memory)
    if shm:
        b.spec("shmSize", shm)
    pod = podspec.build_pod(b.model(), 0, 1, SETTINGS)
    dshm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": expected}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["spec"]["containers"][0]["volumeMounts"]


def test_infiniband_profile():
    job = (
        make_job().gpus(8)
        .spec("network.infiniband", {"enabled": True, "hcas": "mlx5_0,mlx5_1", "gidIndex": 3, "resourceCount": 4})
        .spec("network.socketInterface", "eth0")
        .model()
    )  # fmt: skip
    pod = podspec.build_pod(job, 0, 1, SETTINGS)
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"]["rdma/ib"] == "4"
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    env = env_of(pod)
    assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1" and env["NCCL_IB_GID_INDEX"] == "3"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" == env["GLOO_SOCKET_IFNAME"]


def test_host_network_binds_the_jobs_own_port_and_declares_it():
    a = make_job("a").gpus(8).spec("network.hostNetwork", True).status(hostPort=29517).model()
    pod = podspec.build_pod(a, 0, 1, SETTINGS)
    assert pod["spec"]["hostNetwork"] is True and pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["spec"]["containers"][0]["ports"] == [{"name": "rendezvous", "containerPort": 29517, "hostPort": 29517}]
    assert env_of(pod)["MASTER_PORT"] == "29517" and env_of(pod)["PET_RDZV_ENDPOINT"].endswith(":29517")
    assert rendezvous.build_service(a)["spec"]["ports"][0]["port"] == 29517
    plain = podspec.build_pod(make_job("b").model(), 0, 1, SETTINGS)
    assert "hostPort" not in plain["spec"]["containers"][0]["ports"][0]


def test_each_host_network_job_gets_a_port_no_other_active_one_holds():
    ports = (29500, 29503)
    first = rendezvous.choose_host_port("uid-a", ports, set())
    assert 29500 <= first <= 29503
    taken = {first}
    for uid in ("uid-b", "uid-c", "uid-d"):
        port = rendezvous.choose_host_port(uid, ports, taken)
        assert port not in taken and 29500 <= port <= 29503
        taken.add(port)
    assert taken == {29500, 29501, 29502, 29503}
    assert rendezvous.choose_host_port("uid-e", ports, taken) in taken  # all held: the declared port keeps them apart


@pytest.mark.parametrize("bad", ["40000-40100", "100-200", "30000-29000"])
def test_the_host_port_range_stays_below_the_ephemeral_ports(bad):
    with pytest.raises(ValueError, match="ephemeral"):
        OperatorSettings(host_port_range=bad)


def test_elastic_job_passes_a_node_range_and_restarts_to_torchrun():
    job = make_job().nodes(3).spec("elastic", {"minNodes": 2, "maxNodes": 4, "maxRestarts": 5}).model()
    env = env_of(podspec.build_pod(job, 0, 1, SETTINGS))
    assert env["PET_NNODES"] == "2:4" and env["PET_MAX_RESTARTS"] == "5"


def test_an_elastic_job_keeps_the_batch_of_its_full_size_unless_told_otherwise():
    """elastic.keepGlobalBatch (default): the trainer is told to keep maxNodes' batch; an explicit
    trainer.globalBatchSize, or keepGlobalBatch false, leaves it alone; a fixed-size job keeps nothing."""
    elastic = {"minNodes": 2, "maxNodes": 4}
    assert children.trainer_config(make_job().nodes(3).spec("elastic", elastic).model().spec).batch_nodes == 4
    off = make_job().nodes(3).spec("elastic", {**elastic, "keepGlobalBatch": False}).model()
    assert children.trainer_config(off.spec).batch_nodes is None
    assert children.trainer_config(make_job().nodes(3).model().spec).batch_nodes is None


@pytest.mark.parametrize("value", ["yes", 2, None, [True]])
def test_keep_global_batch_takes_only_a_boolean(value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"keepGlobalBatch|keep_global_batch"):
        make_job().nodes(3).spec("elastic", {"minNodes": 2, "maxNodes": 4, "keepGlobalBatch": value}).model()


def test_in_place_restarts_reach_torchrun_and_elastic_keeps_its_own():
    job = make_job().nodes(2).spec("failurePolicy", {"inPlaceRestarts": 3}).model()
    assert env_of(podspec.build_pod(job, 0, 1, SETTINGS))["PET_MAX_RESTARTS"] == "3"
    both = make_job().nodes(3).spec("failurePolicy", {"inPlaceRestarts": 3})
    both = both.spec("elastic", {"minNodes": 2, "maxNodes": 4, "maxRestarts": 5}).model()
    assert env_of(podspec.build_pod(both, 0, 1, SETTINGS))["PET_MAX_RESTARTS"] == "5"


def test_scheduling_knobs_kueue_and_volcano_gang():
    job = (
        make_job().nodes(4)
        .spec("scheduling", {
            "nodeSelector": {"pool": "h200"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
            "priorityClassName": "high", "queueName": "team-a", "gang": {"enabled": True, "provider": "volcano"},
        })
        .model()
    )  # fmt: skip
    pod = podspec.build_pod(job, 0, 1, SETTINGS)
    assert pod["spec"]["nodeSelector"] == {"pool": "h200"}
    assert pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    # The gang is one Kueue workload: a pod group per attempt, with the count Kueue waits for.
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"].startswith(f"{job.metadata['name']}-")
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == str(job.spec.nodes)
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "j"
    group = podgroup.build_pod_group(job)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["spec"]["minMember"] == 4


def test_scheduler_plugins_gang():
    job = make_job().nodes(3).gpus(8).spec("scheduling", {"gang": {"enabled": True}}).model()
    pod = podspec.build_pod(job, 0, 1, SETTINGS)
    assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "j"
    group = podgroup.build_pod_group(job)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"]["minMember"] == 3 and group["spec"]["scheduleTimeoutSeconds"] == 300
    assert group["spec"]["minResources"]["nvidia.com/gpu"] == "24"
    assert podgroup.build_pod_group(make_job().model()) is None


def test_the_gangs_minimum_is_the_sum_of_its_members_requests():
    job = (
        make_job().nodes(2).gpus(4)
        .spec("resources.cpu", "1500m").spec("resources.memory", "64Gi")
        .spec("network.infiniband", {"enabled": True, "resourceCount": 2})
        .spec("scheduling", {"gang": {"enabled": True, "provider": "volcano", "queue": "research"}})
        .model()
    )  # fmt: skip
    group = podgroup.build_pod_group(job)
    assert group["spec"]["minResources"] == {
        "cpu": "3", "memory": str(128 * 2**30), "nvidia.com/gpu": "8", "rdma/ib": "4",
    }  # fmt: skip
    assert group["spec"]["queue"] == "research"
    pod = podspec.build_pod(job, 0, 1, SETTINGS)
    assert pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "1500m"  # the pod keeps its spelling


def test_an_elastic_gang_waits_only_for_min_nodes():
    for provider in ("volcano", "scheduler-plugins"):
        job = (
            make_job().nodes(3).spec("elastic", {"minNodes": 2, "maxNodes": 4}).gpus(8)
            .spec("scheduling", {"gang": {"enabled": True, "provider": provider}})
            .model()
        )  # fmt: skip
        group = podgroup.build_pod_group(job)
        assert group["spec"]["minMember"] == 2, provider
        assert group["spec"]["minResources"]["nvidia.com/gpu"] == "16", provider


def test_a_pod_group_drifts_only_in_the_fields_the_job_sets():
    job = make_job().nodes(3).spec("scheduling", {"gang": {"enabled": True, "provider": "volcano"}}).model()
    want = podgroup.build_pod_group(job)
    same = {"spec": {**want["spec"], "queue": "default"}, "status": {"phase": "Running"}}  # the scheduler's queue
    assert podgroup.drift(want, same) == {}
    smaller = {"spec": {**want["spec"], "minMember": 2}}
    assert podgroup.drift(want, smaller) == {"minMember": 3}
    assert podgroup.drift(want, {}) == want["spec"]


def test_checkpoint_claim_is_mounted_and_configured():
    job = make_job("run").spec("checkpoint", {"volumeClaim": {"size": "5Gi"}, "interval": 7, "keepLast": 2}).model()
    pod = podspec.build_pod(job, 1, 1, SETTINGS)
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "checkpoints")
    assert vol["persistentVolumeClaim"]["claimName"] == "run-checkpoints"
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "checkpoints")
    assert mount == {"name": "checkpoints", "mountPath": "/checkpoints", "subPath": "run"}
    pvc = children.build_pvc(job)
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    cfg = TrainerConfig.model_validate(yaml.safe_load(children.build_config_map(job, SETTINGS)["data"]["trainer.yaml"]))
    assert cfg.checkpoint.dir == "/checkpoints" and cfg.checkpoint.interval == 7 and cfg.checkpoint.keep_last == 2
    existing = make_job().spec("checkpoint", {"existingClaim": "mine"}).model()
    assert children.build_pvc(existing) is None


def test_user_env_volumes_and_custom_command():
    job = (
        make_job()
        .spec("pod", {"env": [{"name": "HF_HOME", "value": "/cache"}], "serviceAccountName": "trainer",
                      "volumes": [{"name": "data", "emptyDir": {}}],
                      "volumeMounts": [{"name": "data", "mountPath": "/data"}]})
        .spec("command", ["train.py", "--lr", "1e-4"])
        .model()
    )  # fmt: skip
    pod = podspec.build_pod(job, 0, 1, SETTINGS)
    c = pod["spec"]["containers"][0]
    assert env_of(pod)["HF_HOME"] == "/cache"
    assert c["command"][-4:] == ["--", "train.py", "--lr", "1e-4"]
    assert pod["spec"]["serviceAccountName"] == "trainer"
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]


def test_an_interactive_job_runs_the_session_with_the_training_pods_environment_and_volumes():
    claim = {"volumeClaim": {"size": "1Gi"}, "mountPath": "/ckpt"}
    job = make_job().spec("interactive", {"port": 9999}).spec("checkpoint", claim).model()
    training = podspec.build_pod(make_job().spec("checkpoint", claim).model(), 1, 1, SETTINGS)
    pod = podspec.build_pod(job, 1, 1, SETTINGS)
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "sharded_trainer.interactive", "--config", SETTINGS.trainer_config_path,
                            "--port", "9999", "--root-dir", "/ckpt"]  # fmt: skip
    # Everything a run by hand needs is as a training pod has it: the rendezvous, the claim, the progress token.
    assert (
        c["env"] == training["spec"]["containers"][0]["env"]
        and c["volumeMounts"] == training["spec"]["containers"][0]["volumeMounts"]
    )
    assert env_of(pod)[PodEnv.NODE_RANK] == "1"
    without_claim = make_job().spec("interactive", {}).model()
    assert "--root-dir" not in podspec.build_pod(without_claim, 0, 1, SETTINGS)["spec"]["containers"][0]["command"]


def test_headless_service_publishes_not_ready_addresses():
    svc = rendezvous.build_service(make_job("x").model())
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {LABEL_JOB: "x"}


def test_the_final_checkpoint_gets_the_jobs_own_grace_period():
    default = podspec.build_pod(make_job("llm").model(), 0, 1, SETTINGS)
    assert default["spec"]["terminationGracePeriodSeconds"] == SETTINGS.suspend_grace_seconds
    own = make_job("llm").spec("runPolicy.terminationGraceSeconds", 900).model()
    assert podspec.build_pod(own, 0, 1, SETTINGS)["spec"]["terminationGracePeriodSeconds"] == 900


def test_a_spec_edit_reaches_the_next_attempts_pods_only():
    """Each attempt's pods mount the config they were created with: the name carries the config's hash."""
    job = make_job("llm").model()
    edited = make_job("llm").spec("trainer.steps", 999).model()
    before, after = children.config_map_name(job), children.config_map_name(edited)
    assert before.startswith("llm-config-") and before != after
    assert children.config_map_name(make_job("llm").spec("runPolicy.suspend", True).model()) == before
    pod = podspec.build_pod(edited, 0, 2, SETTINGS)
    assert {"name": "trainer-config", "configMap": {"name": after}} in pod["spec"]["volumes"]
    assert children.build_config_map(edited, SETTINGS)["metadata"]["name"] == after


def test_pods_pass_pod_security_restricted_by_default():
    pod = podspec.build_pod(make_job().model(), 0, 1, SETTINGS)
    spec, c = pod["spec"], pod["spec"]["containers"][0]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 1000
    assert spec["securityContext"]["fsGroup"] == 1000  # the checkpoint claim is writable through the group
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert spec["automountServiceAccountToken"] is False and "hostNetwork" not in spec


def test_pods_prove_themselves_to_the_operator_with_a_projected_token_for_its_audience_only():
    pod = podspec.build_pod(make_job().model(), 0, 1, SETTINGS)
    [volume] = [v for v in pod["spec"]["volumes"] if "projected" in v]
    [source] = volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == SETTINGS.progress_audience
    assert source["serviceAccountToken"]["expirationSeconds"] == SETTINGS.token_seconds
    [mount] = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    token_file = f"{mount['mountPath']}/{source['serviceAccountToken']['path']}"
    assert env_of(pod)[PodEnv.PROGRESS_TOKEN_FILE.value] == token_file
    # Without a progress URL there is nothing to prove: no token at all.
    bare = podspec.build_pod(make_job().model(), 0, 1, OperatorSettings())
    assert not [v for v in bare["spec"]["volumes"] if "projected" in v]


def test_requests_and_limits_may_differ_and_a_limit_below_its_request_is_refused():
    job = make_job().spec("resources", {"cpu": 8, "cpuLimit": 16, "memory": "32Gi", "memoryLimit": "48Gi"}).model()
    res = podspec.build_pod(job, 0, 1, SETTINGS)["spec"]["containers"][0]["resources"]
    assert res["requests"] == {"cpu": "8", "memory": "32Gi"} and res["limits"] == {"cpu": "16", "memory": "48Gi"}
    same = podspec.build_pod(make_job().spec("resources", {"cpu": 8}).model(), 0, 1, SETTINGS)
    assert same["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "8"}, "limits": {"cpu": "8"}}
    with pytest.raises(ValueError, match="memoryLimit must be at least memory"):
        make_job().spec("resources", {"memory": "2e12", "memoryLimit": "999Gi"}).model()  # any form, in Python


def test_pull_secrets_runtime_class_init_containers_and_native_sidecars():
    job = (
        make_job()
        .spec("pod.imagePullSecrets", ["regcred"])
        .spec("pod.runtimeClassName", "nvidia")
        .spec("pod.initContainers", [{"name": "fetch", "image": "busybox", "command": ["sh", "-c", "true"]}])
        .spec("pod.sidecars", [{"name": "ship", "image": "fluent-bit", "securityContext": {"runAsUser": 0}}])
        .model()
    )
    spec = podspec.build_pod(job, 0, 1, SETTINGS)["spec"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["runtimeClassName"] == "nvidia"
    fetch, ship = spec["initContainers"]
    # Passed on as written, with the trainer's restricted securityContext unless it brings its own.
    assert fetch["command"] == ["sh", "-c", "true"] and "restartPolicy" not in fetch
    assert fetch["securityContext"] == spec["containers"][0]["securityContext"]
    assert ship["restartPolicy"] == "Always" and ship["securityContext"] == {"runAsUser": 0}
    assert [c["name"] for c in spec["containers"]] == ["trainer"]
    plain = podspec.build_pod(make_job().model(), 0, 1, SETTINGS)["spec"]
    assert not {"initContainers", "imagePullSecrets", "runtimeClassName"} & set(plain)


def test_an_export_pod_is_a_training_pod_without_devices_or_rendezvous():
    from sharded_operator.render.export_pod import LABEL_EXPORT, ExportError, export_pod, location

    job = make_job("llm", "team").nodes(2).gpus(8).spec("checkpoint", {"volumeClaim": {"size": "1Ti"}}).spec(
        "resources.memory", "64Gi").spec("scheduling.nodeSelector", {"pool": "h200"}).model()  # fmt: skip
    training = podspec.build_pod(job, 0, 3, SETTINGS)
    pod = export_pod(job, training, 40, suffix="40-abcde")
    [c] = pod["spec"]["containers"]
    root = job.spec.checkpoint.mount_path
    assert c["command"][:4] == ["python", "-m", "sharded_trainer", "export"]
    assert c["command"][c["command"].index("--checkpoint") + 1] == f"{root}/step-00000040"
    assert c["command"][c["command"].index("--out") + 1] == f"{root}/exports/step-00000040.safetensors"
    assert c["resources"] == {"requests": {"memory": "64Gi"}, "limits": {"memory": "64Gi"}}  # no GPU
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"trainer-config", "checkpoints"}
    assert pod["spec"]["securityContext"] == training["spec"]["securityContext"]
    assert pod["spec"]["nodeSelector"] == {"pool": "h200"} and "hostname" not in pod["spec"]
    # Never one of the job's training pods to the operator, yet garbage-collected with the job.
    assert LABEL_JOB not in pod["metadata"]["labels"] and pod["metadata"]["labels"][LABEL_EXPORT] == "llm"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == job.metadata["uid"]
    assert location(pod, 40) == "llm-checkpoints:llm/exports/step-00000040.safetensors"
    bare = make_job("bare").model()
    with pytest.raises(ExportError, match="no checkpoint storage"):
        export_pod(bare, podspec.build_pod(bare, 0, 1, SETTINGS), 10, suffix="x")


def test_a_hugging_face_export_pod_mounts_the_model_again_and_writes_a_directory():
    from sharded_operator.render.export_pod import export_pod, location

    models = {"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    job = make_job("ft", "team").spec("checkpoint", {"volumeClaim": {"size": "1Ti"}}).spec(
        "trainer.model", {"huggingface": {"path": "/models/qwen"}}).spec("pod.volumes", [models]).spec(
        "pod.volumeMounts", [{"name": "models", "mountPath": "/models", "readOnly": True}]).model()  # fmt: skip
    pod = export_pod(job, podspec.build_pod(job, 0, 1, SETTINGS), 40, suffix="40-abcde")
    [c] = pod["spec"]["containers"]
    root = job.spec.checkpoint.mount_path
    assert c["command"][c["command"].index("--out") + 1] == f"{root}/exports/step-00000040"
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"trainer-config", "checkpoints", "models"}
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    assert location(pod, 40) == "ft-checkpoints:ft/exports/step-00000040"


def test_the_pods_of_an_attempt_built_at_once_are_those_built_one_by_one():
    job = make_job("llm", "team").nodes(4).gpus(8).model()
    pods = podspec.build_pods(job, [3, 1], attempt=2, settings=SETTINGS)
    assert pods == [podspec.build_pod(job, i, attempt=2, settings=SETTINGS) for i in (3, 1)]
    edited = make_job("llm", "team").nodes(4).gpus(8).model()
    edited.spec.trainer.steps += 1  # another trainer config: another ConfigMap, named by its digest
    volumes = [{v["name"]: v for v in p["spec"]["volumes"]}["trainer-config"] for p in pods]
    assert volumes == [{"name": "trainer-config", "configMap": {"name": children.config_map_name(job)}}] * 2
    assert podspec.build_pods(edited, [0], 2, SETTINGS)[0]["spec"]["volumes"] != pods[0]["spec"]["volumes"]
