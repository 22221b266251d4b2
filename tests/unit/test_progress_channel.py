"""The one channel from trainer to status, end to end in one process: the trainer's reporter posts to the
operator's real HTTP app, which validates with the same contract model."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest

from localcluster import free_port
from sharded_operator import web
from sharded_trainer import __main__ as trainer_main
from sharded_trainer.contract import PodEnv, TrainerEventType
from sharded_trainer.reporting import ProgressReporter, ReportTarget

UID = "0b5e3c1e-6f7a-4d1e-9a51-3c2b9d8f7e10"


@pytest.fixture
def operator_app():
    """The operator's aiohttp app on loopback, in a thread with its own event loop."""
    store, metrics, port = web.ProgressStore(), web.Metrics(), free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def serve():
        runner = await web.start(web.make_app(metrics, store), "127.0.0.1", port)
        started.set()
        return runner

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    assert started.wait(10)
    yield store, metrics, f"http://127.0.0.1:{port}/progress"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def target(url: str) -> ReportTarget:
    return ReportTarget(url=url, uid=UID, namespace="team", name="llm", attempt=2)


def post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_progress_and_events_reach_the_operator_as_a_typed_report(operator_app, tmp_path):
    store, _, url = operator_app
    reporter = ProgressReporter(target(url), total_steps=100, path=str(tmp_path / "progress.json"))
    reporter.event(TrainerEventType.SETTING_CHOSEN, "backend auto: gloo on cpu")
    reporter.checkpoint_committed({"step": 10, "path": "/checkpoints/step-00000010", "time": "2026-11-30T12:00:00Z"})
    reporter.flush()
    reporter.update(step=12, loss=2.5, tokens_per_second=1000.0, mfu=None)
    reporter.flush()
    report = store.get(UID)
    assert report is not None and (report.name, report.attempt, report.step, report.loss) == ("llm", 2, 12, 2.5)
    assert report.last_checkpoint.step == 10
    assert [e.type for e in report.events] == [TrainerEventType.SETTING_CHOSEN, TrainerEventType.CHECKPOINT_COMMITTED]
    assert [e.seq for e in report.events] == [1, 2]
    local = json.loads((tmp_path / "progress.json").read_text())
    assert local["step"] == 12 and local["lastCheckpoint"]["step"] == 10 and "uid" not in local


def test_a_diverged_loss_is_left_out_rather_than_failing_training(operator_app):
    store, _, url = operator_app
    reporter = ProgressReporter(target(url), total_steps=100)
    reporter.update(step=3, loss=float("nan"), mfu=7.0, tokens_per_second=-1.0)  # each refused by the contract
    reporter.checkpoint_committed({"step": 3, "path": "/c/" + "x" * 2000, "time": "2026-11-30T12:00:00Z"})
    reporter.flush()
    report = store.get(UID)
    assert report.step == 3 and report.loss is None and report.mfu is None and report.tokens_per_second is None
    assert report.last_checkpoint is None and report.events[-1].type == TrainerEventType.CHECKPOINT_COMMITTED


@pytest.mark.parametrize(
    "body,field",
    [
        (b"not json", "json"),
        (json.dumps({"uid": UID, "step": 1}).encode(), "namespace"),
        (json.dumps({"uid": UID, "namespace": "n", "name": "j", "attempt": 1, "run": "r", "step": 1,
                     "updatedAt": "2026-11-30T12:00:00Z", "loss": "x"}).encode(), "loss"),
        (json.dumps({"uid": UID, "namespace": "n", "name": "j", "attempt": 1, "run": "r", "step": 1,
                     "updatedAt": 5}).encode(), "updatedAt"),
        (json.dumps({"uid": UID, "namespace": "n", "name": "j", "attempt": 1, "run": "r", "step": 1,
                     "updatedAt": "2026-11-30T12:00:00Z", "version": 9}).encode(), "version"),
    ],
    ids=["not-json", "missing-identity", "loss-not-a-number", "time-not-a-time", "unknown-version"],
)  # fmt: skip
def test_a_bad_report_is_refused_with_the_reason_and_stores_nothing(operator_app, body, field):
    store, _, url = operator_app
    code, answer = post(url, body)
    assert (code == 400 and field in answer["error"].lower()) or field in answer["error"], answer
    assert store.get(UID) is None


def test_a_trainer_of_another_contract_version_does_not_post(monkeypatch, capsys):
    monkeypatch.setenv(PodEnv.PROGRESS_URL, "http://op/progress")
    monkeypatch.setenv(PodEnv.JOB_UID, UID)
    monkeypatch.setenv(PodEnv.ATTEMPT, "2")
    monkeypatch.setenv(PodEnv.CONTRACT_VERSION, "1")
    assert trainer_main._report_target() == ReportTarget("http://op/progress", UID, "", "", 2)
    monkeypatch.setenv(PodEnv.CONTRACT_VERSION, "9")
    assert trainer_main._report_target() is None
    assert "reads progress reports of version 9" in capsys.readouterr().err


def test_a_report_skipped_while_one_is_in_flight_is_sent_by_flush():
    """Posts never queue up behind a slow operator, yet the final state and events still arrive."""
    import http.server
    import time

    bodies: list[dict] = []

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            time.sleep(0.3)
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reporter = ProgressReporter(target(f"http://127.0.0.1:{server.server_port}/progress"), total_steps=10)
        reporter.update(step=1)
        reporter.update(step=2)  # skipped: the first is in flight
        reporter.checkpoint_committed({"step": 2, "path": "/c/step-00000002", "time": "2026-11-30T12:00:00Z"})
        reporter.flush()
    finally:
        server.shutdown()
    assert [b["step"] for b in bodies] == [1, 2]
    assert bodies[-1]["events"][-1]["type"] == "CheckpointCommitted"
