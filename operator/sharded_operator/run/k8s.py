"""The only module that talks to the Kubernetes API server."""

from __future__ import annotations

import datetime as dt
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from sharded_operator.api.models import GROUP, KIND, PLURAL, VERSION, training_pods
from sharded_operator.api.status import FINISHED
from sharded_operator.run.apicalls import (
    Expired,
    Malformed,
    MissingAPI,
    Refused,
    Stale,
    Written,
    api_of,
    path,
    resource_of,
    retrying,
    stream_lines,
)
from sharded_operator.run.transport import ApiError, Transport, in_a_cluster, load

logger = logging.getLogger(__name__)

_JOBS = f"apis/{GROUP}/{VERSION}"
# The collection each kind of child is created in (a PodGroup's group and version come from the object).
_RESOURCES = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps",
              "PersistentVolumeClaim": "persistentvolumeclaims", "PodGroup": "podgroups"}  # fmt: skip


def _named(namespace: str, obj: dict[str, Any]) -> str:
    """The URL of the object named like `obj` (a child the operator creates), in its API group and version."""
    return path(api_of(obj["apiVersion"]), namespace, _RESOURCES[obj["kind"]], obj["metadata"]["name"])


class Kube:
    """Typed access to the objects a job owns. Plain dicts in, plain dicts out, as the API server sends them
    (JSON), through `http` (transport.py)."""

    def __init__(self, http: Transport, kubeconfig: str | None = None):
        self.http, self.kubeconfig = http, kubeconfig

    @classmethod
    def connect(
        cls, kubeconfig: str | None = None, on_request: Callable[[str, str], None] | None = None, connections: int = 10,
        timeout: float = 60.0, agent: str = "sharded-operator",
    ) -> Kube:  # fmt: skip
        """The explicit kubeconfig, else the in-cluster account, else $KUBECONFIG. `connections`: how many
        requests the caller's threads may have in flight at once; `on_request(method, resource)` is told of
        every request sent (the operator counts them in its metrics); `timeout`: seconds to connect and to
        wait for each read; `agent`: the User-Agent sent."""
        counted = None if on_request is None else (lambda method, url: on_request(method, resource_of(url)))
        http = Transport(load(kubeconfig), connections=max(connections, 1), on_request=counted, timeout=timeout,
                         agent=agent)  # fmt: skip
        return cls(http, kubeconfig)

    @property
    def namespace(self) -> str | None:
        """The kubeconfig context's namespace, or the pod's own in a cluster."""
        return self.http.credentials.namespace

    def _get(self, url: str, **query: Any) -> dict[str, Any] | None:
        """The object, None when it does not exist."""
        try:
            return self.http.json("GET", url, query=query or None)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    @retrying
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(path(_JOBS, namespace, PLURAL, name))

    @retrying
    def list_jobs(self, namespace: str | None) -> list[dict[str, Any]]:
        """Every job in `namespace`, or in the cluster when it is None."""
        return self.http.json("GET", path(_JOBS, namespace, PLURAL))["items"]

    def create_job(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create a job as a user does (never retried: a second create of the same name is an error to show)."""
        return self.http.json("POST", path(_JOBS, namespace, PLURAL), body=body)

    @retrying
    def patch_job_spec(self, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.http.json("PATCH", path(_JOBS, namespace, PLURAL, name), body={"spec": spec},
                              content_type="application/merge-patch+json")  # fmt: skip

    def pod_log_lines(self, namespace: str, pod: str, *, follow: bool, tail: int | None = None):
        """The pod's container log through the API server (which asks the node's kubelet), line by line;
        with `follow`, until the container ends."""
        resp = self.http.request(
            "GET", path("api/v1", namespace, "pods", pod, "log"),
            query={"follow": "true" if follow else None, "tailLines": tail}, timeout=None,
        )  # fmt: skip
        yield from (line.decode(errors="replace") for line in stream_lines(resp))

    def _streams(self) -> Any:
        """The `kubernetes` package's client, for the WebSocket streams only (exec, port-forward: the CLI,
        never the operator)."""
        from kubernetes import client, config

        if in_a_cluster(self.kubeconfig):
            config.load_incluster_config()
            return client.CoreV1Api()
        return client.CoreV1Api(config.new_client_from_config(config_file=self.kubeconfig))

    def port_forward(self, namespace: str, pod: str, port: int) -> Any:
        """One connection to `port` on the pod's loopback, through the API server's pods/portforward (the
        node's kubelet connects inside the pod's network namespace): `.socket(port)` carries the bytes,
        `.error(port)` says why the pod's side refused or ended."""
        from kubernetes.client.rest import ApiException
        from kubernetes.stream import portforward

        try:
            return portforward(self._streams().connect_get_namespaced_pod_portforward, pod, namespace,
                               ports=str(port))  # fmt: skip
        except ApiException as e:
            raise ApiError(e.status or 0, e.reason or "", e.body or "") from None

    def exec(self, namespace: str, pod: str, command: list[str], container: str) -> Any:
        """A command started in the pod's container through the API server's pods/exec: a stream whose
        stdout and stderr the caller reads as they come and whose `.returncode` is the command's exit."""
        from kubernetes.client.rest import ApiException
        from kubernetes.stream import stream

        # v4, the protocol every kubelet speaks: offered v5, an API server may translate the stream to SPDY
        # towards the kubelet instead of passing the WebSocket through.
        try:
            return stream(
                self._streams().connect_get_namespaced_pod_exec, pod, namespace, container=container,
                command=command, stdin=False, stdout=True, stderr=True, tty=False, _preload_content=False,
                _headers={"sec-websocket-protocol": "v4.channel.k8s.io"},
            )  # fmt: skip
        except ApiException as e:
            raise ApiError(e.status or 0, e.reason or "", e.body or "") from None

    @retrying
    def host_ports_in_use(self) -> list[int | None]:
        """`status.hostPort` of every job in the cluster that has not finished."""
        jobs = self.list_jobs(None)
        return [
            (j.get("status") or {}).get("hostPort") for j in jobs
            if (j.get("status") or {}).get("phase") not in FINISHED
        ]  # fmt: skip

    @retrying
    def list_job_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        """The job's training pods (each has a node index), not its rendezvous store pod."""
        return self.http.json("GET", path("api/v1", namespace, "pods"), query={"labelSelector": training_pods(job)})[
            "items"]  # fmt: skip

    def get_node(self, name: str) -> dict[str, Any] | None:
        """One attempt, no retries: a caller that cannot tell waits for the node watch instead."""
        return self._get(path("api/v1", None, "nodes", name))

    @retrying
    def list_nodes(self) -> tuple[list[dict[str, Any]], str]:
        """Every node and the list's resourceVersion, from which a watch misses nothing."""
        body = self.http.json("GET", "/api/v1/nodes")
        return body["items"], body["metadata"]["resourceVersion"]

    def watch_nodes(self, resource_version: str, timeout_seconds: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, node) for each change of a node after `resource_version`, BOOKMARK events included (their
        object carries only a newer version), until the API server ends the watch after `timeout_seconds`.
        Raises Expired when the version is older than the API server keeps: list again."""
        try:
            resp = self.http.request(
                "GET", "/api/v1/nodes", timeout=timeout_seconds + 60,
                query={"watch": "true", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                       "timeoutSeconds": timeout_seconds},
            )  # fmt: skip
        except ApiError as e:  # some API servers refuse the request itself rather than send an ERROR event
            if e.status == 410:
                raise Expired(e.reason) from e
            raise
        for line in stream_lines(resp):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError as e:
                raise Malformed(f"a watch event that is not JSON: {line[:200]!r}") from e
            if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
                raise Malformed(f"a watch event without an object: {line[:200]!r}")
            if event.get("type") == "ERROR":
                status = event.get("object") or {}
                if status.get("code") == 410:
                    raise Expired(status.get("message", "resource version too old"))
                raise ApiError(status.get("code") or 0, str(status.get("message", "")))
            yield event.get("type"), event["object"]

    @retrying
    def create(self, namespace: str, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create `obj` and return it as created (a pod with its UID); an existing object of that name is
        success too (returns None)."""
        kind = obj["kind"]
        if kind not in _RESOURCES:
            raise ValueError(f"unsupported kind {kind}")
        try:
            return self.http.json("POST", path(api_of(obj["apiVersion"]), namespace, _RESOURCES[kind]), body=obj)
        except ApiError as e:
            if e.status == 409:
                return None
            if e.status == 404 and kind == "PodGroup":
                raise MissingAPI(f"{obj['apiVersion']} PodGroup is not installed in this cluster") from e
            if e.status in (400, 403, 422):  # admission said no: a policy, a quota or an invalid object
                raise Refused.from_api(kind, obj["metadata"]["name"], e) from e
            raise

    @retrying
    def read(self, namespace: str, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The existing object named like `obj`, of its kind and API version; None if gone."""
        return self._get(_named(namespace, obj))

    @retrying
    def patch_spec(self, namespace: str, obj: dict[str, Any], fields: dict[str, Any]) -> None:
        """Merge `fields` into the spec of the existing object named like `obj` (gone since: nothing to do)."""
        try:
            self.http.send(
                "PATCH", _named(namespace, obj), body={"spec": fields}, content_type="application/merge-patch+json"
            )
        except ApiError as e:
            if e.status != 404:
                raise

    @retrying
    def read_meta(self, namespace: str, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The metadata of the existing object named like `obj` (a Service, ConfigMap or claim); None if gone."""
        found = self._get(_named(namespace, obj))
        return None if found is None else found["metadata"]

    @retrying
    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None, uid: str | None = None) -> None:
        """Delete the pod; with `uid`, only that pod: a newer one created under the name since (the next
        attempt's, say) is left alone (the API server answers 409)."""
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        if uid:
            options["preconditions"] = {"uid": uid}
        try:
            self.http.send("DELETE", path("api/v1", namespace, "pods", name), body=options)
        except ApiError as e:
            if e.status not in (404, 409) or (e.status == 409 and not uid):
                raise

    @retrying
    def patch_status(
        self,
        namespace: str,
        name: str,
        status: dict[str, Any],
        uid: str,
        before: dict[str, Any] | None = None,
        resource_version: str | None = None,
    ) -> Written | None:
        """Write the status fields that differ from `before` (all of them without it), only onto the object
        with this `uid`: a JSON patch whose first operation tests it, so a job deleted and created again under
        its name meanwhile is left alone (returns None). Fields neither side names are not touched: progress
        reports write theirs on their own.

        With `resource_version` the write is a decision taken from the job as it was at that version: it lands
        only on that version (the API server's optimistic concurrency), and `Stale` is raised when the job
        changed since, so a replica deciding from an older view (one that lost the Lease and does not know it
        yet) can never land a decision over a newer one: read the job again and decide anew."""
        ops: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/uid", "value": uid}]
        if resource_version is not None:
            ops.append({"op": "replace", "path": "/metadata/resourceVersion", "value": resource_version})
        if before is None:
            ops.append({"op": "add", "path": "/status", "value": status})
        else:
            for key in sorted(set(status) | set(before)):
                if key not in status:
                    ops.append({"op": "remove", "path": f"/status/{key}"})
                elif status[key] != before.get(key):
                    ops.append({"op": "add", "path": f"/status/{key}", "value": status[key]})
        try:
            out = self.http.json("PATCH", path(_JOBS, namespace, PLURAL, name, "status"), body=ops,
                                 content_type="application/json-patch+json")  # fmt: skip
        except ApiError as e:
            if e.status == 409 and resource_version is not None:
                raise Stale(f"{namespace}/{name} changed since resourceVersion {resource_version}") from e
            if e.status in (404, 409, 422):
                return None
            raise
        return Written(((out or {}).get("metadata") or {}).get("resourceVersion"))

    @retrying
    def patch_report(self, namespace: str, name: str, fields: dict[str, Any], resource_version: str) -> bool:
        """Merge a progress report's status fields into the job as it was at `resource_version`; False when
        the job changed since (read it again and merge anew) or is gone."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": fields}
        try:
            self.http.send("PATCH", path(_JOBS, namespace, PLURAL, name, "status"), body=body,
                           content_type="application/merge-patch+json")  # fmt: skip
        except ApiError as e:
            if e.status in (404, 409):
                return False
            raise
        return True

    def lease(
        self, namespace: str, name: str, spec_for: Callable[[dict[str, Any] | None], dict[str, Any] | None]
    ) -> bool:
        """Acquire or renew a Lease: `spec_for(current spec or None)` gives the spec to write, or None to
        leave it; written only over the version read (a replica that raced us wins). True if written."""
        leases = path("apis/coordination.k8s.io/v1", namespace, "leases")
        current = self._get(f"{leases}/{name}")
        spec = spec_for(current.get("spec") if current else None)
        if spec is None:
            return False
        try:
            if current is None:
                body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                        "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip
                self.http.send("POST", leases, body=body)
            else:
                self.http.send("PUT", f"{leases}/{name}", body={**current, "spec": spec})
        except ApiError as e:
            if e.status == 409:
                return False
            raise
        return True

    @retrying
    def token_review(self, token: str, audience: str) -> dict[str, Any]:
        """The API server's verdict on a token for `audience` (TokenReview status)."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [audience]}}  # fmt: skip
        review = self.http.json("POST", "/apis/authentication.k8s.io/v1/tokenreviews", body=body)
        return review.get("status") or {}

    def issuer_discovery(self) -> dict[str, Any] | None:
        """The service-account issuer's OIDC discovery document; None where the API server serves none."""
        return self._get("/.well-known/openid-configuration")

    def issuer_keys(self) -> dict[str, Any]:
        """The issuer's public signing keys (a JWKS), from the API server itself, whatever jwks_uri says."""
        return self.http.json("GET", "/openid/v1/jwks", accept="application/jwk-set+json")

    @retrying
    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(path("api/v1", namespace, "pods", name))

    @retrying
    def delete_job(self, namespace: str, name: str) -> None:
        try:
            self.http.send("DELETE", path(_JOBS, namespace, PLURAL, name), query={"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise

    def event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Record an event on the job, best effort as Kubernetes' own event recorders are: one the API server
        refuses (its namespace is being deleted, a quota on events) is logged and dropped, never raised into
        a reconcile whose status, which the event only echoes, is already written."""
        try:
            self._create_event(job, type_, reason, message)
        except ApiError as e:
            meta = job["metadata"]
            logger.warning("event %s on %s/%s dropped: %s %s", reason, meta["namespace"], meta["name"], e.status,
                           e.reason)  # fmt: skip

    @retrying
    def _create_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = job["metadata"]
        now = dt.datetime.now(dt.UTC)
        body = {
            "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "eventTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": f"{GROUP}/operator",
            "reportingInstance": "sharded-operator",
            "action": reason,
            "reason": reason,
            "type": type_,
            "note": message[:1024],
            "regarding": {
                "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta["uid"],
            },
        }  # fmt: skip
        self.http.send("POST", path("apis/events.k8s.io/v1", meta["namespace"], "events"), body=body)
