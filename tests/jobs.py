"""A fluent builder of ShardedTrainingJob objects for tests: make_job("j").nodes(4).gpus(8).obj()."""

from __future__ import annotations

import copy
from typing import Any

from manifests import mutate
from sharded_operator.api.models import GROUP, KIND, VERSION, ShardedTrainingJob


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

    def obj(self) -> dict[str, Any]:
        return copy.deepcopy(self._obj)

    def model(self) -> ShardedTrainingJob:
        return ShardedTrainingJob.model_validate(self.obj())


def make_job(name: str = "j", namespace: str = "default") -> JobBuilder:
    return JobBuilder(name, namespace)
