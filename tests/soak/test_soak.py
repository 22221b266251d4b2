"""A seeded chaos soak on the real control plane: 20 jobs while faults land in a random order.

Faults: pod exits (retryable and permanent), plain pod deletions, evictions, suspend/resume, spec edits,
deletion and re-creation under the same name, operator SIGKILLs at random moments, and a node deleted
under its pods. Each job gets at most one fault per attempt, so what its status must say afterwards is
exact: every injected failure counted once, every disruption counted apart, the phase the schedule
implies. Throughout, a sampler checks that no job ever has more live pods than its node count or live
pods of two attempts; at the end, no child outlives its job and the operator never logged a traceback.

The seed is printed; `SOAK_SEED=N` replays one (`make soak SEEDS="1 2 3"` runs several).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from sharded_operator.api.models import GROUP, LABEL_ATTEMPT, LABEL_INDEX, LABEL_JOB, PLURAL, VERSION
from support.jobs import make_job

pytestmark = pytest.mark.soak
ROUNDS = 5
FAULTS = ["retryable", "retryable", "delete-pod", "evict", "evict", "suspend", "edit", "recreate", "none", "permanent"]


@dataclass
class Expect:
    """What a job's status must say once the faults of a round have played out."""

    name: str
    nodes: int
    backoff: int
    attempt: int = 1
    restarts: int = 0
    disruptions: int = 0
    phase: str = "Running"
    uid: str = ""
    in_place: int = 0  # failurePolicy.inPlaceRestarts: pods replaced alone per attempt
    replaced: int = 0  # in the current attempt
    pod_replacements: int = 0
    # What the status may say instead: a pod deleted while the operator was down, gone before a replica
    # listed it, is a disruption (PodVanished), since why it went cannot be known.
    alt: Expect | None = field(default=None, repr=False)

    def failed(self) -> bool:
        return self.phase == "Failed"

    def new_attempt(self) -> None:
        self.attempt += 1
        self.replaced = 0

    def count_failure(self) -> None:
        if self.restarts >= self.backoff:
            self.phase = "Failed"
        else:
            self.restarts += 1
            self.new_attempt()

    def lose_pods(self, n: int, disruption: bool) -> None:
        """`n` pods of the attempt fail or go at once: replaced alone while the budget lasts and one survives;
        otherwise the gang restarts (a disruption, or a counted failure)."""
        if self.nodes > n and self.replaced + n <= self.in_place:
            self.replaced += n
            self.pod_replacements += n
        elif disruption:
            self.disruptions += 1
            self.new_attempt()
        else:
            self.count_failure()


@dataclass
class Soak:
    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    ns: str
    rng: random.Random
    trace: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    jobs: dict[str, Expect] = field(default_factory=dict)
    chaos: bool = False  # the operator is being killed and started again this round
    log: Path | None = None  # the operator's log, shown for a job that does not settle

    def say(self, msg: str) -> None:
        self.trace.append(f"{time.monotonic():.1f} {msg}")

    # --- the API -------------------------------------------------------------------------------------

    def create(self, exp: Expect) -> None:
        # A grace long enough that a deleted pod is still Terminating when a killed operator is back.
        builder = make_job(exp.name).nodes(exp.nodes).gpus(1).spec("failurePolicy.backoffLimit", exp.backoff)
        if exp.in_place:  # KWOK pods never report: the recovery must not time out during the soak
            builder = builder.spec("failurePolicy.inPlaceRestarts", exp.in_place)
            builder = builder.spec("failurePolicy.inPlaceTimeoutSeconds", 86400)
        body = builder.spec("runPolicy.terminationGraceSeconds", 15).obj()
        body["metadata"] = {"name": exp.name}
        exp.uid = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, body)["metadata"]["uid"]
        self.jobs[exp.name] = exp

    def status(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name).get("status") or {}

    def pods(self, name: str | None = None) -> list[client.V1Pod]:
        selector = f"{LABEL_JOB}={name}" if name else LABEL_JOB
        return self.core.list_namespaced_pod(self.ns, label_selector=selector).items

    def live_pods(self, name: str, attempt: int) -> list[client.V1Pod]:
        return [
            p for p in self.pods(name)
            if p.metadata.labels.get(LABEL_ATTEMPT) == str(attempt) and not p.metadata.deletion_timestamp
        ]  # fmt: skip

    def patch(self, name: str, spec: dict) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    # --- expectations --------------------------------------------------------------------------------

    def settled(self, exp: Expect) -> bool:
        s = self.status(exp.name)
        if self._says(exp, s):
            return True
        vanished = (s.get("lastFailure") or {}).get("reason") == "PodVanished"
        if exp.alt is not None and vanished and self._says(exp.alt, s):
            for f in dataclasses.fields(Expect):
                setattr(exp, f.name, getattr(exp.alt, f.name))
            return True
        return False

    def _says(self, exp: Expect, s: dict) -> bool:
        got = (s.get("phase"), s.get("attempt"), s.get("restarts", 0), s.get("disruptions", 0),
               s.get("podReplacements", 0))  # fmt: skip
        if exp.failed():
            return got[0] == "Failed" and got[2] == exp.restarts
        if got != (exp.phase, exp.attempt, exp.restarts, exp.disruptions, exp.pod_replacements):
            return False
        pods = self.live_pods(exp.name, exp.attempt)
        return len(pods) == exp.nodes and all(p.metadata.owner_references[0].uid == exp.uid for p in pods)

    def wait_settled(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.jobs.values())
        while pending and time.monotonic() < deadline:
            pending = [e for e in pending if not self._safe(self.settled, e)]
            time.sleep(0.5)
        if pending:
            detail = "; ".join(f"{e.name}: want {e} got {self._safe(self.status, e.name)}" for e in pending)
            seen = "\n".join(self.diagnose(e.name) for e in pending)
            pytest.fail(f"not settled after {timeout}s: {detail}\n" + "\n".join(self.trace[-80:]) + "\n" + seen)
        for exp in self.jobs.values():
            exp.alt = None

    def diagnose(self, name: str) -> str:
        """What a job that did not settle looks like: its pods as the API server lists them, and what the
        operator logged about it (the only record of a decision a killed replica took or left)."""
        lines = [f"pods of {name}:"]
        for p in self._safe(self.pods, name) or []:
            conditions = {c.type: c.status for c in p.status.conditions or []}
            lines.append(
                f"  {p.metadata.name} uid {p.metadata.uid[:8]} attempt {p.metadata.labels.get(LABEL_ATTEMPT)} "
                f"{p.status.phase} deleting={bool(p.metadata.deletion_timestamp)} {conditions}"
            )
        if self.log is not None:
            mention = re.compile(rf"/{re.escape(name)}(?![\w-])")  # soak-1, not soak-10
            said = [line for line in self.log.read_text(errors="replace").splitlines() if mention.search(line)]
            lines += [f"operator log on {name} (last 40 of {len(said)}):", *said[-40:]]
        return "\n".join(lines)

    @staticmethod
    def _safe(fn, *args):
        try:
            return fn(*args)
        except ApiException:
            return None

    # --- invariants, sampled all along ---------------------------------------------------------------

    def sample(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                pods = self.pods()
            except ApiException:
                continue
            by_job: dict[str, list[client.V1Pod]] = {}
            for p in pods:
                training = LABEL_INDEX in p.metadata.labels  # not the job's rendezvous store pod
                if training and not p.metadata.deletion_timestamp and p.status.phase in ("Pending", "Running"):
                    by_job.setdefault(p.metadata.labels[LABEL_JOB], []).append(p)
            for name, live in by_job.items():
                exp = self.jobs.get(name)
                attempts = {p.metadata.labels[LABEL_ATTEMPT] for p in live}
                owners = {p.metadata.owner_references[0].uid for p in live}
                if exp and len(live) > exp.nodes:
                    self.violations.append(f"{name}: {len(live)} live pods for {exp.nodes} nodes")
                if len(attempts) > 1 and len(owners) == 1:
                    self.violations.append(f"{name}: live pods of attempts {sorted(attempts)} at once")
            stop.wait(0.3)

    # --- faults --------------------------------------------------------------------------------------

    def inject(self, exp: Expect, fault: str) -> None:
        pods = self.live_pods(exp.name, exp.attempt)
        victim = self.rng.choice(pods).metadata.name if pods else None
        self.say(f"{exp.name} attempt {exp.attempt}: {fault} {victim or ''}")
        if fault == "retryable" and victim:
            self._exit(victim, self.rng.choice([1, 137]))
            exp.lose_pods(1, disruption=False)
        elif fault == "permanent" and victim:
            self._exit(victim, 2)
            exp.phase = "Failed"
        elif fault == "delete-pod" and victim:
            self.core.delete_namespaced_pod(victim, self.ns)
            if self.chaos:
                exp.alt = dataclasses.replace(exp)
                exp.alt.lose_pods(1, disruption=True)
            exp.lose_pods(1, disruption=False)
        elif fault == "evict" and victim:
            meta = client.V1ObjectMeta(name=victim, namespace=self.ns)
            self.core.create_namespaced_pod_eviction(victim, self.ns, client.V1Eviction(metadata=meta))
            exp.lose_pods(1, disruption=True)
        elif fault == "edit":
            self.patch(exp.name, {"trainer": {"steps": self.rng.randint(11, 999)}})
        elif fault == "suspend":
            self.patch(exp.name, {"runPolicy": {"suspend": True}})
            deadline = time.monotonic() + 60
            while self.status(exp.name).get("phase") != "Suspended" and time.monotonic() < deadline:
                time.sleep(0.2)
            self.patch(exp.name, {"runPolicy": {"suspend": False}})
            exp.new_attempt()
        elif fault == "recreate":
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, exp.name)
            deadline = time.monotonic() + 60
            while self._safe(self.status, exp.name) is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            self.create(Expect(exp.name, exp.nodes, exp.backoff, in_place=exp.in_place))

    def _exit(self, pod: str, code: int) -> None:
        exit_code = {"metadata": {"annotations": {"kwok.sharded.dev/exit-code": str(code)}}}
        self.core.patch_namespaced_pod(pod, self.ns, exit_code)


def operator_chaos(operator, rng: random.Random, soak: Soak, stop: threading.Event) -> None:
    """SIGKILL the operator at random moments of a round, and start it again."""
    while not stop.wait(rng.uniform(0.5, 4)):
        soak.say("operator: SIGKILL")
        operator.kill()
        time.sleep(rng.uniform(0, 1))
        operator.start()
        soak.say("operator: started")


def test_jobs_survive_a_seeded_schedule_of_faults(core, custom, namespace, operator, cluster, capsys):
    seed = int(os.environ.get("SOAK_SEED") or random.SystemRandom().randrange(1 << 30))
    with capsys.disabled():  # shown whether the run passes or not, so any seed can be replayed
        print(f"\nsoak seed {seed} (replay: make soak SEEDS={seed})")
    rng = random.Random(seed)
    soak = Soak(core, custom, namespace, rng, log=operator.log)
    log_start = operator.log.stat().st_size
    stop = threading.Event()
    sampler = threading.Thread(target=soak.sample, args=(stop,), daemon=True)
    sampler.start()
    try:
        for i in range(20):
            # One job in four recovers in place (2 nodes: a pod is replaced alone while the other stays).
            in_place = rng.choice([1, 2]) if i % 4 == 1 else 0
            nodes = 2 if i % 5 == 0 or in_place else 1
            soak.create(Expect(f"soak-{i}", nodes=nodes, backoff=rng.choice([1, 2, 3]), in_place=in_place))
        soak.wait_settled()

        permanent_left = 2
        for round_ in range(ROUNDS):
            chaos_stop = threading.Event()
            chaos = threading.Thread(target=operator_chaos, args=(operator, rng, soak, chaos_stop), daemon=True)
            soak.chaos = rng.random() < 0.7
            if soak.chaos:
                chaos.start()
            jobs = [e for e in soak.jobs.values() if not e.failed()]
            rng.shuffle(jobs)
            for exp in jobs:
                fault = rng.choice(FAULTS)
                if fault == "permanent" and permanent_left == 0:
                    fault = "retryable"
                permanent_left -= fault == "permanent"
                soak.inject(soak.jobs[exp.name], fault)
            chaos_stop.set()
            if chaos.is_alive():
                chaos.join()
            soak.chaos = False
            if operator.proc.poll() is not None:
                operator.start()
            soak.say(f"round {round_}: waiting")
            soak.wait_settled()

        # A node goes away under its pods: a disruption for every running job with a pod there.
        node = next(p.spec.node_name for p in soak.pods() if p.spec.node_name and p.status.phase == "Running")
        # A job is hit by a training pod there, or by its rendezvous store pod there while its training pods run.
        live = [p for p in soak.pods() if not p.metadata.deletion_timestamp and p.status.phase == "Running"]
        running = {p.metadata.labels[LABEL_JOB] for p in live if LABEL_INDEX in p.metadata.labels}
        on_node = [(p.metadata.labels[LABEL_JOB], LABEL_INDEX in p.metadata.labels) for p in live
                   if p.spec.node_name == node]  # fmt: skip
        hit = {job for job, training in on_node if training or job in running}
        soak.say(f"node {node} deleted under {sorted(hit)}")
        core.delete_node(node)
        for name in hit:
            lost = sum(job == name and training for job, training in on_node)
            if (name, False) in on_node or not lost:  # its store: a new gang whatever else was there
                soak.jobs[name].disruptions += 1
                soak.jobs[name].new_attempt()
            else:
                soak.jobs[name].lose_pods(lost, disruption=True)
        try:
            soak.wait_settled()
        finally:
            cluster.add_gpu_node(node)

        # Every job still running finishes; the failed ones stay failed.
        for exp in soak.jobs.values():
            if not exp.failed():
                for p in soak.live_pods(exp.name, exp.attempt):
                    soak._exit(p.metadata.name, 0)
                exp.phase = "Succeeded"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
            soak.status(e.name).get("phase") != e.phase for e in soak.jobs.values()
        ):
            time.sleep(0.5)
        for exp in soak.jobs.values():
            status = soak.status(exp.name)
            assert status.get("phase") == exp.phase and status.get("message"), (exp, status)
            assert status.get("restarts", 0) == exp.restarts, (exp, status)
            assert status.get("disruptions", 0) == exp.disruptions, (exp, status)
            assert status.get("podReplacements", 0) == exp.pod_replacements, (exp, status)
    finally:
        stop.set()
        sampler.join()
        if operator.proc.poll() is not None:
            operator.start()

    assert not soak.violations, "\n".join([*soak.violations[:20], "trace:", *soak.trace[-80:]])
    # No child outlives its job.
    for exp in soak.jobs.values():
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, exp.name)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and (
        soak.pods()
        or core.list_namespaced_config_map(namespace, label_selector=LABEL_JOB).items
        or core.list_namespaced_service(namespace, label_selector=LABEL_JOB).items
    ):
        time.sleep(0.5)
    assert not soak.pods(), "pods outlived their jobs"
    assert not core.list_namespaced_config_map(namespace, label_selector=LABEL_JOB).items
    assert not core.list_namespaced_service(namespace, label_selector=LABEL_JOB).items
    log = operator.log.read_text()[log_start:]
    assert "Traceback" not in log, log[log.index("Traceback") - 200 :][:3000]
