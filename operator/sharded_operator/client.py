"""A typed Python client for ShardedTrainingJobs, on the same pydantic models the operator serves.

    from sharded_operator.client import Client
    jobs = Client.connect(namespace="team-a")
    job = jobs.create(manifest)                       # a dict or a ShardedTrainingJob
    jobs.wait(job.name, condition="Complete", timeout=3600)
    for node, line in jobs.logs(job.name, follow=True):
        print(node, line)

Every call goes through the API server with the caller's own credentials (kubeconfig or in-cluster).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sharded_operator.api.models import CONTAINER, GROUP, KIND, LABEL_ATTEMPT, LABEL_INDEX, VERSION, ShardedTrainingJob
from sharded_operator.api.status import FINISHED, Phase, PodPhase
from sharded_operator.render.export_pod import ExportError, export_pod, location
from sharded_operator.run.apicalls import Refused
from sharded_operator.run.k8s import Kube
from sharded_operator.run.transport import ApiError

POLL_SECONDS = 1.0


class JobError(RuntimeError):
    """A request the API server refused, or a wait that cannot succeed; the message says which and why."""


@dataclass(frozen=True)
class Job:
    """A job as read now: the validated object plus the few things every caller asks for."""

    obj: ShardedTrainingJob

    @property
    def name(self) -> str:
        return self.obj.metadata["name"]

    @property
    def phase(self) -> Phase | None:
        return self.obj.status.phase

    def condition(self, type_: str) -> str | None:
        """ "True", "False" or "Unknown"; None when the operator has not set it (yet)."""
        return next((c.status for c in self.obj.status.conditions if c.type == type_), None)


def _of_attempt(pods: list[dict[str, Any]], attempt: int) -> list[dict[str, Any]]:
    """The job's pods of one attempt (a restarted gang's old pods may still be terminating)."""
    return [p for p in pods if p["metadata"]["labels"].get(LABEL_ATTEMPT) == str(attempt)]


def _api_error(e: ApiError, what: str) -> JobError:
    """The API server's own message (it names the field for a schema or CEL rejection)."""
    try:
        message = json.loads(e.body)["message"]
    except (TypeError, ValueError, KeyError):
        message = e.reason
    return JobError(f"{what}: {message}")


class Client:
    """Create, read, wait for, suspend/resume and read the logs of ShardedTrainingJobs in one namespace."""

    def __init__(self, kube: Kube, namespace: str):
        self.kube, self.namespace = kube, namespace

    @classmethod
    def connect(cls, *, kubeconfig: str | None = None, namespace: str | None = None) -> Client:
        kube = Kube.connect(kubeconfig)
        return cls(kube, namespace or kube.namespace or "default")

    def create(self, job: dict[str, Any] | ShardedTrainingJob) -> Job:
        body = job.model_dump(by_alias=True, exclude={"status"}) if isinstance(job, ShardedTrainingJob) else job
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, **body}
        try:
            return Job(ShardedTrainingJob.model_validate(self.kube.create_job(self.namespace, body)))
        except ApiError as e:
            raise _api_error(e, f"creating {body.get('metadata', {}).get('name', '?')}") from e

    def get(self, name: str) -> Job:
        obj = self.kube.get_job(self.namespace, name)
        if obj is None:
            raise JobError(f"no ShardedTrainingJob {name!r} in namespace {self.namespace!r}")
        return Job(ShardedTrainingJob.model_validate(obj))

    def list(self, *, all_namespaces: bool = False) -> list[Job]:
        items = self.kube.list_jobs(None if all_namespaces else self.namespace)
        return [Job(ShardedTrainingJob.model_validate(o)) for o in items]

    def suspend(self, name: str) -> Job:
        return self._patch(name, {"runPolicy": {"suspend": True}})

    def resume(self, name: str) -> Job:
        return self._patch(name, {"runPolicy": {"suspend": False}})

    def _patch(self, name: str, spec: dict[str, Any]) -> Job:
        try:
            return Job(ShardedTrainingJob.model_validate(self.kube.patch_job_spec(self.namespace, name, spec)))
        except ApiError as e:
            raise _api_error(e, f"updating {name}") from e

    def wait(self, name: str, *, condition: str | None = None, phase: str | None = None, timeout: float = 600) -> Job:
        """Until the condition is True or the job reaches the phase. A job that ends another way (Failed
        while waiting for Complete, say) raises at once instead of running out the clock."""
        if (condition is None) == (phase is None):
            raise ValueError("wait for exactly one of condition= or phase=")
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(name)
            if (condition and job.condition(condition) == "True") or (phase and job.phase == phase):
                return job
            if job.phase in FINISHED:
                raise JobError(f"{name} ended {job.phase}: {job.obj.status.message or ''}".rstrip(": "))
            if time.monotonic() > deadline:
                want = f"condition {condition}" if condition else f"phase {phase}"
                raise TimeoutError(f"{name}: no {want} within {timeout:g} s (phase {job.phase})")
            time.sleep(POLL_SECONDS)

    def export(self, name: str, *, step: int | None = None, timeout: float = 1800) -> tuple[int, str]:
        """Consolidate checkpoint `step` (default: the newest) into one safetensors file on the job's claim, in a
        pod built from one of the job's training pods; returns (step, "claim:path"). The pod is deleted once
        done, and kept (with its log) when it fails."""
        job = self.get(name)
        newest = job.obj.status.last_checkpoint
        step = step if step is not None else (newest.step if newest else None)
        if step is None:
            raise JobError(f"{name} has no checkpoint yet")
        pods = self.kube.list_job_pods(self.namespace, name)
        current = _of_attempt(pods, job.obj.status.attempt)
        if not (current or pods):
            raise JobError(f"no pod of {name} is left to take its image, config and claim from (cleanPodPolicy)")
        try:
            pod = export_pod(job.obj, (current or pods)[0], step, suffix=f"{step}-{uuid.uuid4().hex[:5]}")
            self.kube.create(self.namespace, pod)
        except (ExportError, Refused) as e:
            raise JobError(f"exporting {name}: {e}") from e
        pod_name = pod["metadata"]["name"]
        deadline = time.monotonic() + timeout
        while (phase := ((self.kube.get_pod(self.namespace, pod_name) or {}).get("status") or {}).get("phase")) not in (
            PodPhase.SUCCEEDED, PodPhase.FAILED
        ):  # fmt: skip
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pod_name}: not done within {timeout:g} s (phase {phase})")
            time.sleep(POLL_SECONDS)
        if phase == PodPhase.FAILED:
            tail = "\n".join(list(self.kube.pod_log_lines(self.namespace, pod_name, follow=False, tail=20)))
            raise JobError(f"export pod {pod_name} failed (kept for its log):\n{tail}")
        self.kube.delete_pod(self.namespace, pod_name, None)
        return step, location(pod, step)

    def pod(self, name: str, node: int = 0) -> str:
        """The name of node `node`'s pod of the job's current attempt, once it runs."""
        attempt = self.get(name).obj.status.attempt
        for p in _of_attempt(self.kube.list_job_pods(self.namespace, name), attempt):
            if p["metadata"]["labels"].get(LABEL_INDEX) == str(node):
                if p["status"].get("phase") != PodPhase.RUNNING:
                    raise JobError(f"{name}: node {node}'s pod {p['metadata']['name']} is {p['status'].get('phase')}")
                return p["metadata"]["name"]
        raise JobError(f"{name}: no pod for node {node} in attempt {attempt}")

    def port_forward(self, pod: str, port: int) -> Any:
        """A connection to `port` on the pod's loopback through the API server (see Kube.port_forward)."""
        try:
            return self.kube.port_forward(self.namespace, pod, port)
        except ApiError as e:
            raise _api_error(e, pod) from None

    def exec(self, pod: str, command: list[str], out: Callable[[str], Any], err: Callable[[str], Any]) -> int:
        """Run `command` in the pod's trainer container, handing its stdout and stderr to `out` and `err` as
        they come; its exit code."""
        try:
            s = self.kube.exec(self.namespace, pod, command, CONTAINER)
        except ApiError as e:
            raise _api_error(e, pod) from None
        try:
            while s.is_open():
                s.update(timeout=1)
                if s.peek_stdout():
                    out(s.read_stdout())
                if s.peek_stderr():
                    err(s.read_stderr())
            out(s.read_stdout())
            err(s.read_stderr())
            return s.returncode
        finally:
            s.close()

    def logs(self, name: str, *, follow: bool = False, tail: int | None = None) -> Iterator[tuple[int, str]]:
        """(node rank, line) from every pod of the current attempt, merged as they arrive. Each pod's log
        holds its torchrun agent and the ranks it runs (prefixed by torchrun where the image sets --tee)."""
        attempt = self.get(name).obj.status.attempt
        pods = sorted(
            (p for p in _of_attempt(self.kube.list_job_pods(self.namespace, name), attempt)
             if p["status"].get("phase") != PodPhase.PENDING),
            key=lambda p: int(p["metadata"]["labels"][LABEL_INDEX]),
        )  # fmt: skip
        if not pods:
            return
        lines: queue.Queue[tuple[int, str] | None] = queue.Queue(maxsize=10_000)

        def pump(pod: dict[str, Any]) -> None:
            node = int(pod["metadata"]["labels"][LABEL_INDEX])
            try:
                for line in self.kube.pod_log_lines(self.namespace, pod["metadata"]["name"], follow=follow, tail=tail):
                    lines.put((node, line))
            except ApiError as e:
                lines.put((node, f"(log unavailable: {_api_error(e, pod['metadata']['name'])})"))
            finally:
                lines.put(None)

        for pod in pods:
            threading.Thread(target=pump, args=(pod,), daemon=True).start()
        open_streams = len(pods)
        while open_streams:
            item = lines.get()
            if item is None:
                open_streams -= 1
            else:
                yield item
