"""The one factory of ShardedTrainingJob objects, for the tests and the benchmarks alike: a fluent builder,
make_job("j").nodes(4).gpus(8).obj(), and the small CPU job the local stack trains end to end
(`local_cpu_job`)."""

from __future__ import annotations

import copy
from typing import Any

from sharded_operator.api.models import GROUP, KIND, VERSION, ShardedTrainingJob
from support.manifests import mutate


class JobBuilder:
    def __init__(self, name: str, namespace: str = "default"):
        self._obj: dict[str, Any] = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1},
            "spec": {"image": "trainer:test", "nodes": 2, "trainer": {"steps": 10}},
        }

    def _set(self, path: str, value: Any) -> JobBuilder:
        self._obj = mutate(self._obj, {f"spec.{path}": value})
        return self

    def nodes(self, n: int) -> JobBuilder:
        return self._set("nodes", n)

    def gpus(self, n: int) -> JobBuilder:
        return self._set("resources.gpusPerNode", n)

    def procs(self, n: int | str) -> JobBuilder:
        return self._set("procsPerNode", n)

    def strategy(self, kind: str) -> JobBuilder:
        return self._set("strategy.type", kind)

    def spec(self, path: str, value: Any) -> JobBuilder:
        return self._set(path, value)

    def status(self, **fields: Any) -> JobBuilder:
        self._obj.setdefault("status", {}).update(fields)
        return self

    def image(self, image: str) -> JobBuilder:
        return self._set("image", image)

    def steps(self, n: int) -> JobBuilder:
        return self._set("trainer.steps", n)

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj)

    def manifest(self) -> dict[str, Any]:
        """The object as a user submits it: its name only in metadata (the API server assigns the rest)."""
        body = self.obj()
        body["metadata"] = {"name": body["metadata"]["name"]}
        body.pop("status", None)
        return body

    def model(self) -> ShardedTrainingJob:
        return ShardedTrainingJob.model_validate(self.obj())


def make_job(name: str = "j", namespace: str = "default") -> JobBuilder:
    return JobBuilder(name, namespace)


# The image `hack/images.py` builds, which the local stack's nodes run (as processes, or as containers).
LOCAL_IMAGE = "sharded-training/trainer:0.1.0"


def local_cpu_job(name: str, strategy: str = "fsdp", steps: int = 30) -> JobBuilder:
    """A job the local stack trains in seconds on CPU: 2 nodes x 2 processes of the tiny preset, gloo, a 1Gi
    checkpoint claim written every 10 steps."""
    b = make_job(name).image(LOCAL_IMAGE).nodes(2).procs(2).strategy(strategy)
    b = b.spec("trainer", {
        "model": {"preset": "tiny"}, "steps": steps, "microBatchSize": 4, "seqLen": 64, "precision": "fp32",
        "optimizer": {"lr": 0.01}, "logEvery": 2,
    })  # fmt: skip
    b = b.spec("resources", {"cpu": 1, "memory": "2Gi"})
    b = b.spec("checkpoint", {"volumeClaim": {"size": "1Gi"}, "interval": 10, "keepLast": 5})
    return b.spec("failurePolicy", {"backoffLimit": 2})
