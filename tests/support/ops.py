"""Small verbs over the API for readable integration tests: create a job, read its status, end its pods
the way KWOK's stages let a test end them."""

from __future__ import annotations

from conftest import wait_for
from sharded_operator.api.models import GROUP, LABEL_ATTEMPT, PLURAL, VERSION, training_pods


class Ops:
    """Small verbs over the API for readable tests."""

    def __init__(self, core, custom, namespace):
        self.core, self.custom, self.ns = core, custom, namespace

    def create(self, builder) -> dict:
        body = builder.obj()
        body["metadata"] = {"name": body["metadata"]["name"]}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)

    def job(self, name="j") -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def status(self, name="j") -> dict:
        return self.job(name).get("status") or {}

    def patch_spec(self, spec: dict, name="j") -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    def pods(self, name="j") -> list:
        return self.core.list_namespaced_pod(self.ns, label_selector=training_pods(name)).items

    def wait_phase(self, phase: str, name="j", timeout=60) -> dict:
        return wait_for(
            lambda: (s := self.status(name)).get("phase") == phase and s, timeout=timeout, what=f"phase {phase}"
        )

    def wait_running_attempt(self, attempt: int, nodes: int, name="j", timeout: float = 60) -> list:
        def ready():
            pods = [p for p in self.pods(name) if p.metadata.labels[LABEL_ATTEMPT] == str(attempt)]
            ok = len(pods) == nodes and all(p.status.phase == "Running" for p in pods)
            return ok and self.status(name).get("phase") == "Running" and pods

        try:
            return wait_for(ready, timeout=timeout, what=f"attempt {attempt} running")
        except BaseException:  # say what the pods and the job were doing
            seen = [(p.metadata.name, p.metadata.labels.get(LABEL_ATTEMPT), p.status.phase, p.spec.node_name,
                     [(c.type, c.status, c.reason, c.message) for c in p.status.conditions or []])
                    for p in self.pods(name)]  # fmt: skip
            print(f"pods: {seen}\njob status: {self.status(name)}")
            raise

    def exit(self, pod: str, code: int, reason: str | None = None) -> None:
        ann = {"kwok.sharded.dev/exit-code": str(code)}
        if reason:
            ann["kwok.sharded.dev/reason"] = reason
        self.core.patch_namespaced_pod(pod, self.ns, {"metadata": {"annotations": ann}})
