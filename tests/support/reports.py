"""Posting progress reports as a training pod does: a token bound to the pod, minted by TokenRequest (the
test plays the kubelet), sent as a Bearer token to the operator's /progress."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from sharded_operator.settings import OperatorSettings

AUDIENCE = OperatorSettings().progress_audience


def mint(core, namespace: str, pod, audience: str = AUDIENCE) -> str:
    """A token bound to `pod`, for `audience`, as the kubelet mints it into the pod's projected volume."""
    body = {"spec": {"audiences": [audience], "expirationSeconds": 600,
                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod.metadata.name,
                                        "uid": pod.metadata.uid}}}  # fmt: skip
    return core.create_namespaced_service_account_token("default", namespace, body).status.token


def post(operator, body: bytes | dict, token: str | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(operator.progress_url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
