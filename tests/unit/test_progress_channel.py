"""The trainer's side of the progress channel: what the reporter posts, with which token, how it keeps to
the operator's limits, and what it does with the operator's answer. (The operator's side, with real
tokens and TokenReviews, is tests/integration/test_progress_security.py.)"""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from sharded_api.contract import CONTRACT_VERSION, MAX_REPORT_BYTES, PodEnv, TrainerEventType
from sharded_trainer.reporting import progress as reporting
from sharded_trainer.reporting.progress import ProgressReporter, ReportTarget, target_from_env

UID = "0b5e3c1e-6f7a-4d1e-9a51-3c2b9d8f7e10"


class Operator:
    """A stand-in HTTP endpoint that records each post (headers and body) and answers like the operator."""

    def __init__(self, delay: float = 0.0, acknowledge: int | None = None):
        self.posts: list[tuple[dict, dict]] = []
        self.delay, self.acknowledge = delay, acknowledge
        # Answers before the next 200s, in order: an HTTP status, or None for a connection dropped unanswered.
        self.faults: list[int | None] = []
        self.tried: list[int] = []  # the step of every post, answered or not
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                time.sleep(outer.delay)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.tried.append(body["step"])
                if outer.faults:
                    fault = outer.faults.pop(0)
                    if fault is None:
                        self.close_connection = True
                        return
                    self.send_error(fault, "not now")
                    return
                outer.posts.append((dict(self.headers), body))
                answer = json.dumps({"acknowledged": outer.acknowledge or 0, "written": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/progress"

    def bodies(self) -> list[dict]:
        return [b for _, b in self.posts]


@pytest.fixture
def operator() -> Iterator[Operator]:
    op = Operator()
    threading.Thread(target=op.server.serve_forever, daemon=True).start()
    yield op
    op.server.shutdown()


@pytest.fixture(autouse=True)
def no_interval(monkeypatch):
    monkeypatch.setattr(reporting, "MIN_INTERVAL", 0.0)


def target(url: str, token_file=None) -> ReportTarget:
    return ReportTarget(url=url, uid=UID, namespace="team", name="llm", attempt=2, token_file=token_file)


def test_progress_and_events_reach_the_operator_as_a_typed_report_with_the_pods_token(operator, tmp_path):
    token = tmp_path / "token"
    token.write_text("first-token\n")
    reporter = ProgressReporter(target(operator.url, str(token)), total_steps=100, path=str(tmp_path / "p.json"))
    reporter.event(TrainerEventType.SETTING_CHOSEN, "backend auto: gloo on cpu")
    reporter.checkpoint_committed({"step": 10, "path": "/checkpoints/step-00000010", "time": "2026-11-30T12:00:00Z"})
    reporter.flush()
    token.write_text("rotated-token")  # the kubelet rotates it: every post reads it anew
    reporter.update(step=12, loss=2.5, tokens_per_second=1000.0, mfu=None)
    reporter.flush()
    headers, report = operator.posts[-1]
    assert headers["Authorization"] == "Bearer rotated-token"
    assert operator.posts[0][0]["Authorization"] == "Bearer first-token"
    assert (report["name"], report["attempt"], report["step"], report["loss"]) == ("llm", 2, 12, 2.5)
    assert report["lastCheckpoint"]["step"] == 10
    assert [e["type"] for e in report["events"]] == ["SettingChosen", "CheckpointCommitted"]
    local = json.loads((tmp_path / "p.json").read_text())
    assert local["step"] == 12 and local["lastCheckpoint"]["step"] == 10 and "uid" not in local


def test_events_the_operator_acknowledged_are_not_sent_again(operator):
    operator.acknowledge = 2
    reporter = ProgressReporter(target(operator.url), total_steps=10)
    reporter.event(TrainerEventType.SETTING_CHOSEN, "one")
    reporter.event(TrainerEventType.RESUMED, "two")
    reporter.update(step=1)
    reporter.flush()
    reporter.event(TrainerEventType.CHECKPOINT_COMMITTED, "three")
    reporter.update(step=2)
    reporter.flush()
    assert [e["seq"] for e in operator.bodies()[-1]["events"]] == [3]


def test_a_report_stays_within_the_operators_limit_by_leaving_out_the_oldest_events(operator):
    reporter = ProgressReporter(target(operator.url), total_steps=10)
    for i in range(32):
        big = {"step": i, "path": "/" + "p" * 900}
        reporter.event(TrainerEventType.CHECKPOINT_COMMITTED, "m" * 1000, checkpoint=big)
    reporter.update(step=1)
    reporter.flush()
    body = operator.bodies()[-1]
    size = len(json.dumps(body, separators=(",", ":")))
    assert size <= MAX_REPORT_BYTES and body["events"][-1]["seq"] == 32 and len(body["events"]) < 32


def test_a_diverged_loss_is_left_out_rather_than_failing_training(operator):
    reporter = ProgressReporter(target(operator.url), total_steps=100)
    reporter.update(step=3, loss=float("nan"), mfu=7.0, tokens_per_second=-1.0)  # each refused by the contract
    reporter.checkpoint_committed({"step": 3, "path": "/c/" + "x" * 2000, "time": "2026-11-30T12:00:00Z"})
    reporter.flush()
    report = operator.bodies()[-1]
    assert report["step"] == 3 and not {"loss", "mfu", "tokensPerSecond", "lastCheckpoint"} & set(report)
    assert report["events"][-1]["type"] == "CheckpointCommitted"


def test_posts_keep_an_interval_and_flush_sends_the_newest(operator, monkeypatch):
    monkeypatch.setattr(reporting, "MIN_INTERVAL", 60.0)
    reporter = ProgressReporter(target(operator.url), total_steps=10)
    for step in range(1, 6):
        reporter.update(step=step)
    reporter.flush()
    assert [b["step"] for b in operator.bodies()] == [1, 5]


def test_a_report_skipped_while_one_is_in_flight_is_sent_by_flush(operator):
    """Posts never queue up behind a slow operator, yet the final state and events still arrive."""
    operator.delay = 0.3
    reporter = ProgressReporter(target(operator.url), total_steps=10)
    reporter.update(step=1)
    reporter.update(step=2)  # skipped: the first is in flight
    reporter.checkpoint_committed({"step": 2, "path": "/c/step-00000002", "time": "2026-11-30T12:00:00Z"})
    reporter.flush()
    assert [b["step"] for b in operator.bodies()] == [1, 2]
    assert operator.bodies()[-1]["events"][-1]["type"] == "CheckpointCommitted"


def test_a_final_report_whose_post_failed_is_sent_again_until_the_operator_takes_it(operator):
    """The last report's post dropped unanswered (the operator away, or too slow for the post's timeout),
    then shed with 503 and rate-limited with 429: the flush sends it again until it is taken."""
    operator.faults = [None, 503, 429]
    reporter = ProgressReporter(target(operator.url), total_steps=10)
    reporter.update(step=10)  # in flight on its own thread: its post is the one dropped
    reporter.flush(seconds=30)
    assert operator.tried == [10, 10, 10, 10] and [b["step"] for b in operator.bodies()] == [10]
    reporter.flush(seconds=30)  # taken: nothing is sent again
    assert len(operator.tried) == 4


def test_a_refused_report_is_not_sent_again_and_an_absent_operator_costs_the_flush_its_bound(operator, capsys):
    operator.faults = [403]
    reporter = ProgressReporter(target(operator.url), total_steps=10)
    reporter.update(step=3)
    reporter.flush(seconds=30)
    assert operator.tried == [3] and "refused" in capsys.readouterr().err  # sending it again changes nothing
    operator.faults = [None] * 1000
    reporter.update(step=4)
    reporter.flush(seconds=1)
    assert operator.tried.count(4) >= 2 and not operator.bodies()
    assert "the last progress report did not reach" in capsys.readouterr().err


def test_the_pod_environment_names_the_target_and_its_token(monkeypatch, capsys):
    monkeypatch.setenv(PodEnv.PROGRESS_URL, "http://op/progress")
    monkeypatch.setenv(PodEnv.JOB_UID, UID)
    monkeypatch.setenv(PodEnv.ATTEMPT, "2")
    monkeypatch.setenv(PodEnv.CONTRACT_VERSION, str(CONTRACT_VERSION))
    monkeypatch.setenv(PodEnv.PROGRESS_TOKEN_FILE, "/var/run/token")
    assert target_from_env() == ReportTarget("http://op/progress", UID, "", "", 2, "/var/run/token")
    monkeypatch.setenv(PodEnv.CONTRACT_VERSION, "9")
    assert target_from_env() is None
    assert "reads progress reports of version 9" in capsys.readouterr().err
