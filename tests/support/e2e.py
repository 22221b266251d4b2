"""Jobs for the end-to-end tiers (process and container mode): a small CPU job and a client for it."""

from __future__ import annotations

from conftest import wait_for
from localstack.stack import LocalStack
from sharded_operator.api.models import GROUP, PLURAL, VERSION
from sharded_trainer.checkpoint.manager import committed_steps
from support.jobs import local_cpu_job

NS = "default"


def job(name: str, strategy: str = "fsdp", steps: int = 30, **spec) -> dict:
    """The local CPU job (`local_cpu_job`) as submitted, with top-level spec fields replaced by `spec`."""
    b = local_cpu_job(name, strategy, steps)
    for key, value in spec.items():
        b = b.spec(key, value)
    return b.manifest()


class Jobs:
    def __init__(self, stack: LocalStack):
        self.stack = stack
        self.path = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"

    def create(self, body: dict) -> dict:
        return self.stack.cluster.api("POST", self.path, body)

    def status(self, name: str) -> dict:
        return self.stack.cluster.api("GET", f"{self.path}/{name}").get("status") or {}

    def patch(self, name: str, spec: dict) -> None:
        self.stack.cluster.api("PATCH", f"{self.path}/{name}", {"spec": spec}, "application/merge-patch+json")

    def delete(self, name: str) -> None:
        self.stack.cluster.api("DELETE", f"{self.path}/{name}")

    def exists(self, name: str) -> bool:
        names = [item["metadata"]["name"] for item in self.stack.cluster.api("GET", self.path)["items"]]
        return name in names

    def wait(self, name: str, pred, timeout: float = 240, what: str = "") -> dict:
        return wait_for(lambda: (s := self.status(name)) and pred(s) and s, timeout=timeout, interval=0.5, what=what)

    def checkpoints(self, name: str) -> list[int]:
        return committed_steps(self.stack.claim_dir(NS, f"{name}-checkpoints") / name)

    def logs(self, name: str) -> str:
        return "\n".join(
            p.read_text()
            for p in sorted((self.stack.workdir / "nodeagent" / "pods").glob(f"{NS}_{name}-*/container.log"))
        )

    def explain(self, name: str) -> str:
        """What an assertion on a job's end should print: its last failure, its events and its logs' tail."""
        status = self.status(name)
        events = self.stack.cluster.api("GET", f"/apis/events.k8s.io/v1/namespaces/{NS}/events")["items"]
        said = [f"{e['reason']}: {e.get('note', '')}" for e in events if (e.get("regarding") or {}).get("name") == name]
        logs = sorted((self.stack.workdir / "nodeagent" / "pods").glob(f"{NS}_{name}-*/container.log"),
                      key=lambda p: p.stat().st_mtime)  # fmt: skip
        tails = [f"--- {p.parent.name}\n{p.read_text()[-1500:]}" for p in logs]
        return "\n".join([f"lastFailure: {status.get('lastFailure')}", *said, *tails])

    def event_notes(self, name: str) -> list[tuple[str, str]]:
        events = self.stack.cluster.api("GET", f"/apis/events.k8s.io/v1/namespaces/{NS}/events")["items"]
        return [(e["reason"], e.get("note", "")) for e in events if (e.get("regarding") or {}).get("name") == name]

    def event_reasons(self, name: str, until=lambda reasons: True, timeout: float = 30) -> list[str]:
        """The reasons of the job's events, once `until(reasons)` holds: the operator sends a decision's events
        after the status write that records it, so a status just seen may not have its events yet."""
        reasons: list[str] = []

        def seen() -> bool:
            nonlocal reasons
            reasons = [r for r, _ in self.event_notes(name)]
            return until(reasons)

        wait_for(seen, timeout=timeout, interval=0.5, what=f"the events of {name} (so far {reasons})")
        return reasons

    def runs(self, name: str, store: bool = False):
        """The node agent's runs of the job's training pods (and, with `store`, of its rendezvous store pod)."""
        return [
            r for r in list(self.stack.agent.runs.values())
            if r.name.startswith(f"{name}-") and (store or r.name != f"{name}-rdzv")
        ]  # fmt: skip


def cleanup(jobs: Jobs) -> None:
    for item in jobs.stack.cluster.api("GET", jobs.path)["items"]:
        jobs.delete(item["metadata"]["name"])
