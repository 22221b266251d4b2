"""Progress reports against the real API server: bound ServiceAccount tokens minted by TokenRequest (the
test plays the kubelet for KWOK's pods), verified by the operator offline against the issuer keys; every forgery refused
and nothing changed; rate limits; memory that junk cannot grow."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import wait_for
from sharded_api.contract import MAX_REPORT_BYTES
from sharded_operator.api.models import GROUP, PLURAL, VERSION
from support.jobs import make_job
from support.reports import mint, post

pytestmark = pytest.mark.integration
CKPT = {"step": 30, "path": "/checkpoints/step-00000030", "time": "2026-01-01T00:00:00Z"}


class Job:
    def __init__(self, core, custom, namespace: str, name: str = "j", **spec):
        self.core, self.custom, self.ns, self.name = core, custom, namespace, name
        builder = make_job(name).nodes(2).gpus(4).spec("failurePolicy.backoffLimit", 3)
        for path, value in spec.items():
            builder = builder.spec(path.replace("__", "."), value)
        body = builder.obj()
        body["metadata"] = {"name": name}
        self.uid = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)["metadata"]["uid"]

    def status(self) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name).get("status") or {}

    def running_pods(self, attempt: int = 1) -> list:
        def ready():
            pods = [p for p in self.core.list_namespaced_pod(self.ns).items
                    if p.metadata.name.startswith(f"{self.name}-") and p.status.phase == "Running"
                    and p.metadata.labels.get("training.sharded.dev/attempt") == str(attempt)
                    and not p.metadata.deletion_timestamp]  # fmt: skip
            return len(pods) == 2 and self.status().get("attempt") == attempt and pods

        return wait_for(ready, timeout=60, what=f"attempt {attempt} running")

    def report(self, **fields) -> dict:
        base = {"uid": self.uid, "namespace": self.ns, "name": self.name, "attempt": 1, "run": "r1", "step": 40,
                "totalSteps": 100, "loss": 2.25, "updatedAt": "2026-01-01T00:00:00Z"}  # fmt: skip
        return {**base, **fields}


def events_named(core, namespace: str, reason: str) -> list:
    return [e for e in core.list_namespaced_event(namespace).items if e.reason == reason]


def test_a_report_from_a_pod_of_the_current_attempt_reaches_status_and_its_events_once(core, custom, namespace,
                                                                                        operator):  # fmt: skip
    job = Job(core, custom, namespace)
    pod = job.running_pods()[1]  # rank 0 may run in any pod of the attempt
    token = mint(core, namespace, pod)
    event = {"seq": 1, "type": "CheckpointCommitted", "message": "checkpoint at step 30 committed", "step": 30,
             "checkpoint": CKPT, "time": "2026-01-01T00:00:00Z"}  # fmt: skip
    code, answer = post(operator, job.report(lastCheckpoint=CKPT, events=[event]), token)
    assert code == 200, answer
    status = wait_for(lambda: (s := job.status()).get("progress", {}).get("step") == 40 and s, what="progress")
    assert status["progress"]["loss"] == 2.25 and status["lastCheckpoint"] == CKPT
    assert status["lastTrainerEvent"] == {"attempt": 1, "run": "r1", "seq": 1}
    wait_for(lambda: events_named(core, namespace, "CheckpointCommitted"), what="the CheckpointCommitted event")
    # Sent again with the next report (not yet acknowledged to the trainer): still one event; now acknowledged.
    time.sleep(1.1)  # past progressWriteSeconds (1 s here)
    code, answer = post(operator, job.report(step=41, lastCheckpoint=CKPT, events=[event]), token)
    assert code == 200 and answer["acknowledged"] == 1, answer
    wait_for(lambda: job.status().get("progress", {}).get("step") == 41, what="the next report")
    assert len(events_named(core, namespace, "CheckpointCommitted")) == 1


def test_every_forged_or_malformed_report_is_refused_and_changes_nothing(core, custom, namespace, operator):
    job = Job(core, custom, namespace)
    other = Job(core, custom, namespace, "k")
    pod, other_pod = job.running_pods()[0], other.running_pods()[0]
    token = mint(core, namespace, pod)
    assert post(operator, job.report(step=10), token)[0] == 200
    wait_for(lambda: job.status().get("progress", {}).get("step") == 10, what="the first report")
    time.sleep(1.1)

    big = job.report(events=[{"seq": i, "type": "Resumed", "message": "m" * 1000, "time": "2026-01-01T00:00:00Z"}
                             for i in range(1, 20)])  # fmt: skip
    cases = {
        "no token": (job.report(), None, 401),
        "junk token": (job.report(), "junk.junk.junk", 401),
        "an API token, not for the operator": (job.report(), mint(core, namespace, pod, "https://kubernetes.default.svc"),
                                               401),
        "a pod of another job": (job.report(), mint(core, namespace, other_pod), 403),
        "another job's report with this pod's token": (other.report(), token, 403),
        "another namespace": (job.report(namespace="kube-system"), token, 403),
        "an attempt the pod is not of": (job.report(attempt=2), token, 403),
        "loss not a number": (job.report(loss="x"), token, 422),
        "time not a time": (job.report(updatedAt=5), token, 422),
        "step out of range": (job.report(step=-1), token, 422),
        "a forged checkpoint field": (job.report(lastCheckpoint={**CKPT, "forged": 1}), token, 422),
        "oversized": (json.dumps(big).encode() + b" " * MAX_REPORT_BYTES, token, 413),
    }  # fmt: skip
    for what, (body, tok, expected) in cases.items():
        code, answer = post(operator, body, tok)
        assert code == expected, (what, code, answer)
        assert "error" in answer, what
    status = job.status()
    assert status["progress"]["step"] == 10 and status["phase"] == "Running"

    # The job restarts: the old attempt's pod is gone, and its token, replayed, says nothing any more (the API
    # server voids a token whose bound pod is gone; until then the operator's own checks refuse it).
    core.patch_namespaced_pod(pod.metadata.name, namespace,
                              {"metadata": {"annotations": {"kwok.sharded.dev/exit-code": "1"}}})  # fmt: skip
    job.running_pods(attempt=2)
    code, answer = post(operator, job.report(step=99), token)
    assert code in (401, 403) and any(w in answer["error"] for w in ("token", "gone", "attempt")), answer
    assert post(operator, job.report(step=99, attempt=2), token)[0] in (401, 403)
    assert job.status()["progress"]["step"] == 10


def test_reports_beyond_a_pods_rate_are_refused(core, custom, namespace, operator):
    job = Job(core, custom, namespace)
    token = mint(core, namespace, job.running_pods()[0])
    codes = [post(operator, job.report(step=i), token)[0] for i in range(1, 31)]
    assert codes[0] == 200 and 429 in codes, codes


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_ten_thousand_junk_posts_leave_the_operators_memory_where_it_was(operator):
    uid = "0b5e3c1e-6f7a-4d1e-9a51-3c2b9d8f7e10"

    def junk(i: int) -> int:
        body = {"uid": f"{uid[:-6]}{i:06d}", "namespace": f"ns{i}", "name": f"job-{i}", "attempt": 1,
                "run": "r", "step": i, "updatedAt": "2026-01-01T00:00:00Z", "events": []}  # fmt: skip
        token = None if i % 3 == 0 else (f"{i}.eyJ4Ijo{i}.sig" if i % 3 == 1 else "a" * 4000)
        return post(operator, body, token)[0]

    for i in range(200):  # warm up: the first requests allocate what every later one reuses
        junk(i)
    before = rss_kib(operator.proc.pid)
    with ThreadPoolExecutor(8) as pool:
        codes = set(pool.map(junk, range(10_000)))
    after = rss_kib(operator.proc.pid)
    assert codes == {401}
    assert after - before < 20 * 1024, f"RSS grew by {(after - before) / 1024:.1f} MiB"
    assert os.kill(operator.proc.pid, 0) is None  # and it is still there


def api_requests(operator, resource: str) -> float:
    """The operator's own count of requests it sent to the API server for `resource` (all methods)."""
    import urllib.request

    with urllib.request.urlopen(f"{operator.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sharded_api_requests_total{") and f'resource="{resource}"' in line)  # fmt: skip


def forge(real: str, i: int) -> str:
    """A token with the real one's header and plausible claims (another pod, a fresh expiry) and a garbage
    signature: what the TokenReview pre-check once let through."""
    import base64

    header, payload, _ = real.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["kubernetes.io"]["pod"] = {"name": f"forged-{i}", "uid": f"00000000-0000-0000-0000-{i:012d}"}
    claims["exp"] = int(time.time()) + 3600
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{header}.{body}.{base64.urlsafe_b64encode(os.urandom(256)).rstrip(b'=').decode()}"


def test_a_flood_of_forged_tokens_costs_no_api_call_and_a_real_pod_keeps_reporting(core, custom, namespace,
                                                                                   operator):  # fmt: skip
    """Thousands of distinct forged tokens once spent the shared TokenReview budget in a second, and the next
    real report got 429 until healthy jobs were restarted as hung. Verified offline, they cost nothing."""
    job = Job(core, custom, namespace)
    real = mint(core, namespace, job.running_pods()[0])
    assert post(operator, job.report(step=1), real)[0] == 200
    reviews = api_requests(operator, "tokenreviews")
    deadline, codes, stop = time.monotonic() + 12, set(), False

    def flood(worker: int) -> set:
        seen, i = set(), worker * 1_000_000
        while not stop and time.monotonic() < deadline:  # bounded in time, loopback only
            seen.add(post(operator, job.report(step=7), forge(real, i))[0])
            i += 1
        return seen

    with ThreadPoolExecutor(6) as pool:
        floods = [pool.submit(flood, w) for w in range(6)]
        step, lags = 1, []
        try:
            while time.monotonic() < deadline - 3:
                step += 1
                sent = time.monotonic()
                code, answer = post(operator, job.report(step=step), real)
                assert code == 200, (step, code, answer)
                # Within 2 x progressWriteSeconds (1 s here) the report is in status.
                wait_for(lambda s=step: job.status().get("progress", {}).get("step") == s, timeout=2,
                         interval=0.05, what=f"report {step} in status during the flood")  # fmt: skip
                lags.append(time.monotonic() - sent)
                time.sleep(0.5)
        finally:
            stop = True
        for f in floods:
            codes |= f.result()
    assert codes == {401}, codes
    assert len(lags) >= 5, lags
    assert api_requests(operator, "tokenreviews") == reviews  # no forged token reached the API server
    status = job.status()
    assert status["phase"] == "Running" and status.get("attempt") == 1 and status["progress"]["step"] == step


def test_a_healthy_job_outlives_an_operator_outage_longer_than_its_hang_timeout(core, custom, namespace, operator):
    """The operator away for 2 x hangTimeoutSeconds: status says the last report was heard that long ago, yet
    the gang was training all along (its reports failed to reach anyone). Back, the operator counts the
    silence only from when it could hear again: the next report lands, nothing restarts."""
    job = Job(core, custom, namespace, failurePolicy__hangTimeoutSeconds=60)
    token = mint(core, namespace, job.running_pods()[0])
    assert post(operator, job.report(), token)[0] == 200
    wait_for(lambda: job.status().get("progress", {}).get("step") == 40, what="progress")
    operator.kill()
    try:
        progress = job.status()["progress"]
        long_ago = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 2 * 60 - 10))
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, job.name, {"status": {"progress": {**progress, "observedAt": long_ago}}}
        )  # what status says after an outage of 2 x hangTimeout
    finally:
        operator.start()
    time.sleep(5)  # the first reconciles after the start have run
    wait_for(lambda: post(operator, job.report(step=41), token)[0] == 200, what="the next report taken")
    status = wait_for(lambda: (s := job.status()).get("progress", {}).get("step") == 41 and s, what="the report")
    assert (status["attempt"], status.get("restarts", 0), status.get("lastFailure")) == (1, 0, None), status
