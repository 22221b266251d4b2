"""Per-job training metrics as Prometheus reads them: values from the status, the checkpoint's age at
scrape time, a bounded number of series, O(1) phase counts."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sharded_operator.api.status import ShardedTrainingJobStatus
from sharded_operator.run.jobmetrics import METRIC_NAMES
from sharded_operator.run.web import Metrics

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def status(phase="Running", step=40, ckpt_time="2027-01-15T07:59:00Z", **extra) -> ShardedTrainingJobStatus:
    return ShardedTrainingJobStatus.model_validate({
        "phase": phase, "attempt": 2, "restarts": 1, "disruptions": 3, "inPlaceRestarts": 4, "podReplacements": 5,
        "currentNodes": 3, "desiredNodes": 4,
        "progress": {"step": step, "totalSteps": 100, "loss": 2.5, "tokensPerSecond": 1e5, "mfu": 0.41},
        "lastCheckpoint": {"step": 40, "path": "step-40", "time": ckpt_time}, **extra,
    })  # fmt: skip


def scrape(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metrics(limit=1000) -> Metrics:
    m = Metrics(limit)
    m.jobs.clock = lambda: T0
    return m


def test_a_jobs_status_becomes_its_series():
    m = metrics()
    m.jobs.update("u1", "team-a", "llama", status())
    got = scrape(m)
    job = (("job_name", "llama"), ("namespace", "team-a"))
    assert got[("sharded_training_step", job)] == 40 and got[("sharded_training_total_steps", job)] == 100
    assert got[("sharded_training_loss", job)] == 2.5 and got[("sharded_training_mfu", job)] == 0.41
    assert got[("sharded_training_tokens_per_second", job)] == 1e5
    assert got[("sharded_training_checkpoint_step", job)] == 40
    assert got[("sharded_training_checkpoint_age_seconds", job)] == 60  # committed a minute before the scrape
    assert (got[("sharded_training_restarts", job)], got[("sharded_training_disruptions", job)]) == (1, 3)
    assert got[("sharded_training_in_place_restarts", job)] == 4
    assert got[("sharded_training_pod_replacements", job)] == 5
    assert (got[("sharded_training_current_nodes", job)], got[("sharded_training_desired_nodes", job)]) == (3, 4)
    phases = {dict(k[1])["phase"]: v for k, v in got.items() if k[0] == "sharded_training_phase"}
    assert phases["Running"] == 1 and sum(phases.values()) == 1 and len(phases) == 7
    assert {name for name, _ in got} <= {*METRIC_NAMES, *(n for n, _ in scrape(Metrics()))}


def test_a_job_without_progress_or_checkpoint_exports_no_made_up_zeros():
    m = metrics()
    m.jobs.update("u1", "a", "fresh", ShardedTrainingJobStatus.model_validate({"phase": "Pending"}))
    names = {name for name, labels in scrape(m) if ("job_name", "fresh") in labels}
    assert "sharded_training_step" not in names and "sharded_training_checkpoint_age_seconds" not in names
    assert {"sharded_training_restarts", "sharded_training_phase"} <= names


def test_the_series_are_bounded_finished_jobs_give_way_and_live_ones_are_counted():
    m = metrics(limit=2)
    m.jobs.update("done", "a", "done", status(phase="Succeeded"))
    m.jobs.update("live", "a", "live", status())
    m.jobs.update("new", "a", "new", status())  # the finished job makes room
    jobs = {dict(labels)["job_name"] for name, labels in scrape(m) if name == "sharded_training_step"}
    assert jobs == {"live", "new"}
    m.jobs.update("more", "a", "more", status())  # every exported job is live: left out, and counted
    got = scrape(m)
    assert got[("sharded_training_jobs_not_exported", ())] == 1
    assert not any(("job_name", "more") in labels for _, labels in got)
    m.jobs.forget("live")  # deleted: its series go, and the next update of the left-out job takes the room
    m.jobs.update("more", "a", "more", status())
    got = scrape(m)
    assert got[("sharded_training_jobs_not_exported", ())] == 0
    assert {dict(labels)["job_name"] for name, labels in got if name == "sharded_training_step"} == {"new", "more"}


def test_phase_counts_follow_each_job_without_recounting():
    m = Metrics()
    m.observe_phase("a", "Running")
    m.observe_phase("b", "Running")
    m.observe_phase("a", "Succeeded")
    m.observe_phase("a", "Succeeded")  # no change: no double count
    m.observe_phase("b", None)  # deleted
    got = scrape(m)
    assert got[("sharded_jobs", (("phase", "Running"),))] == 0
    assert got[("sharded_jobs", (("phase", "Succeeded"),))] == 1
    assert got[("sharded_jobs", (("phase", "Failed"),))] == 0
