"""Per-job training metrics for Prometheus: what each job's status says, one series per job and metric.

Labels are `namespace` and `job_name` only (and `phase` for the phase gauge, seven values), and at most
`limit` jobs are exported: past it, a finished job's series make room for a new one, and when every
exported job is still live the new job is left out and counted in `sharded_training_jobs_not_exported`.
An update is O(1) (the job's row is replaced); the work is done at scrape time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sharded_api.contract import parse_iso
from sharded_operator.api.status import FINISHED, Phase, Progress, ShardedTrainingJobStatus

PREFIX = "sharded_training_"
# `job_name`, not `job`: Prometheus gives `job` to the scrape job (as kube-state-metrics, which says job_name).
LABELS = ["namespace", "job_name"]
# The gauges, each labelled (namespace, job): the numbers of the progress rank 0 reports (the contract's
# StepProgress, as status.progress holds them), the newest checkpoint's, and the status' own counters, each
# named after its field and described as the status model describes it.
PROGRESS_GAUGES = (
    "step", "total_steps", "loss", "eval_loss", "tokens_per_second", "mfu", "mfu_6n", "global_batch_size",
    "reward_accuracy", "reward_margin",
)  # fmt: skip
STATUS_GAUGES = (
    "restarts", "disruptions", "in_place_restarts", "pod_replacements", "current_nodes", "desired_nodes", "attempt",
)  # fmt: skip
GAUGES = {
    **{n: Progress.model_fields[n].description or n for n in PROGRESS_GAUGES},
    "checkpoint_step": "Step of the newest complete checkpoint",
    "checkpoint_age_seconds": "Seconds since the newest complete checkpoint was committed",
    **{n: ShardedTrainingJobStatus.model_fields[n].description or n for n in STATUS_GAUGES},
}
PHASE_METRIC = PREFIX + "phase"
NOT_EXPORTED = PREFIX + "jobs_not_exported"
METRIC_NAMES = (*(PREFIX + g for g in GAUGES), PHASE_METRIC, NOT_EXPORTED)


@dataclass
class Row:
    namespace: str
    job: str
    phase: str | None
    values: dict[str, float | None]
    checkpoint_time: float | None


def row_of(namespace: str, job: str, status: ShardedTrainingJobStatus) -> Row:
    p, ckpt = status.progress, status.last_checkpoint
    values: dict[str, float | None] = {n: p and getattr(p, n) for n in PROGRESS_GAUGES}
    values |= {n: getattr(status, n) for n in STATUS_GAUGES}
    values["checkpoint_step"] = ckpt and ckpt.step
    when = parse_iso(ckpt.time) if ckpt is not None and ckpt.time else None
    return Row(namespace, job, status.phase, values, when.timestamp() if when else None)


class JobSeries(Collector):
    """The rows of the exported jobs, by UID, turned into metric families when Prometheus scrapes."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.time):
        self.limit, self.clock = limit, clock
        self.rows: OrderedDict[str, Row] = OrderedDict()
        self.left_out: set[str] = set()

    def update(self, uid: str, namespace: str, job: str, status: ShardedTrainingJobStatus) -> None:
        if uid not in self.rows and len(self.rows) >= self.limit and not self._make_room():
            self.left_out.add(uid)
            return
        self.left_out.discard(uid)
        self.rows[uid] = row_of(namespace, job, status)

    def forget(self, uid: str) -> None:
        self.rows.pop(uid, None)
        self.left_out.discard(uid)

    def _make_room(self) -> bool:
        # The oldest finished job gives way: a live job's series matter more than a finished one's last values.
        victim = next((uid for uid, r in self.rows.items() if r.phase in FINISHED), None)
        if victim is None:
            return False
        del self.rows[victim]
        return True

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.clock()
        families = {g: GaugeMetricFamily(PREFIX + g, help_, labels=LABELS) for g, help_ in GAUGES.items()}
        phases = GaugeMetricFamily(
            PHASE_METRIC, "1 for the job's current phase, 0 for the others", labels=[*LABELS, "phase"]
        )
        for r in list(self.rows.values()):
            labels = [r.namespace, r.job]
            for g, value in r.values.items():
                if value is not None:
                    families[g].add_metric(labels, float(value))
            if r.checkpoint_time is not None:
                families["checkpoint_age_seconds"].add_metric(labels, max(0.0, now - r.checkpoint_time))
            for p in Phase:
                phases.add_metric([*labels, p.value], 1.0 if r.phase == p.value else 0.0)
        yield from families.values()
        yield phases
        yield GaugeMetricFamily(NOT_EXPORTED, "Jobs left out of the per-job series by the limit", len(self.left_out))
