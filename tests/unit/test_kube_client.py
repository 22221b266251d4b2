"""The operator's API client: its connection pool is sized for the threads that send requests."""

from __future__ import annotations

import json

from sharded_operator.k8s import Kube


def test_the_client_keeps_a_connection_for_each_thread_that_may_send(tmp_path, monkeypatch):
    # Past the pool's size each request's connection is dropped and the next pays for a TLS handshake.
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    assert Kube.connect(str(kubeconfig), connections=41).api_client.rest_client.pool_manager.connection_pool_kw[
        "maxsize"] == 41  # fmt: skip
    assert Kube.connect(str(kubeconfig)).api_client.configuration.connection_pool_maxsize >= 5
