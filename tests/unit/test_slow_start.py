"""A job's pods are created in a few round trips, and a quota that refuses them costs few requests."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from sharded_operator.run import reconcile
from sharded_operator.run.apicalls import Refused
from sharded_operator.run.reconcile import SLOW_START_GROWTH, Context, _create_pods
from sharded_operator.settings import OperatorSettings


class QuotaKube:
    """Admits `quota` pods, refuses the rest (as a ResourceQuota does); records every request."""

    def __init__(self, quota: int):
        self.quota, self.sent, self.lock = quota, [], threading.Lock()

    def create(self, namespace, obj):
        with self.lock:
            self.sent.append(obj["metadata"]["name"])
            if len(self.sent) > self.quota:
                raise Refused("Pod", obj["metadata"]["name"], "Forbidden", "exceeded quota")
        return obj


def pods(n: int) -> list[dict]:
    return [{"kind": "Pod", "metadata": {"name": f"p{i}"}} for i in range(n)]


def test_a_gang_is_created_in_growing_batches_each_sent_at_once(monkeypatch):
    kube, sizes, send = QuotaKube(10_000), [], reconcile._send
    monkeypatch.setattr(reconcile, "_send", lambda ctx, ns, objs: sizes.append(len(objs)) or send(ctx, ns, objs))
    ctx = Context(settings=OperatorSettings(), kube=kube, creators=ThreadPoolExecutor(16))
    made = _create_pods(ctx, "ns", pods(1024))
    assert len(made) == 1024 and sorted(kube.sent) == sorted(p["metadata"]["name"] for p in pods(1024))
    assert sizes == [1, SLOW_START_GROWTH, SLOW_START_GROWTH**2, SLOW_START_GROWTH**3, 1024 - 585]  # 5 round trips


@pytest.mark.parametrize("quota", [0, 1, 5])
def test_a_quota_that_refuses_the_gang_costs_a_bounded_number_of_requests(quota):
    kube = QuotaKube(quota)
    ctx = Context(settings=OperatorSettings(), kube=kube, creators=ThreadPoolExecutor(16))
    with pytest.raises(Refused):
        _create_pods(ctx, "ns", pods(100))
    # The batch that met the quota is the last one sent: at most 1 + 8 requests for 100 pods.
    assert len(kube.sent) == (1 if quota == 0 else 1 + SLOW_START_GROWTH)
