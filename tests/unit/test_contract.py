"""The contract between operator and trainer: one home for every shared name, and a bounded progress report."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from sharded_api import contract
from sharded_api.contract import (
    MAX_EVENTS,
    PodEnv,
    ProgressReport,
    TrainerEventType,
    UserEnv,
    WorkerEnv,
    iso,
    parse_iso,
    parse_step_dir,
    step_dir_name,
)
from sharded_operator.render import podspec
from sharded_operator.settings import OperatorSettings
from support.jobs import make_job

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["api", "operator", "trainer", "hack", "bench"]


# --- one home for every name ----------------------------------------------------------------------

# Names distinctive enough to find inside any string (an f-string's text, a message, a path).
WORD_NAMES = sorted(
    {e.value for e in PodEnv}
    | {e.value for e in WorkerEnv}
    | {e.value for e in UserEnv}
    | {contract.RESERVED_ENV_PREFIX, contract.MARKER, contract.TRAINER_STATE, contract.CONFIG_FILE, contract.CONFIG_DIR}
)
# Names that are also ordinary words or keys elsewhere: a string that is exactly one of them is a stray.
EXACT_NAMES = sorted(
    {e.value for e in TrainerEventType}
    | {contract.STEP_DIR_PREFIX, contract.DEFAULT_CONFIG_PATH}
    | {f.alias for f in ProgressReport.model_fields.values() if f.alias and f.alias != f.alias.lower()}
)


def string_literals(path: Path):
    """(line, text) of every string constant in a module, docstrings left out (prose may name things)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_no_module_but_the_contract_writes_a_contract_name():
    stray = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "contract.py":
                continue
            for line, text in string_literals(path):
                hits = [n for n in WORD_NAMES if re.search(rf"(?<![\w]){re.escape(n)}(?![\w])", text)]
                hits += [n for n in EXACT_NAMES if text == n]
                stray += [f"{path.relative_to(ROOT)}:{line}: {n!r}" for n in hits]
    assert not stray, "write these through sharded_api.contract instead:\n" + "\n".join(stray)


def test_the_scan_finds_a_planted_stray(tmp_path):
    """The scanner itself: a literal env name, marker or event type in code is found; docstrings are not."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        '"""Mentions SHARDED_JOB_UID in prose."""\n'
        'import os\nuid = os.environ["SHARDED_JOB_UID"]\nmarker = f"{uid}/COMMITTED"\nkind = "ResumedFromCheckpoint"\n'
    )
    texts = [t for _, t in string_literals(planted)]
    assert "SHARDED_JOB_UID" in texts and "ResumedFromCheckpoint" in texts
    assert any("COMMITTED" in t for t in texts)
    assert "Mentions SHARDED_JOB_UID in prose." not in texts


def test_every_pod_variable_the_trainer_reads_is_set_by_the_operator():
    settings = OperatorSettings(progress_url="http://op:8080/progress")
    pod = podspec.build_pod(make_job("llm").nodes(2).model(), 1, 3, settings)
    names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    # EXIT_DIR is the launcher's, for its own workers; WORKER_START a user's choice (spec.pod.env), which
    # the launcher defaults to forkserver.
    assert {e.value for e in PodEnv} - {PodEnv.EXIT_DIR.value, PodEnv.WORKER_START.value} <= names
    assert not contract.is_reserved_env(PodEnv.WORKER_START) and PodEnv.WORKER_START not in names
    assert not names & {e.value for e in WorkerEnv} - {PodEnv.MASTER_ADDR.value}, "torchrun sets these per worker"


def test_reserved_names_cover_torchrun_and_the_rendezvous():
    assert contract.is_reserved_env("PET_ANYTHING") and contract.is_reserved_env("WORLD_SIZE")
    assert contract.is_reserved_env(PodEnv.MASTER_ADDR) and not contract.is_reserved_env("NCCL_DEBUG")


def test_checkpoint_directory_names_round_trip():
    assert step_dir_name(40) == "step-00000040" and parse_step_dir("step-00000040") == 40
    for other in ("step-40", "step-000000400", "tmp-00000040", "step-0000004a"):
        assert parse_step_dir(other) is None


def test_time_round_trips_at_second_precision():
    t = parse_iso("2026-11-30T12:00:05Z")
    assert iso(t) == "2026-11-30T12:00:05Z" and parse_iso(None) is None


# --- the progress report ---------------------------------------------------------------------------

GOOD = {
    "version": 1, "uid": "0b5e3c1e-6f7a-4d1e-9a51-3c2b9d8f7e10", "namespace": "team", "name": "llm", "attempt": 2,
    "run": "a1b2c3d4e5f6", "step": 40, "totalSteps": 100, "loss": 2.5, "tokensPerSecond": 51234.5, "mfu": 0.41,
    "updatedAt": "2026-11-30T12:00:05Z",
    "lastCheckpoint": {"step": 40, "path": "/checkpoints/step-00000040", "time": "2026-11-30T12:00:04Z"},
    "events": [
        {
            "seq": 1, "type": "ResumedFromCheckpoint", "message": "resumed at step 30", "step": 30,
            "time": "2026-11-30T11:59:00Z",
        },
    ],
}  # fmt: skip


def test_a_good_report_round_trips_through_json():
    report = ProgressReport.model_validate_json(json.dumps(GOOD))
    assert json.loads(report.model_dump_json(by_alias=True, exclude_none=True)) == GOOD


@pytest.mark.parametrize(
    "change,field",
    [
        ({"loss": "x"}, "loss"),
        ({"loss": float("nan")}, "loss"),
        ({"loss": float("inf")}, "loss"),
        ({"loss": 1e300}, "loss"),
        ({"updatedAt": 5}, "updatedAt"),
        ({"updatedAt": "yesterday"}, "updatedAt"),
        ({"step": -1}, "step"),
        ({"step": 10**12}, "step"),
        ({"mfu": 3.0}, "mfu"),
        ({"version": 2, "mfu6n": 1.5}, "mfu6n"),
        ({"version": 2, "mfu6n": -0.1}, "mfu6n"),
        ({"version": 2, "mfu6n": float("nan")}, "mfu6n"),
        ({"version": 2, "mfu6n": "high"}, "mfu6n"),
        ({"tokensPerSecond": -1}, "tokensPerSecond"),
        ({"uid": "x" * 65}, "uid"),
        ({"uid": "a/b"}, "uid"),
        ({"name": "n" * 300}, "name"),
        ({"attempt": -1}, "attempt"),
        ({"lastCheckpoint": {"step": 1, "path": "p" * 2000}}, "lastCheckpoint.path"),
        ({"lastCheckpoint": {"step": 1, "path": "/c", "forged": True}}, "lastCheckpoint.forged"),
        ({"extra": 1}, "extra"),
        ({"version": 4}, "version"),
        ({"version": 3, "rewardAccuracy": 1.5}, "rewardAccuracy"),
        ({"version": 3, "rewardAccuracy": float("nan")}, "rewardAccuracy"),
        ({"version": 3, "rewardMargin": 1e300}, "rewardMargin"),
        ({"version": 3, "chosenReward": float("inf")}, "chosenReward"),
        ({"version": 3, "rejectedReward": "low"}, "rejectedReward"),
        ({"events": [GOOD["events"][0]] * (MAX_EVENTS + 1)}, "events"),
        ({"events": [{**GOOD["events"][0], "type": "Exploded"}]}, "events.0.type"),
        ({"events": [{**GOOD["events"][0], "message": "m" * 2000}]}, "events.0.message"),
        ({"events": [{**GOOD["events"][0], "seq": 0}]}, "events.0.seq"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_bad_report_is_refused_naming_the_field(change, field):
    body = json.dumps({**GOOD, **change}, allow_nan=True)
    with pytest.raises(ValidationError) as exc:
        ProgressReport.model_validate_json(body)
    located = {".".join(str(p) for p in e["loc"]) for e in exc.value.errors()}
    assert field in located, located


def test_a_report_of_the_previous_version_is_still_read_and_the_6n_mfu_travels_beside_the_other():
    """Version 1 reports (trainers of the previous release) are read; version 2 adds mfu6n."""
    assert ProgressReport.model_validate(GOOD).version == 1
    report = ProgressReport.model_validate({**GOOD, "version": 2, "mfu6n": 0.5})
    assert (report.mfu, report.mfu_6n) == (0.41, 0.5) and report.model_dump(by_alias=True)["mfu6n"] == 0.5


def test_a_version_3_report_carries_the_preference_rewards():
    rewards = {"rewardAccuracy": 0.75, "rewardMargin": 0.4, "chosenReward": 0.3, "rejectedReward": -0.1}
    report = ProgressReport.model_validate({**GOOD, "version": 3, **rewards})
    assert (report.reward_accuracy, report.reward_margin, report.chosen_reward) == (0.75, 0.4, 0.3)
    assert {k: v for k, v in report.model_dump(by_alias=True).items() if k in rewards} == rewards


def test_another_contract_version_is_refused_with_what_this_release_reads():
    with pytest.raises(ValidationError) as exc:
        ProgressReport.model_validate({**GOOD, "version": 4})
    assert "reads [1, 2, 3]" in str(exc.value)


def test_times_in_either_spelling_parse_to_the_same_instant():
    assert parse_iso("2026-11-30T12:00:05+00:00") == parse_iso("2026-11-30T12:00:05Z")
    assert iso(parse_iso("2026-11-30T13:00:05+01:00")) == "2026-11-30T12:00:05Z"
