"""Runs shared by the trainer tier's modules: each torchrun launch costs tens of seconds on 2 cores."""

from __future__ import annotations

import pytest

from helpers.torchrun_jobs import run_job, write_config


@pytest.fixture(scope="session")
def world4_run(tmp_path_factory):
    """An uninterrupted 2x2 run of 20 steps per strategy (micro-batch 4, global batch 16), checkpointing at
    10 and 20; made once per strategy and shared: (strategy, directory, config, run)."""
    made: dict = {}

    def get(strategy: str):
        if strategy not in made:
            tmp = tmp_path_factory.mktemp(f"ref-{strategy}")
            config = write_config(tmp, **{"strategy.type": strategy, "tensorboard": True})
            run = run_job(tmp, config)
            assert run.returncodes == [0, 0], run.output[-3000:]
            made[strategy] = (strategy, tmp, config, run)
        return made[strategy]

    return get
