"""How the launcher has torchrun start the trainer's workers (sharded_trainer.agent.torchrun_args)."""

from __future__ import annotations

import pytest

from sharded_api.contract import PodEnv
from sharded_trainer.agent import WORKER, torchrun_args

TRAINER = ["-m", "sharded_trainer", "--config", "/etc/sharded/trainer.yaml"]


def test_the_trainer_runs_as_a_function_forked_by_the_preloading_server(monkeypatch):
    monkeypatch.delenv(PodEnv.WORKER_START, raising=False)
    assert torchrun_args(TRAINER) == ["--run-path", "--start-method=forkserver", WORKER, *TRAINER[2:]]
    assert WORKER.endswith("sharded_trainer/__main__.py")


def test_spawn_and_a_users_command_start_workers_as_torchrun_always_does(monkeypatch):
    monkeypatch.setenv(PodEnv.WORKER_START, "spawn")
    assert torchrun_args(TRAINER) == TRAINER
    monkeypatch.delenv(PodEnv.WORKER_START)
    assert torchrun_args(["train.py", "--lr", "1e-4"]) == ["train.py", "--lr", "1e-4"]


def test_an_unknown_start_method_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(PodEnv.WORKER_START, "fork")  # forking torchrun's threaded agent is unsafe
    with pytest.raises(ValueError, match="SHARDED_WORKER_START must be forkserver or spawn, not 'fork'"):
        torchrun_args(TRAINER)
